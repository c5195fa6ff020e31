"""Proposers: draft K tokens for each sequence of a batched round, on the device, through the
runner's head step.

`MTPProposer` drafts with the model's NextN head. Its first pass writes, for every sequence, the
head rows of the tokens its last round kept (its accepted drafts, paired with their true trunk
hiddens, and the new pending token with the hidden of its predecessor) into its draft K/V, at a
fixed shape of K_max + 1 rows whatever was accepted (rows past the kept ones land beyond and are
overwritten later); each sequence's kept row gives its draft 1. Drafts 2..K chain the head's own
output hidden, one row per sequence still drafting (K may differ per sequence).
A confidence gate (SpecConfig.p_min) cuts a sequence's chain at its first draft whose head
probability is below p_min, on the device: the drafts before it count (none when draft 1 is cut:
the round verifies the pending token alone). A head step runs only while some sequence of the
batch is still drafting: the fused step's kernels read the flag and return (`runner.when`), so a
cut saves head work with no host read; a sequence cut while others draft rides along in the
fixed-shape step and its rows are discarded. The verify keeps its K + 1 rows, but its GDN
recurrences stop at the rows that count (the trunk's `live`). When every member
is plain greedy (SlotSampler.plain_greedy), a draft step of all of them is one launch: argmax,
the head's probability of the pick and the gate's update (nextn.ops.triton_draft).
With a draft vocabulary (SpecConfig.draft_vocab, FR-Spec) the head scores its rows only, from a
copy of them made here at load (nextn.spec.draft_vocab.DraftHead), into the proposer's own
[rows, Vd] logits; the sampler maps each draft through d2t and scatters its q onto target ids.
`ProfileProposer` replaces the head's drafts with tokens of a chosen acceptance (benchmarks).

Tensor-only interface: the members (slot cache, sampler, round buffers, K; for a round not all
plain greedy, copies gathered at the member's device slot: nextn.engine.device_round.Lane) come in as arguments;
nothing here reads the host, so a round's drafts are captured in its CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nextn.cache.hybrid import ACCEPTED, DRAFT_LEN, NUM_GEN, SEQ_LEN
from nextn.ops.draft import DraftGate, greedy_draft_reference
from nextn.sample.pipeline import RequestRng, Stream
from nextn.spec.draft_vocab import DraftHead


class MTPProposer:
    def __init__(self, runner):
        if runner.model.mtp is None:
            raise ValueError("the checkpoint has no MTP head (mtp.* tensors)")
        spec = runner.config.spec
        self.runner, self.p_min, self.skip_cut = runner, spec.p_min, spec.draft_gate == "skip"
        self.fast = runner.config.kernels == "triton"  # the fused step, and the Triton draft kernel
        self.greedy_draft = greedy_draft_reference
        if self.fast:  # imported here: kernel modules load only where their kernels run
            from nextn.ops.triton_draft import greedy_draft

            self.greedy_draft = greedy_draft
        vocab = spec.draft_vocab
        self.draft = None if vocab is None else DraftHead(vocab, runner.model.lm_head_weight)
        # the head's rows to score (None: the step's full lm_head) and its logits [rows, V or Vd]
        self.lm_head = None if self.draft is None else self.draft.lm_head
        self.logits = runner.head_logits
        if self.draft is not None:
            self.logits = runner.head_logits.new_zeros(runner.head_logits.shape[0], self.draft.size)
        # with a gate on: head steps run (a round's first pass included), counted on the device [1]
        self.head_steps = torch.zeros(1, dtype=torch.long, device=runner.device) if self.p_min > 0 else None

    def propose(self, members: list) -> torch.Tensor | None:
        """Draft members[b].k >= 1 tokens into each member's buf.verify_ids[1:k+1] (and their q into
        buf.draft_q[:k] when sampled). Returns None when every draft counts (no gate), else the
        drafts that count per member [B] long: those before the first whose head probability is
        below p_min. Once every member is cut, the chain's remaining head steps do not run
        (`runner.when`: skipped on the device inside a graph), unless the gate is set to "mask"."""
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
        runner.step.head(batch, ids, hidden, batch.field(DRAFT_LEN), rows.long(), (logits, chained), self.lm_head)
        uniforms = [
            None if m.sampler.kind.greedy else m.sampler.uniforms_at(Stream.DRAFT, m.sampler.ctl[NUM_GEN], m.k)
            for m in members
        ]
        gate, fused = None, all(m.sampler.plain_greedy for m in members)
        if fused and self.p_min > 0.0:  # draft 1's step writes them (every member drafts it) and counts the first pass
            gate = _Gate(torch.empty(B, dtype=torch.bool, device=runner.device), torch.empty_like(ids[:B]))
        elif self.p_min > 0.0:
            gate = _Gate(torch.ones(B, dtype=torch.bool, device=runner.device), torch.zeros_like(ids[:B]))
            self.head_steps.add_(1)
        for j in range(max(m.k for m in members)):
            index = [b for b, m in enumerate(members) if m.k > j]  # the members drafting draft j

            def step(j=j, index=index):
                at = None if len(index) == B else runner.index(index)
                run_if = runner.step.run_if if self.fast else None  # set by runner.when
                if j > 0:  # draft j's row sits in draft K/V slot SEQ_LEN + j - 1 (the pending token's is SEQ_LEN - 1)
                    chain = [members[b] for b in index]
                    self._chain(batch if len(index) == B else None, chain, index, j - 1, logits, chained)
                    if gate is not None and not fused:
                        self.head_steps.add_(1 if run_if is None else run_if)
                if fused:
                    self._greedy_drafts(batch, index, j, at, logits, gate, run_if)
                    return
                confidence = [self._draft(members[b], j, logits[b : b + 1], uniforms[b]) for b in index]
                if gate is not None:
                    gate.cut(at, (confidence[0] if B == 1 else torch.cat(confidence)) >= self.p_min)

            if j > 0 and gate is not None and self.skip_cut:
                runner.when(gate.still_drafting(None if len(index) == B else runner.index(index)), step)
            else:
                step()
        return None if gate is None else gate.counted

    def _draft(self, m, j: int, logits: torch.Tensor, u: torch.Tensor | None):
        """Member m's draft j from its head logits [1, V or Vd] (its confidence when gated)."""
        ids, q = m.buf.verify_ids, m.buf.draft_q[j : j + 1]
        u = None if u is None else u[j : j + 1]
        confidence = m.sampler.draft(logits, ids[1 : 1 + j], u, ids[1 + j : 2 + j], q, self.draft)
        # drafted into a copy (nextn.engine.device_round.Lane): the next head step reads the slot's row
        if m.lane is not None:
            m.lane.store("verify_ids", ids)
        return confidence

    def _greedy_drafts(self, batch, index: list[int], j: int, at, logits, gate: _Gate | None, run_if) -> None:
        """Draft j of the batch's members at positions index (plain greedy; at: those positions,
        None: all) in one step: each argmax (through d2t with a draft vocabulary) into its slot's
        verify_ids[1 + j] (cells from the batch's device slots), and with a gate its update and
        head_steps; none of it where run_if is 0 (a step every member was cut from)."""
        verify_ids = batch.cache.tensors["verify_ids"]  # [S, R]
        R = verify_ids.shape[1]
        cells = (batch.slot_index if at is None else batch.slot_index.index_select(0, at)) * R + 1 + j
        d2t = None if self.draft is None else self.draft.d2t
        draft_gate = None if gate is None else DraftGate(gate.live, gate.counted, self.p_min, self.head_steps, j == 0)
        self.greedy_draft(logits, verify_ids.view(-1), cells, at, d2t, draft_gate, run_if)

    def _chain(self, full, members: list, index: list[int], j: int, logits, chained) -> None:
        """One head step for members (at positions index of the batch) with their drafts j."""
        runner = self.runner
        batch = runner.batch([m.cache for m in members], [1] * len(members))
        verify_ids = batch.cache.tensors["verify_ids"]  # [S, R]: each member's draft j at slot * R + 1 + j
        ids = verify_ids.view(-1).index_select(0, batch.slot_index * verify_ids.shape[1] + 1 + j)
        first = batch.field(SEQ_LEN) + j
        if full is not None:  # every sequence chains: in place
            runner.step.head(batch, ids, chained, first, None, (logits, chained), self.lm_head)
            return
        at = runner.index(index)
        out_logits, out_hidden = self.logits[-len(members) :], runner.head_hidden[-len(members) :]
        runner.step.head(batch, ids, chained.index_select(0, at), first, None, (out_logits, out_hidden), self.lm_head)
        logits.index_copy_(0, at, out_logits)
        chained.index_copy_(0, at, out_hidden)


class _Gate(NamedTuple):
    """A round's confidence gate on the device: which members still draft, and the drafts that count."""

    live: torch.Tensor  # [B] bool: no draft of the member was cut yet
    counted: torch.Tensor  # [B] long: drafts before the first cut

    def cut(self, at: torch.Tensor | None, passed: torch.Tensor) -> None:
        """The members at positions at [n] (None: all) drafted one more; passed [n] bool: its
        confidence reached p_min."""
        if at is None:
            self.counted.add_(self.live.logical_and_(passed))
            return
        live = self.live.index_select(0, at) & passed
        self.live.index_copy_(0, at, live)
        self.counted.index_add_(0, at, live.long())

    def still_drafting(self, at: torch.Tensor | None) -> torch.Tensor:
        """[] bool: a member at positions at (None: any) has not been cut."""
        if at is None:
            return self.live[0] if self.live.numel() == 1 else self.live.any()
        return self.live.index_select(0, at).any()


class ProfileProposer:
    """Drafts of a chosen acceptance, for measuring speed-ups where the head guesses nothing (random
    weights): the real head drafts (and is paid for), then draft j is replaced, with probability
    profile[j], by the token plain decoding emits at its position (so the verify accepts it) and
    otherwise by another token. Draws are seeded Philox, a pure function of the position."""

    def __init__(self, base: MTPProposer, profile: list[float], reference_ids: list[int], seed: int = 0):
        device = base.runner.device
        self.base = base
        self.profile = torch.tensor(profile, dtype=torch.float64, device=device)
        self.reference = torch.tensor(reference_ids, dtype=torch.long, device=device)
        self.rng = RequestRng(seed)

    def propose(self, members: list) -> torch.Tensor | None:
        if any(not m.sampler.kind.greedy for m in members):  # a replaced draft is not drawn from its q
            raise ValueError("an acceptance profile drives greedy decoding only")
        num_drafts = self.base.propose(members)
        runner, k_max = self.base.runner, max(m.k for m in members)
        verify_ids = members[0].cache.cache.tensors["verify_ids"]  # [S, R]
        slots = runner.batch([m.cache for m in members], [verify_ids.shape[1]] * len(members)).slot_index
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
