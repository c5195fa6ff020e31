"""Proposers: draft K tokens for each sequence of a batched round, on the device, through the
runner's head step.

`MTPProposer` drafts with the model's NextN head. Its first pass writes, for every sequence, the
head rows of the tokens its last round kept (its accepted drafts, paired with their true trunk
hiddens, and the new pending token with the hidden of its predecessor) into its draft K/V, at a
fixed shape of K_max + 1 rows whatever was accepted (rows past the kept ones land beyond and are
overwritten later); each sequence's kept row gives its draft 1. Drafts 2..K chain the head's own
output hidden, one row per sequence still drafting (K may differ per sequence).
With a draft vocabulary (SpecConfig.draft_vocab, FR-Spec) the head scores its rows only, from a
copy of them made here at load (nextn.spec.draft_vocab.DraftHead), into the proposer's own
[rows, Vd] logits; the sampler maps each draft through d2t and scatters its q onto target ids.
`ProfileProposer` replaces the head's drafts with tokens of a chosen acceptance (benchmarks).

Tensor-only interface: the members (slot cache, sampler, round buffers, K) come in as arguments;
nothing here reads the host, so a round's drafts are captured in its CUDA graph.
"""

from __future__ import annotations

import torch

from nextn.cache.hybrid import ACCEPTED, DRAFT_LEN, NUM_GEN, SEQ_LEN
from nextn.sampling import RequestRng, Stream
from nextn.spec.draft_vocab import DraftHead


class MTPProposer:
    def __init__(self, runner, p_min: float = 0.0):
        if runner.model.mtp is None:
            raise ValueError("the checkpoint has no MTP head (mtp.* tensors)")
        self.runner, self.p_min = runner, p_min
        vocab = runner.config.spec.draft_vocab
        self.draft = None if vocab is None else DraftHead(vocab, runner.model.lm_head_weight)
        # the head's rows to score (None: the step's full lm_head) and its logits [rows, V or Vd]
        self.lm_head = None if self.draft is None else self.draft.lm_head
        self.logits = runner.head_logits
        if self.draft is not None:
            self.logits = runner.head_logits.new_zeros(runner.head_logits.shape[0], self.draft.size)

    def propose(self, members: list) -> list:
        """Draft members[b].k >= 1 tokens into each member's buf.verify_ids[1:k+1] (and their q into
        buf.draft_q[:k] when sampled). Returns per member how many count: k, or the drafts before
        the first whose head probability is below p_min (a device scalar)."""
        runner, B = self.runner, len(members)
        R = members[0].buf.verify_ids.shape[0]
        tensors = members[0].cache.cache.tensors
        # first pass: each sequence's last kept tokens from its draft K/V slot DRAFT_LEN; its row
        # ACCEPTED (the pending token's) gives draft 1
        batch = runner.batch([m.cache for m in members], [R] * B)
        flat = batch.flat_rows(R)
        ids = tensors["head_ids"].view(-1).index_select(0, flat)
        hidden = tensors["hidden"].flatten(0, 1).index_select(0, flat)
        rows = batch.seqs[1] + batch.field(ACCEPTED)
        logits, chained = self.logits[:B], runner.head_hidden[:B]
        runner.step.head(batch, ids, hidden, batch.field(DRAFT_LEN), rows.long(), logits, chained, self.lm_head)
        uniforms = [
            None if m.sampler.kind.greedy else m.sampler.uniforms_at(Stream.DRAFT, m.cache.ctl[NUM_GEN], m.k)
            for m in members
        ]
        confidence: list[list] = [[] for _ in members]
        for j in range(max(m.k for m in members)):
            for b, m in enumerate(members):
                if m.k > j:
                    u = uniforms[b]
                    confidence[b].append(
                        m.sampler.draft(
                            logits[b : b + 1],
                            m.buf.verify_ids[1 : 1 + j],
                            None if u is None else u[j : j + 1],
                            m.buf.verify_ids[1 + j : 2 + j],
                            m.buf.draft_q[j : j + 1],
                            self.draft,
                        )
                    )
            # the chain: draft j + 1's row sits in draft K/V slot SEQ_LEN + j (the pending token's is SEQ_LEN - 1)
            chain = [b for b, m in enumerate(members) if m.k > j + 1]
            if chain:
                self._chain(batch if len(chain) == B else None, [members[b] for b in chain], chain, j, logits, chained)
        if self.p_min <= 0.0:
            return [m.k for m in members]
        return [(torch.cat(c) >= self.p_min).long().cumprod(0).sum() for c in confidence]

    def _chain(self, full, members: list, index: list[int], j: int, logits, chained) -> None:
        """One head step for members (at positions index of the batch) with their drafts j."""
        runner = self.runner
        batch = runner.batch([m.cache for m in members], [1] * len(members))
        ids = torch.cat([m.buf.verify_ids[1 + j : 2 + j] for m in members])
        first = batch.field(SEQ_LEN) + j
        if full is not None:  # every sequence chains: in place
            runner.step.head(batch, ids, chained, first, None, logits, chained, self.lm_head)
            return
        at = runner.index(index)
        out_logits, out_hidden = self.logits[-len(members) :], runner.head_hidden[-len(members) :]
        runner.step.head(batch, ids, chained.index_select(0, at), first, None, out_logits, out_hidden, self.lm_head)
        logits.index_copy_(0, at, out_logits)
        chained.index_copy_(0, at, out_hidden)


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

    def propose(self, members: list) -> list:
        if any(not m.sampler.kind.greedy for m in members):  # a replaced draft is not drawn from its q
            raise ValueError("an acceptance profile drives greedy decoding only")
        num_drafts = self.base.propose(members)
        runner, k_max = self.base.runner, max(m.k for m in members)
        verify_ids = members[0].cache.cache.tensors["verify_ids"]  # [S, R]
        slots = runner.index([m.cache.slot for m in members])
        steps = torch.arange(k_max, device=self.reference.device)
        index = members[0].cache.cache.ctl[slots, NUM_GEN].long()[:, None] + steps  # generated index of each draft
        right = self.reference[index.clamp(max=self.reference.numel() - 1)]  # [B, k_max] per draft's index
        hit = self.rng.uniforms(index, 0) < self.profile[steps.clamp(max=self.profile.numel() - 1)]
        ids = verify_ids.index_select(0, slots)
        replace = steps[None] < runner.index([m.k for m in members])[:, None]  # each member's own k drafts
        ids[:, 1 : k_max + 1] = torch.where(
            replace, torch.where(hit, right, (right + 1) % runner.cfg.vocab_size), ids[:, 1 : k_max + 1]
        )
        verify_ids.index_copy_(0, slots, ids)
        return num_drafts
