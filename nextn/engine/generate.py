"""The round loop of one request: draft -> verify -> accept -> bonus, until a stop.

Plain decoding is the same loop with zero drafts: each round verifies just the pending token.
The pending (bonus) token is emitted at once but enters the trunk cache only as column 0 of the
next round's verify, so no round spends a forward on it alone.
"""
from __future__ import annotations

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
    budget = params.max_tokens
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


def _finish(token: int, num_generated: int, budget: int, stop_ids: set[int]) -> str | None:
    if token in stop_ids:
        return "stop"
    if num_generated >= budget:
        return "length"
    return None
