"""A served request's output in the API process (vLLM v1's OutputProcessor): the engine core sends
token ids; here they become text deltas, stop strings end the output (nextn.engine.detokenizer:
the implementation `LLM` uses in one process), and the events the HTTP side streams are made.

A stop string found here cuts the round's tokens (and their logprobs and draft counts) at the
token completing it, and the core is told to end the request there (`push` returns the count of
tokens kept: the worker sends AbortRequest(num_tokens)). The cut event is held until the core's
output comes (its answer to that abort, or its own end if it finished first): that output's
prompt facts and timings stand; its tokens, logprobs, finish and stop reasons and spec counts are
the ones kept here, so the request reads exactly as it would from `LLM` alone. Tokens of rounds the
core ran meanwhile are dropped. Called from one thread (the one reading the core's messages).
"""

from __future__ import annotations

import dataclasses

from nextn.core import RequestOutput, SamplingParams, SpecStats
from nextn.engine.core import RequestEvent
from nextn.engine.detokenizer import Detokenizer
from nextn.engine.engine import StreamEvent
from nextn.tokenizer import Tokenizer


class JobOutput:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.detok = Detokenizer(tokenizer, params)
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.spec = SpecStats()  # the rounds as kept (the core's own differ once a stop string cut them)
        self.held: StreamEvent | None = None  # the event a stop string ended, until the core's output

    def push(self, ev: RequestEvent) -> tuple[StreamEvent | None, int | None]:
        """A core event of this request -> (the event for the client, None while one is held or
        dropped; the tokens to end the core's request after, when a stop string just ended it)."""
        if self.detok.stopped:  # rounds past the stop string are dropped; the output ends the held event
            return (None if ev.output is None else self._final(self.held, ev.output)), None
        last = ev.output is not None
        ids, text = self.detok.push(ev.token_ids, last)
        entries = None if ev.logprobs is None else ev.logprobs[: len(ids)]
        if self.logprobs is not None:
            self.logprobs.extend(entries or [])
        if ev.round_counts is not None:
            self.spec.record_emitted(*ev.round_counts, len(ids))
        event = StreamEvent(ids, text, None, entries)
        if last:
            return self._final(event, ev.output), None
        if self.detok.stopped:
            self.held = event
            return None, len(self.detok.token_ids)
        return event, None

    def _final(self, event: StreamEvent, output: RequestOutput) -> StreamEvent:
        """The core's output with its text (a copy: an in-process core's object is its own)."""
        cut = {}
        if self.detok.stopped:  # the output as it ended at the stop string, whatever the core ran past it
            cut = dict(token_ids=list(self.detok.token_ids), logprobs=self.logprobs, finish_reason="stop")
            cut.update(stop_reason=self.detok.stop_string, spec=self.spec)
        event.output = dataclasses.replace(output, text=self.detok.text, **cut)
        return event
