"""A round on the device: draft -> verify -> accept -> commit for a batch of requests at once
(the host side, which queues and reads rounds, is nextn.engine.rounds).

A round (`device_round`) is device work only, one CUDA graph per batch of (K, sampler kind), the
slots device values it reads (a member that is not plain greedy works on copies gathered at its
slot: `Lane`; sampled batches are not padded, pads are plain greedy rounds' alone):
the proposer drafts each request's K tokens after its pending token (K may differ, 0 for plain
decoding; a confidence gate may count fewer, down to none: the round then verifies the pending
token alone); one trunk step verifies every request's [pending, drafts] rows; per request, the
sampler accepts the longest matching prefix (greedy) or rejection-samples, and picks the bonus /
recovered token, which becomes the next round's pending token (it enters the trunk only as column
0 of the next verify: no round spends a forward on it alone); `commit_ctl` keeps the accepted
columns by moving the slot's pointers. Each request's outcome goes to a small buffer, [accepted,
drafts counted, tokens..., counters before the round], copied to pinned host memory. A request's
rows are computed with the same arithmetic alone or batched, so its output does not depend on
what runs beside it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nextn.cache import SlotCache, StepBatch, commit_ctl
from nextn.cache.hybrid import NUM_CTL, NUM_GEN, commit_table
from nextn.config.model import ModelConfig
from nextn.engine.sequence import Sequence
from nextn.sample.sampler import SlotSampler

OUT_ACCEPTED, OUT_DRAFTED, OUT_TOKENS = 0, 1, 2  # fields of a round's outcome buffer


def round_buffers(cfg: ModelConfig, k_max: int, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Per-slot buffers of a round with up to k_max drafts (R = k_max + 1 verify rows)."""
    R, V, H, f32 = k_max + 1, cfg.vocab_size, cfg.hidden_size, torch.float32
    return [
        ("verify_ids", (R,), torch.long),
        ("head_ids", (R,), torch.long),
        ("logits", (R, V), f32),
        ("hidden", (R, H), dtype),
        ("prev_logits", (R, V), f32),
        ("prev_hidden", (R, H), dtype),
        ("draft_q", (max(k_max, 1), V), f32),
        ("grammar_mask", (R, V), torch.bool),  # a constrained request's allowed tokens per row
        ("out", (OUT_TOKENS + R + NUM_CTL,), torch.long),
    ]


class Buffers(NamedTuple):
    verify_ids: torch.Tensor  # [R] [pending token, drafts...]
    head_ids: torch.Tensor  # [R] the tokens the last round kept: its accepted drafts, the pending token
    logits: torch.Tensor  # [R, V] the last verify's logits (row j predicts emitted token j)
    hidden: torch.Tensor  # [R, H] its head-input hiddens
    prev_logits: torch.Tensor  # the verify before it (copied as a round starts)
    prev_hidden: torch.Tensor
    draft_q: torch.Tensor
    out: torch.Tensor  # [2 + R + NUM_CTL] the round's outcome

    @classmethod
    def of(cls, cache: SlotCache) -> Buffers:
        return cls(*(cache.t(name) for name in cls._fields))


class Member(NamedTuple):
    """One request's part of a batched round."""

    cache: SlotCache
    sampler: SlotSampler
    buf: Buffers
    k: int  # drafts this round (0: plain decoding)
    lane: Lane | None = None  # set: sampler and buf are copies gathered for the round (`Lane`)


class Lane(NamedTuple):
    """Where a member's gathered copies go back: its slot as a device index, so a round whose
    members' own work (sampled drafts, `_accept`) runs on copies gathered from the pool-wide
    tensors at that index, rather than on the slot's views, is one graph per batch of (K, sampler
    kind) whatever slots run (`runner.follow_slots` writes the index before each replay). Gathered
    per member per round (R = K_max + 1 rows): ctl (36 bytes), verify_ids (8R, twice: as the round
    starts and again after the drafts, which a ProfileProposer may rewrite in the pool) and head_ids (8R),
    the sampler's values (`SlotSampler.lane`: 36 bytes, + 24 (K + 1) sampled, + 5V with penalties,
    + V with min_tokens); the verify logits are the trunk step's own rows (no copy) and draft_q a
    scratch the drafts fill ([K, V] f32, zeroed). Written back: verify_ids after each draft (the
    next head step and the verify read the pool) and at the end, head_ids, out, ctl, and the
    output counts with penalties."""

    slot: torch.Tensor  # [1] long: the member's slot
    tensors: dict  # the pool-wide tensors [num_slots, ...]

    def store(self, name: str, value: torch.Tensor) -> None:
        """The slot's row of tensor `name` <- value (its shape without the slot dimension)."""
        self.tensors[name].index_copy_(0, self.slot, value[None])


def _lane(m: Member, slot: torch.Tensor, before: torch.Tensor, logits: torch.Tensor) -> Member:
    """m for one round on copies gathered at device slot index slot [1] (`Lane`); before: its ctl
    [NUM_CTL]; logits: its verify rows (the trunk step's, [K + 1, V]; filled by the verify)."""
    tensors, buf = m.cache.cache.tensors, m.buf
    ids, heads = (tensors[name].index_select(0, slot)[0] for name in ("verify_ids", "head_ids"))
    draft_q = buf.draft_q.new_zeros(buf.draft_q.shape[0] if not m.sampler.kind.greedy else 0, buf.draft_q.shape[1])
    lane_buf = Buffers(ids, heads, logits, None, None, None, draft_q, buf.out.new_empty(buf.out.shape))
    return Member(m.cache, m.sampler.lane(tensors, slot, before, m.k + 1), lane_buf, m.k, Lane(slot, tensors))


def device_round(runner, proposer, members: list[Member], clock=None, riding=None) -> None:
    """One round of every member, device work only (clock: marks its draft, verify and commit).
    riding (nextn.engine.riding.Riding): prompt pieces whose rows join the verify's trunk step
    after the members' (a mixed step: StepBatch.pieces_from; their slots followed after the
    members'), their slots committed here, their logits and hiddens left in riding.out for
    runner.landed (the host's part, after the round); every row is the arithmetic of its own step."""
    tensors = members[0].cache.cache.tensors
    _mark(clock, 0)
    # the trunk step's batch: every member's [pending, drafts] rows (its slots as device values)
    caches, rows = [m.cache for m in members], [m.k + 1 for m in members]
    if riding is None:
        batch = runner.batch(caches, rows)
        logits, hidden = runner.step_logits[: batch.num_rows], runner.step_hidden[: batch.num_rows]
    else:  # the pieces' rows after the members'
        caches, rows = caches + riding.all_caches, rows + riding.all_rows
        batch = runner.batch(caches, rows, len(members), riding.chunked, riding.chunks)
        logits, hidden = riding.out  # (`Riding.staged`: made before the round)
    slots = batch.slot_index
    befores = tensors["ctl"].index_select(0, slots)
    if not all(_plain_greedy(m) for m in members):  # their own work on copies at their device slots
        rows = [logits[batch.offsets[b] : batch.offsets[b] + m.k + 1] for b, m in enumerate(members)]
        members = [_lane(m, slots[b : b + 1], befores[b], rows[b]) for b, m in enumerate(members)]
    drafting = [b for b, m in enumerate(members) if m.k > 0]
    counted = proposer.propose([members[b] for b in drafting]) if drafting else None
    num_drafts = runner.index([m.k for m in members])  # [B] the drafts that count
    if counted is not None:  # a confidence gate cut some
        num_drafts = num_drafts.index_copy(0, runner.index(drafting), counted)
    fused = runner.config.kernels == "triton"  # the slots' verify rows kept in one launch (`_keep_rows`)
    if not fused:
        own = slots[: len(members)]
        for name in ("logits", "hidden"):  # what a request ending in the last round reads
            tensors[f"prev_{name}"].index_copy_(0, own, tensors[name].index_select(0, own))
    _mark(clock, 1)
    # one trunk step over every member's rows (and the riding pieces'), out of and into the slots' buffers
    verify_rows = batch.offsets[len(members)]
    flat = batch.flat_rows(members[0].buf.verify_ids.shape[0])[:verify_rows]
    live = None if counted is None else (num_drafts + 1).to(torch.int32)  # a gate cut: the rows that count
    ids = tensors["verify_ids"].view(-1).index_select(0, flat)
    if riding is None:
        runner.step.trunk(batch, ids, logits, hidden, live=live)
    else:
        wanted, piece_rows = riding.index  # (`Riding.staged`: written before the round)
        runner.step.trunk(batch, torch.cat([ids, riding.ids]), logits, hidden, live=live, logit_rows=wanted)
    if fused:
        _keep_rows(runner, batch, members, tensors, logits, hidden)
    else:
        tensors["logits"].flatten(0, 1).index_copy_(0, flat, logits[:verify_rows])
        tensors["hidden"].flatten(0, 1).index_copy_(0, flat, hidden[:verify_rows])
    _mark(clock, 2)
    # greedy members without penalties: verified and committed together
    plain = [b for b, m in enumerate(members) if _plain_greedy(m)]
    if plain:
        # pad members (rounds._pads: only in batches of plain greedy members) commit nothing: the
        # accept puts their counters back
        pads = runner.pads if len(plain) == len(members) else None
        verified = _Verified(batch, befores, logits, num_drafts, proposer is not None)
        _accept_greedy(runner, verified, members, plain, pads)
    for b, m in enumerate(members):
        if b not in plain:
            _accept(m, befores[b], num_drafts[b], proposer is not None)
    if riding is not None:  # last: a round that raises before here leaves the pieces uncommitted
        pieces = batch.slot_index[len(members) : len(members) + len(riding.caches)]  # (not the pad's)
        runner.commit_pieces(pieces, piece_rows, riding)  # (their prefill apart redoes them)
    _mark(clock, 3)


def _keep_rows(runner, batch: StepBatch, members: list[Member], tensors: dict, logits, hidden) -> None:
    """The slots' logits / hidden to prev_logits / prev_hidden (what a request ending in the round
    before reads), then the verify's rows into them, in one launch: the reference's index_copy_
    pairs above (the first before the drafts, which read only the slots' hidden, not prev_hidden)."""
    from nextn.sample import triton_sample

    starts = runner.index(list(batch.offsets[: len(members)]))
    ks = runner.index([m.k for m in members])
    slots = batch.slot_index[: len(members)]  # (a mixed step's pieces after them keep nothing here)
    triton_sample.keep_verify_rows(tensors, logits, hidden, slots, starts, ks)


def _mark(clock, i: int) -> None:
    if clock is not None:
        clock.mark(i)


def _plain_greedy(m: Member) -> bool:
    return m.sampler.plain_greedy


class _Verified(NamedTuple):
    """A batched round's verify, as its greedy members' accept reads it."""

    batch: StepBatch  # the trunk step's rows
    befores: torch.Tensor  # [B, NUM_CTL] the members' counters before the round
    logits: torch.Tensor  # [rows, V] the verify's logits
    num_drafts: torch.Tensor  # [B] the drafts that count
    heads: bool  # the round drafted: the next head pass writes the rows it kept


def _accept_greedy(runner, verified: _Verified, members: list[Member], index: list[int], pads=None) -> None:
    """`_accept` for the greedy members without penalties (members[b] for b in index), all at once
    (the same integer results): each row's argmax, the longest prefix of the drafts that count
    (counts [G]) matching it, the commit and the outcomes; pads ([B] bool, every member in the group):
    the pad members' counters put back as the round found them. With the Triton kernels one launch
    after the argmax (nextn.sample.triton_sample.accept_greedy); this is its reference."""
    batch, befores, logits, num_drafts, heads = verified
    counts = num_drafts if len(index) == len(members) else num_drafts.index_select(0, runner.index(index))
    group = [members[b] for b in index]
    R, tensors, G, cache = group[0].buf.verify_ids.shape[0], group[0].cache.cache.tensors, len(group), group[0].cache
    slots = batch.slot_index if G == len(batch) else batch.slot_index.index_select(0, runner.index(index))
    ks = runner.index([m.k for m in group])
    if runner.config.kernels == "triton":  # imported here: kernel modules load only where their kernels run
        from nextn.sample import triton_sample

        starts = runner.index([batch.offsets[b] for b in index])
        table = commit_table(cache.cols, True, True, logits.device)
        members = triton_sample.GreedyGroup(starts, slots, ks, counts, runner.index(index))
        from nextn.ops.triton_draft import argmax_rows

        triton_sample.accept_greedy(argmax_rows(logits), members, befores, tensors, table, heads, pads)
        return
    rows = runner.index([batch.offsets[b] + i for b, m in zip(index, group, strict=True) for i in range(m.k + 1)])
    cells = runner.index([g * R + i for g, m in enumerate(group) for i in range(m.k + 1)])
    target = torch.full((G * R,), -1, dtype=torch.long, device=logits.device)
    target = target.index_copy_(0, cells, logits.argmax(-1).index_select(0, rows)).view(G, R)
    cols = torch.arange(R, device=logits.device)
    ids = tensors["verify_ids"].index_select(0, slots)  # [G, R]: pending, drafts
    match = (ids[:, 1:] == target[:, :-1]) & (cols[None, :-1] < counts[:, None])
    n = match.long().cumprod(1).sum(1)  # [G] drafts before the first mismatch
    out_ids = torch.where(cols[None] <= n[:, None], target, -1)  # accepted drafts, then the bonus
    ids[:, 0] = out_ids.gather(1, n[:, None])[:, 0]  # the next round's pending token
    tensors["verify_ids"].index_copy_(0, slots, ids)
    if heads:  # the next head pass writes the rows of what this round kept
        kept = cols[None] <= ks[:, None]
        head_ids = torch.where(kept, out_ids.clamp(min=0), tensors["head_ids"].index_select(0, slots))
        tensors["head_ids"].index_copy_(0, slots, head_ids)
    before = befores.index_select(0, runner.index(index))
    ctl = commit_ctl(before, (n + 1)[:, None], cache.cols, round_=True)
    if pads is not None:
        ctl = torch.where(pads[:, None], before, ctl)
    tensors["ctl"].index_copy_(0, slots, ctl.to(torch.int32))
    tensors["out"].index_copy_(0, slots, torch.cat([n[:, None], counts[:, None], out_ids, before.long()], dim=1))


def _accept(m: Member, before: torch.Tensor, num_drafts: torch.Tensor, heads: bool) -> None:
    """Verify a member's drafts (the first num_drafts [] count), commit what it keeps and write its outcome."""
    cache, sampler, buf, k, lane = m
    if lane is not None:  # the drafts as the slot holds them (a ProfileProposer rewrites them there)
        buf.verify_ids.copy_(cache.cache.tensors["verify_ids"].index_select(0, lane.slot)[0])
    q = None if sampler.kind.greedy else buf.draft_q[:k]
    n, out_ids = sampler.verify(buf.logits[: k + 1], buf.verify_ids[1 : k + 1], q, num_drafts, before[NUM_GEN])
    sampler.record(out_ids, n)
    ctl = commit_ctl(before, n + 1, cache.cols, round_=True).to(torch.int32)
    buf.verify_ids[:1] = out_ids.index_select(0, n.reshape(1))  # the next round's pending token
    if heads:  # the next head pass writes the rows of what this round kept
        torch.clamp(out_ids, min=0, out=buf.head_ids[: k + 1])
    _write_outcome(buf, n, num_drafts, out_ids, before)
    if lane is None:
        cache.ctl.copy_(ctl)
        return
    for name, value in (("ctl", ctl), ("verify_ids", buf.verify_ids), ("head_ids", buf.head_ids), ("out", buf.out)):
        lane.store(name, value)
    if sampler.kind.penalties:
        lane.store("output_counts", sampler.history.output_counts)


def first_token(cache: SlotCache, sampler: SlotSampler, buf: Buffers, seq: Sequence) -> None:
    """The token after the prompt, from the trunk's last logits: the outcome of a round with no
    verify (nothing committed). Sets up the first round's head pass (the pending token's row)."""
    ctl = cache.ctl
    before = ctl.clone()
    buf.logits[:1] = seq.last_logits
    buf.hidden[:1] = seq.last_hidden
    n, out_ids = sampler.verify(buf.logits[:1], buf.verify_ids[:0], None, 0, before[NUM_GEN])
    sampler.record(out_ids, n)
    buf.verify_ids[:1] = out_ids
    buf.head_ids[:1] = out_ids
    ctl[NUM_GEN] += 1
    _write_outcome(buf, n, n, out_ids, before)


def _write_outcome(buf: Buffers, n, drafted, out_ids, before) -> None:
    """buf.out = [accepted, drafts counted, tokens (-1 padded to R), counters before the round]."""
    pad = out_ids.new_full((buf.verify_ids.shape[0] - out_ids.numel(),), -1)
    buf.out.copy_(torch.cat([n.reshape(1), drafted.reshape(1), out_ids, pad, before.long()]))
