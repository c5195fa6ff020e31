"""One slot's token choice on the device: the request's sampling values as device scalars, its
seeded uniforms and its penalty history, kept in the slot's cache buffers, so a round's CUDA graph
(captured once per slot, K and `SamplerKind`) serves every request. Drawing, drafting and
verifying are device ops with no host read; the host fills the buffers once per request.

Generated token number i always uses uniform i of its stream (nextn.sampling), so a seeded request
reproduces whatever K is and however its tokens fall into rounds.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nextn.cache import SlotCache
from nextn.cache.hybrid import NUM_GEN
from nextn.config import STEP_ROWS
from nextn.core import SamplingParams
from nextn.sampling import (
    RequestRng,
    SamplerKind,
    Stream,
    TokenHistory,
    greedy_ids,
    penalized_logits,
    probs_from_logits,
    sample,
)
from nextn.spec.draft_vocab import DraftHead
from nextn.spec.verifier import VerifyResult, gate_draft_probs, verify_greedy, verify_sampled

VALUES = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens")


def sampler_buffers(vocab_size: int, max_len: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Per-slot buffers: values, top_k, uniforms of every stream for any generated index a request
    can reach (a round may draft 2 * STEP_ROWS past the budget), penalty history."""
    return [
        ("sampling_values", (len(VALUES),), torch.float32),
        ("sampling_top_k", (1,), torch.long),
        ("uniforms", (len(Stream), max_len + 2 * STEP_ROWS + 2), torch.float64),
        ("prompt_mask", (vocab_size,), torch.bool),
        ("output_counts", (vocab_size,), torch.int32),
        ("stop_mask", (vocab_size,), torch.bool),  # the tokens min_tokens bans
    ]


class SlotSampler:
    def __init__(self, cache: SlotCache, p_min: float = 0.0):
        self.p_min = p_min
        values = cache.t("sampling_values")
        self.values = SimpleNamespace(
            **{name: values[i] for i, name in enumerate(VALUES)}, top_k=cache.t("sampling_top_k")[0]
        )
        self.uniforms = cache.t("uniforms")  # [streams, U] float64
        self.history = TokenHistory(cache.t("prompt_mask"), cache.t("output_counts"))
        self.stop_mask = cache.t("stop_mask")
        self.ctl = cache.ctl
        self.kind = SamplerKind(greedy=True)

    def start(self, params: SamplingParams, prompt_ids: list[int], stop_ids: set[int] = frozenset()) -> None:
        """Load a request's values, uniforms and history (host -> device, once per request);
        stop_ids: the tokens min_tokens bans (EOS and the request's stop ids)."""
        self.kind = SamplerKind.of(params)
        device = self.uniforms.device
        for name in VALUES:
            getattr(self.values, name).fill_(getattr(params, name))
        self.values.top_k.fill_(params.top_k)
        if not self.kind.greedy:
            count = min(self.uniforms.shape[1], params.max_tokens + 2 * STEP_ROWS + 2)
            self.uniforms[:, :count].copy_(RequestRng(params.seed).table(0, count, device))
        if self.kind.min_tokens:
            self.stop_mask.zero_()
            if stop_ids:
                self.stop_mask[torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)] = True
        if self.kind.penalties:
            self.history.prompt_mask.zero_()
            self.history.prompt_mask[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
            self.history.output_counts.zero_()

    def uniforms_at(self, stream: Stream, start: torch.Tensor, count: int) -> torch.Tensor:
        """Uniforms [count] of indices start.. (start a device scalar)."""
        idx = start.long() + torch.arange(count, device=self.uniforms.device)
        return self.uniforms[int(stream)].index_select(0, idx)

    def _history(self):
        return self.history if self.kind.penalties else None

    def _banned(self, logits: torch.Tensor, first: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """logits [N, V] of generated indices first.. with the stop tokens masked out where the
        index is below min_tokens (draft and target alike: the same law on both sides). columns
        [Vd]: the target ids of the logits' columns (a draft vocabulary's d2t; default all V)."""
        if not self.kind.min_tokens:
            return logits
        index = first.long() + torch.arange(logits.shape[0], device=logits.device)
        stop = self.stop_mask if columns is None else self.stop_mask[columns]
        ban = (index < self.values.min_tokens)[:, None] & stop[None]
        return logits.float().masked_fill(ban, float("-inf"))

    def draft(
        self,
        logits: torch.Tensor,
        drafts_so_far: torch.Tensor,
        u: torch.Tensor | None,
        token: torch.Tensor,
        q: torch.Tensor,
        vocab: DraftHead | None = None,
    ):
        """One draft step from head logits [1, V] into token ([1] long, a slot of the round's ids)
        and, sampled, its law into q ([1, V], a row of the round's buffer); drafts_so_far [j] long;
        u [1]: the draft's DRAFT uniform. With a draft vocabulary `vocab`, logits are [1, Vd] over
        its rows: the pick maps through d2t, q is the subset's law scattered onto the target ids
        (zero elsewhere), penalties and the min_tokens ban read target ids projected onto the subset.
        Returns the head's probability of its pick [1] (over the subset, with a draft vocabulary)
        when a p_min gate is on, else None; sampled, q is then the law of a draft the gate keeps
        (restricted to the tokens whose head probability reaches p_min: nextn.spec.verifier)."""
        history, so_far, pick, columns = self._history(), drafts_so_far, token, None
        if vocab is not None:
            history, so_far = vocab.project(history, drafts_so_far)
            pick, columns = torch.empty_like(token), vocab.d2t  # the draft row, mapped to its target id below
        logits = self._banned(logits, self.ctl[NUM_GEN] + drafts_so_far.numel(), columns)  # draft j: NUM_GEN + j
        probs = None
        if self.kind.greedy:
            torch.argmax(penalized_logits(logits, self.values, history, so_far, self.kind), dim=-1, out=pick)
        else:
            probs = probs_from_logits(logits, self.values, history, so_far, self.kind, out=q if vocab is None else None)
            sample(probs, u, out=pick)
        confidence = None
        if self.p_min > 0.0:
            head = torch.softmax(logits.float(), dim=-1)  # [1, V or Vd] the head's own probabilities
            confidence = head.gather(-1, pick[:, None])[:, 0]
            if probs is not None:
                gate_draft_probs(probs, head >= self.p_min)
        if vocab is not None:
            if probs is not None:
                vocab.scatter(probs, out=q)
            vocab.to_target(pick, out=token)
        return confidence

    def verify(
        self,
        logits: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_q: torch.Tensor | None,
        num_drafts,
        index: torch.Tensor,
    ) -> VerifyResult:
        """Verify rows logits [k+1, V] (row 0 predicts generated index `index`) against draft_ids
        [k] (q [k, V] or None when greedy), the first num_drafts of which count."""
        logits = self._banned(logits, index)
        if self.kind.greedy:
            target = greedy_ids(logits, self.values, self._history(), draft_ids, self.kind)  # [k+1]
            return verify_greedy(target, draft_ids, num_drafts)
        k = draft_ids.numel()
        p = probs_from_logits(logits, self.values, self._history(), draft_ids, self.kind)  # [k+1, V]
        return verify_sampled(
            p,
            draft_q,
            draft_ids,
            self.uniforms_at(Stream.ACCEPT, index, k),
            self.uniforms_at(Stream.SAMPLE, index, k + 1),
            num_drafts,
        )

    def record(self, out_ids: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Count a round's emitted tokens (out_ids [k+1], the first n+1 real) in the penalty history."""
        if self.kind.penalties:
            kept = (torch.arange(out_ids.numel(), device=out_ids.device) <= num_accepted).int()
            self.history.output_counts.index_add_(0, out_ids.clamp(min=0), kept)
