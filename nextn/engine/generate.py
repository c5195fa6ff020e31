"""The round loop of one request: draft -> verify -> accept -> bonus, until a stop.

Plain decoding is the same loop with zero drafts: each round verifies just the pending token.
The pending (bonus) token is emitted at once but enters the trunk cache only as column 0 of the
next round's verify, so no round spends a forward on it alone.

`verify_rounds` reads each round's outcome before it queues the next round. Plain decoding whose
token choice needs nothing from the host (no drafts, no penalty history) runs `pipelined_rounds`
instead: the same rounds, each queued on the device before the host reads the previous token, so
the host's per-round work overlaps a running step. Both emit the same tokens and leave the same
state.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator

import torch

from nextn.config import SpecConfig
from nextn.core import SamplingParams, SpecStats
from nextn.engine.runner import ModelRunner
from nextn.engine.selector import TokenSelector
from nextn.engine.state import SeqState
from nextn.spec.proposer import MTPProposer


@dataclass
class Emitted:
    """Tokens one round emits, and how it ended."""

    token_ids: list[int]
    logprob_rows: torch.Tensor | None  # [len(token_ids), V] trunk logits that predicted them
    finish_reason: str | None  # None while running, else "stop" or "length"


class AdaptiveK:
    """Draft length for the next round: back off to what was accepted, grow after full accepts."""

    def __init__(self, k_max: int, adaptive: bool):
        self.k_max, self.adaptive, self.k = k_max, adaptive, k_max

    def update(self, drafted: int, accepted: int) -> None:
        if self.adaptive and drafted > 0:
            self.k = min(self.k_max, accepted + 1) if accepted < drafted else min(self.k_max, self.k + 1)


def run_rounds(
    runner: ModelRunner,
    proposer: MTPProposer | None,
    state: SeqState,
    params: SamplingParams,
    spec: SpecConfig,
    stop_ids: set[int],
    stats: SpecStats,
    want_logits: bool = False,
) -> Iterator[Emitted]:
    """Generate after the state's committed tokens (its last_logits predict the first token)."""
    if params.max_tokens == 0:
        yield Emitted([], None, "length")
        return
    selector = TokenSelector(params, state.tokens, runner.cfg.vocab_size, runner.device)
    no_drafts = proposer is None or spec.num_speculative_tokens == 0
    if no_drafts and selector.history is None:
        yield from pipelined_rounds(runner, state, selector, stop_ids, stats, want_logits)
    else:
        yield from verify_rounds(runner, proposer, state, selector, spec, stop_ids, stats, want_logits)


def verify_rounds(
    runner: ModelRunner,
    proposer: MTPProposer | None,
    state: SeqState,
    selector: TokenSelector,
    spec: SpecConfig,
    stop_ids: set[int],
    stats: SpecStats,
    want_logits: bool = False,
) -> Iterator[Emitted]:
    """The round loop for any K and any selector (a fresh one; max_tokens >= 1)."""
    budget = selector.params.max_tokens
    bonus = selector.first(state.last_logits)
    selector.record([bonus])
    done = _finish(bonus, 1, budget, stop_ids)
    yield Emitted([bonus], state.last_logits[None] if want_logits else None, done)
    generated = 1
    k_ctl = AdaptiveK(spec.num_speculative_tokens if proposer else 0, spec.adaptive)
    while done is None:
        # a round emits at most k + 1 tokens; never draft past the budget or the context
        room = state.cache.max_len - len(state.tokens) - 1
        k = max(0, min(k_ctl.k, budget - generated - 1, room))
        if len(state.tokens) + 1 > state.cache.max_len:
            yield Emitted([], None, "length")
            return
        draft = proposer.propose(state, bonus, k, selector) if k > 0 else None
        draft_ids = draft.token_ids if draft else torch.zeros(0, dtype=torch.long, device=runner.device)
        verify_ids = torch.cat([torch.tensor([bonus], device=runner.device), draft_ids])
        logits, hidden = runner.step(state, verify_ids)
        num_accepted, emitted = selector.verify(logits, draft_ids, draft.probs if draft else None)
        stats.record_round(draft_ids.numel(), num_accepted)
        k_ctl.update(draft_ids.numel(), num_accepted)
        # stop at the first stop token or the budget, inside the round
        for i, tok in enumerate(emitted):
            done = _finish(tok, generated + i + 1, budget, stop_ids)
            if done:
                emitted = emitted[: i + 1]
                break
        kept = len(emitted)  # verify columns whose tokens stay: the old bonus and kept-1 drafts
        state.cache.commit(kept)
        state.commit([bonus] + emitted[:-1], hidden[:kept], logits[kept - 1])
        selector.record(emitted)
        generated += kept
        bonus = emitted[-1]
        yield Emitted(emitted, logits[:kept] if want_logits else None, done)


def pipelined_rounds(
    runner: ModelRunner,
    state: SeqState,
    selector: TokenSelector,
    stop_ids: set[int],
    stats: SpecStats,
    want_logits: bool = False,
) -> Iterator[Emitted]:
    """Plain decoding with one round of lag (a fresh selector without penalties; max_tokens >= 1).

    The step that takes token n (and the choice of token n + 1 from its logits) is queued on the
    device before the host reads token n, so the read, the stop checks, the commits and the
    consumer's work on the round all overlap a running step. A step is committed only once its
    input token is known not to end the request; until then the state is what `verify_rounds`
    leaves at the same point. Token n ending the request by the budget or the context is known
    before its step would be queued, so that step never runs; a stop token is not, so the step
    queued after it is discarded: one wasted step per request that stops.
    """
    cache, budget = state.cache, selector.params.max_tokens
    reader = _TokenReader(runner.device)
    logits = state.last_logits[None]  # [1, V] the logits that predict token n
    token = selector.select(logits, 0)  # [1] long, token n on the device
    reader.push(token)
    token_id = None  # token n-1 on the host
    queued = None  # (logits [1, V], hidden [1, H]) of the step queued and not yet committed
    try:
        for n in range(budget):  # token budget - 1 always finishes: the loop ends by returning
            if queued is not None:  # token n-1 did not end the request: keep its step
                logits, hidden = queued
                cache.commit(1)
                state.commit([token_id], hidden, logits[0])
                queued = None
            if n + 1 < budget and len(state.tokens) + 1 <= cache.max_len:
                queued = runner.step(state, token)
                token = selector.select(queued[0], n + 1)
                reader.push(token)
            token_id = reader.pop()  # token n: waits for it, not for the step just queued
            done = _finish(token_id, n + 1, budget, stop_ids)
            if n > 0:
                stats.record_round(0, 0)
            selector.record([token_id])
            if done is not None and queued is not None:
                cache.discard_step()
                queued = None
            yield Emitted([token_id], logits if want_logits else None, done)
            if done is not None:
                return
            if queued is None:  # the context is full
                yield Emitted([], None, "length")
                return
    finally:
        if queued is not None:  # the consumer closed the generator between rounds
            cache.discard_step()


class _TokenReader:
    """Device -> host reads of token ids [1], started when a token is queued and finished when
    the host needs it (at most two in flight). On CUDA a non-blocking copy into pinned memory and
    an event: finishing waits for that token only, where `.item()` would also wait for the step
    queued after it. Elsewhere the read happens at `pop`."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.queue: deque = deque()  # the tokens (CUDA: the pinned slots) in read order
        if self.stream is not None:
            self.host = torch.empty(2, dtype=torch.long, pin_memory=True)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
            self.slot = 0

    def push(self, token_id: torch.Tensor) -> None:
        if self.stream is None:
            self.queue.append(token_id)
            return
        slot, self.slot = self.slot, self.slot ^ 1
        self.host[slot : slot + 1].copy_(token_id, non_blocking=True)
        self.events[slot].record(self.stream)
        self.queue.append(slot)

    def pop(self) -> int:
        item = self.queue.popleft()
        if self.stream is None:
            return int(item)
        self.events[item].synchronize()
        return int(self.host[item])


def _finish(token: int, num_generated: int, budget: int, stop_ids: set[int]) -> str | None:
    if token in stop_ids:
        return "stop"
    if num_generated >= budget:
        return "length"
    return None
