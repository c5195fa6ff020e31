"""Per-request token choice: wraps the sampling pipeline (penalties, temperature, filters), the
request's seeded uniforms and its token history, for plain steps, draft steps and verify rounds.

Generated token number i always uses uniform i of its stream, so a seeded request reproduces
whatever K is and however its tokens fall into rounds.
"""
from __future__ import annotations

import torch

from nextn.core import SamplingParams
from nextn.sampling import (
    RequestRng, Stream, TokenHistory, greedy_ids, has_penalties, probs_from_logits, sample,
)
from nextn.spec.rejection import VerifyResult, verify_greedy, verify_sampled

_TABLE_SLACK = 20  # uniforms beyond max_tokens: a round may draft past the budget by K <= 16


class TokenSelector:
    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device):
        self.params = params
        self.num_generated = 0  # index of the next generated token
        self.history = None
        if has_penalties(params):
            self.history = TokenHistory.from_ids(prompt_ids, [], vocab_size, device)
        self.uniforms = None
        if not params.greedy:
            self.uniforms = RequestRng(params.seed).table(0, params.max_tokens + _TABLE_SLACK, device)

    def _u(self, stream: Stream, start: int, count: int) -> torch.Tensor:
        return self.uniforms[int(stream), start : start + count]

    def first(self, logits: torch.Tensor) -> int:
        """The token after the prompt, from the trunk's last logits [V]."""
        out_ids = self.verify(logits[None], logits.new_zeros(0, dtype=torch.long), None)[1]
        return out_ids[0]

    def draft(self, logits: torch.Tensor, drafts_so_far: torch.Tensor):
        """One draft step from head logits [1, V]; drafts_so_far [j] long (this round's earlier drafts).

        Returns (token [1] long, q [1, V] or None for greedy, raw head probability of the pick [1]).
        """
        index = self.num_generated + drafts_so_far.numel()
        if self.params.greedy:
            token, q = greedy_ids(logits, self.params, self.history, drafts_so_far), None
        else:
            q = probs_from_logits(logits, self.params, self.history, drafts_so_far)  # [1, V]
            token = sample(q, self._u(Stream.DRAFT, index, 1))
        confidence = torch.softmax(logits.float(), dim=-1).gather(-1, token[:, None])[:, 0]
        return token, q, confidence

    def verify(self, logits: torch.Tensor, draft_ids: torch.Tensor, draft_q: torch.Tensor | None):
        """Verify rows logits [k+1, V] against draft_ids [k] (q [k, V] or None when greedy).

        Returns (num_accepted, emitted ids: accepted drafts then the recovered/bonus token). The
        only host read of the round.
        """
        n, out_ids = self._verify_on_device(logits, draft_ids, draft_q, self.num_generated)
        host = torch.cat([n.reshape(1), out_ids]).tolist()
        return host[0], host[1 : host[0] + 2]

    def select(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        """Generated token number `index` from trunk logits [1, V], as a device tensor [1] long,
        without reading the host: the token `verify` emits for a round with no drafts (the same
        ops), for a loop that queues the next step before it reads this token. Needs no
        penalty history (it would have to hold the tokens before `index`)."""
        if self.history is not None:
            raise ValueError("select() cannot apply penalties: their history lags the device")
        return self._verify_on_device(logits, logits.new_zeros(0, dtype=torch.long), None, index).out_ids

    def _verify_on_device(self, logits: torch.Tensor, draft_ids: torch.Tensor, draft_q: torch.Tensor | None,
                          index: int) -> VerifyResult:
        """`verify` without the host read; row 0 of logits predicts generated token `index`."""
        k = draft_ids.numel()
        if self.params.greedy:
            target = greedy_ids(logits, self.params, self.history, draft_ids)  # [k+1]
            return verify_greedy(target, draft_ids)
        p = probs_from_logits(logits, self.params, self.history, draft_ids)  # [k+1, V]
        u_accept, u_sample = self._u(Stream.ACCEPT, index, k), self._u(Stream.SAMPLE, index, k + 1)
        return verify_sampled(p, draft_q, draft_ids, u_accept, u_sample)

    def record(self, emitted: list[int]) -> None:
        """Count tokens emitted to the client (history for penalties, index for uniforms)."""
        if self.history is not None and emitted:
            self.history.append(emitted)
        self.num_generated += len(emitted)
