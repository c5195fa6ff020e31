"""Proposers: draft K tokens for a round, on the device, through the runner's head step.

`MTPProposer` drafts with the model's NextN head. Its first pass writes the head rows of the
tokens the last round kept (its accepted drafts, paired with their true trunk hiddens, and the
new pending token with the hidden of its predecessor) into the draft K/V, at a fixed shape of
K_max + 1 rows whatever was accepted (rows past the kept ones land beyond and are overwritten
later); the kept row's output gives draft 1. Drafts 2..K chain the head's own output hidden.
`ProfileProposer` replaces the head's drafts with tokens of a chosen acceptance (benchmarks).

Tensor-only interface: the runner, the slot's cache and sampler come in as arguments; nothing
here reads the host, so a round's draft is captured in its CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nextn.cache import SlotCache
from nextn.cache.hybrid import ACCEPTED, DRAFT_LEN, NUM_GEN, SEQ_LEN
from nextn.config import STEP_ROWS
from nextn.sampling import RequestRng, Stream


class DraftIO(NamedTuple):
    """A slot's round buffers the proposer reads and writes."""

    verify_ids: torch.Tensor  # [R] long: [pending token, drafts...]; the proposer writes 1..K
    head_ids: torch.Tensor  # [R] long: the last round's kept tokens (accepted drafts, then the pending token)
    hidden: torch.Tensor  # [R, H] the last verify's head-input hiddens (row 0 at its first position)
    draft_q: torch.Tensor  # [R - 1, V] float32: the law of each sampled draft
    logits: torch.Tensor  # [1, V] float32 scratch: the head's logits
    chained: torch.Tensor  # [1, H] scratch: the head's hidden to chain


class MTPProposer:
    def __init__(self, runner, p_min: float = 0.0):
        if runner.model.mtp is None:
            raise ValueError("the checkpoint has no MTP head (mtp.* tensors)")
        self.runner, self.p_min = runner, p_min
        self.steps = torch.arange(STEP_ROWS, device=runner.device, dtype=torch.int32)  # [STEP_ROWS]

    def propose(self, cache: SlotCache, sampler, io: DraftIO, k: int):
        """Draft k >= 1 tokens into io.verify_ids[1:k+1] (and their q into io.draft_q[:k] when
        sampled). Returns how many count: k, or the drafts before the first whose head probability
        is below p_min (a device scalar)."""
        ctl = cache.ctl
        # first pass: the last round's kept tokens, from draft K/V slot DRAFT_LEN; row ACCEPTED (the
        # pending token's) gives draft 1
        self.runner.step.head(
            cache, io.head_ids, io.hidden, ctl[DRAFT_LEN : DRAFT_LEN + 1], ctl[ACCEPTED].long(), io.logits, io.chained
        )
        # the chain: draft j + 1's row sits in draft K/V slot SEQ_LEN + j (the pending token's is SEQ_LEN - 1)
        chain_pos = ctl[SEQ_LEN] + self.steps[: max(k - 1, 1)]
        u = None if sampler.kind.greedy else sampler.uniforms_at(Stream.DRAFT, ctl[NUM_GEN], k)
        confidence = []
        for j in range(k):
            token = io.verify_ids[1 + j : 2 + j]
            confidence.append(
                sampler.draft(
                    io.logits,
                    io.verify_ids[1 : 1 + j],
                    None if u is None else u[j : j + 1],
                    token,
                    io.draft_q[j : j + 1],
                )
            )
            if j + 1 < k:
                self.runner.step.head(cache, token, io.chained, chain_pos[j : j + 1], 0, io.logits, io.chained)
        if self.p_min <= 0.0:
            return k
        return (torch.cat(confidence) >= self.p_min).long().cumprod(0).sum()


class ProfileProposer:
    """Drafts of a chosen acceptance, for measuring speed-ups where the head guesses nothing (random
    weights): the real head drafts (and is paid for), then draft j is replaced, with probability
    profile[j], by the token plain decoding emits at its position (so the verify accepts it) and
    otherwise by another token. Draws are seeded Philox, a pure function of the position."""

    def __init__(self, base: MTPProposer, profile: list[float], reference_ids: list[int], seed: int = 0):
        device = base.runner.device
        self.base, self.p_min = base, base.p_min
        self.profile = torch.tensor(profile, dtype=torch.float64, device=device)
        self.reference = torch.tensor(reference_ids, dtype=torch.long, device=device)
        self.rng = RequestRng(seed)

    def propose(self, cache: SlotCache, sampler, io: DraftIO, k: int):
        if not sampler.kind.greedy:  # a replaced draft is not drawn from its q: sampled rounds would not be exact
            raise ValueError("an acceptance profile drives greedy decoding only")
        num_drafts = self.base.propose(cache, sampler, io, k)
        index = cache.ctl[NUM_GEN].long() + torch.arange(
            k, device=io.verify_ids.device
        )  # generated index of each draft
        right = self.reference[index.clamp(max=self.reference.numel() - 1)]
        hit = (
            self.rng.uniforms(index, 0)
            < self.profile[torch.arange(k, device=index.device).clamp(max=self.profile.numel() - 1)]
        )
        io.verify_ids[1 : k + 1] = torch.where(hit, right, (right + 1) % self.base.runner.cfg.vocab_size)
        return num_drafts
