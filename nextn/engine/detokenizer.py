"""One request's text as its tokens come (vLLM v1's IncrementalDetokenizer with its stop checker):
incremental decoding (incomplete UTF-8 held back: nextn.tokenizer.IncrementalDecoder), stop
strings (nextn.engine.stops: none ending within the text of the first min_tokens - 1 tokens) and
the cut of a round's tokens back to those the kept text covers.

The one implementation of stop strings, used wherever tokens become text: by the engine for a
request of `LLM` in one process (Engine._postprocess, which then closes the request's rounds at
the cut), and by the API process for a served request (nextn.server.outputs: the engine core
sends token ids only, and a stop string found there ends the request in the core). Does not know
rounds, slots or messages.
"""

from __future__ import annotations

from nextn.core import SamplingParams
from nextn.engine.stops import StopStrings
from nextn.tokenizer import IncrementalDecoder, Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopStrings(params.stop, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens
        self.token_ids: list[int] = []  # the tokens kept
        self.released = 0  # characters handed out before the last delta
        self.text: str | None = None  # the whole output's text, once over (a stop string, or the last tokens)
        self._floor: int | None = None  # min_tokens: the length of the first min_tokens - 1 tokens' text

    @property
    def stopped(self) -> bool:
        """A stop string ended the output."""
        return self.stops.hit is not None

    @property
    def stop_string(self) -> str | None:
        return self.stops.matched

    def push(self, ids: list[int], last: bool = False) -> tuple[list[int], str]:
        """A round's tokens (`last`: the request ends with them) -> (the tokens kept: all, or those up
        to the one completing a stop string; the text to hand out now). Once a stop string is found
        or the last tokens came, `text` is the whole output's and the delta returned ends it (nothing
        held back)."""
        if self.text is not None:
            raise RuntimeError("the request's text is complete")
        delta = self.stops.push(self.decoder.push(ids), self._stop_floor(ids))
        if self.stopped:
            ids = ids[: self._covering(ids, self.stops.hit)]
        self.token_ids.extend(ids)
        if not (last or self.stopped):
            self.released += len(delta)
            return ids, delta
        self.text = self.stops.text if self.stopped else self.tokenizer.decode(self.token_ids)
        return ids, self.text[self.released :]  # (with the text held back: a stop-string prefix, split UTF-8)

    def _stop_floor(self, ids: list[int]) -> float:
        """Where a stop string may end, past min_tokens (vLLM's: stop strings are looked for from the
        min_tokens-th token on): beyond the text of the first min_tokens - 1 tokens."""
        before = self.min_tokens - 1
        if before < 1 or not self.stops.stops:
            return -1
        if self._floor is None:
            done = self.token_ids + ids
            if len(done) < before:
                return float("inf")
            self._floor = len(self.tokenizer.decode(done[:before]).rstrip("\ufffd"))
        return self._floor

    def _covering(self, ids: list[int], text_len: int) -> int:
        """How many of `ids` (after the tokens kept) it takes for the text to reach `text_len` characters."""
        for n in range(1, len(ids)):  # (a character split over tokens decodes to "\ufffd" until whole)
            if len(self.tokenizer.decode(self.token_ids + ids[:n]).rstrip("\ufffd")) >= text_len:
                return n
        return len(ids)
