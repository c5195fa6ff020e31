"""Token choice in one launch each: a draw from softmax(logits / T), the rejection sampling of a
speculative round, and a greedy round's accept and commit. A round on a small model is
launch-bound: the reference draw (nextn.sample.pipeline: divide, softmax, float64 cumsum, searchsorted,
the zero-mass guard) is ~11 launches per draft, `verify_sampled` ~40 per round, and the greedy
accept (nextn.engine.rounds) ~30; each of these kernels is one.

One program holds a whole row in registers (up to MAX_V columns: the bundled model's 8,192, not the
released models' 248k, which nextn.sample.triton_wide splits into chunks; both build on the
helpers of nextn.sample.triton_common); the caller (nextn.sample.sampler) chooses by the
vocabulary's size.

`temperature_sample`: per row, the law softmax(logits / T), then top-k, top-p and min-p (their
values device scalars: the request's, read at replay), written out (a draft's q, or a verify's p),
and optionally the inverse-CDF draw with the row's uniform. Reference: `probs_from_logits`
(penalties and masks are applied to the logits before), then `sample`.

`verify_sampled`: the round's accept tests u * q(x) < p(x) in float64 (bitwise the reference's),
the residual max(0, p_n - q_n) (p_n itself when it has no mass, or at the bonus row), and the draw
of the recovered / bonus token from it, reading the request's uniforms at its generated index.
Reference: nextn.sample.verifier.verify_sampled.

Arithmetic against the references: x / T is correctly rounded (as torch's division by a tensor);
the softmax's exp and sums, and the draw's float64 cumsum, run in another order than torch's, so a
probability differs by rounding and a draw can differ only when its uniform falls within rounding
of a boundary of the CDF. As in the reference a token of zero mass is never drawn: the draw takes
the first index whose running sum exceeds u * total, capped at the last index where the sum still
rises. A request's plain and speculative rounds run the same kernels, so spec stays exact in
distribution against plain decoding.

`keep_verify_rows` and `follow_slots`: a round's data movement in one launch each (the verify's rows
into the slots' buffers, a followed step batch's slot tensors); their references are the torch ops of
nextn.engine.device_round and nextn.cache.hybrid.StepBatch.refresh.

`accept_greedy`: for each member of a batched greedy round, the longest prefix of its counted
drafts that matches the argmax of the rows before them, the next pending token, the head pass's
ids, the commit of the slot's counters (nextn.cache.hybrid.commit_ctl's affine table) and the
round's outcome row. Integer work only: bitwise the reference (`_accept_greedy` in rounds.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nextn.ops.triton_utils import HAVE_TRITON, next_pow2
from nextn.sample.pipeline import Law, Stream
from nextn.sample.triton_common import round_args, sample_outputs

MAX_V = 32768  # the widest row one program holds (the sampler keeps the torch ops above it)
FOLLOW_BLOCK = 1024  # rows a program of `follow_slots`

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from nextn.sample.triton_common import emit, filters, inverse_cdf, num_accepted, residual

    @triton.jit
    def _draw(r, valid, u):
        """The inverse-CDF draw with uniform u from the row r (float32 >= 0, in registers) over its
        float64 running sum."""
        cdf = tl.cumsum(r.to(tl.float64), axis=0)
        total = tl.max(tl.where(valid, cdf, 0.0), axis=0)
        return inverse_cdf(cdf, valid & (r > 0.0), u * total)

    # the per-request values and rows sit at each slot's offset: their alignment is the slot's, so
    # specialising on it compiled a variant per slot pattern mid-serving (bench/sync_probe.py, run 204)
    @triton.jit(do_not_specialize=["temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "u_ptr", "ids_ptr"])
    def _temperature_kernel(
        logits_ptr,  # [N, V] float32 or bf16
        stride_l,
        temp_ptr,  # [] float32: T
        top_k_ptr,  # [] long (TOP_K)
        top_p_ptr,  # [] float32 (TOP_P)
        min_p_ptr,  # [] float32 (MIN_P)
        probs_ptr,  # [N, V] float32 out
        stride_p,
        u_ptr,  # [N] float64
        ids_ptr,  # [N] long out
        V,
        TOP_K: tl.constexpr,
        TOP_P: tl.constexpr,
        MIN_P: tl.constexpr,
        DRAW: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_V)
        valid = offs < V
        logit = tl.load(logits_ptr + i * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
        x = tl.math.div_rn(logit, tl.load(temp_ptr).to(tl.float32))
        e = tl.exp(x - tl.max(x, axis=0))
        p = e / tl.sum(e, axis=0)
        if TOP_K or TOP_P or MIN_P:
            keep = filters(p, valid, top_k_ptr, top_p_ptr, min_p_ptr, V, tl.sum(p, axis=0), TOP_K, TOP_P, MIN_P)
            p = tl.where(keep, p, 0.0)
            p = p / tl.sum(p, axis=0)
        tl.store(probs_ptr + i * stride_p + offs, p, mask=valid)
        if DRAW:
            tl.store(ids_ptr + i, _draw(p, valid, tl.load(u_ptr + i)))

    @triton.jit(do_not_specialize=["drafts_ptr", "stride_u", "index_ptr", "num_ptr", "num_drafts", "n_ptr", "out_ptr"])
    def _verify_kernel(
        p_ptr,  # [K + 1, V] float32: the target's law per verify row
        stride_p,
        q_ptr,  # [K, V] float32: each draft's law (HAS_Q)
        stride_q,
        drafts_ptr,  # [K] long
        uniforms_ptr,  # [streams, U] float64: the request's table
        stride_u,
        index_ptr,  # []: the generated index of row 0
        num_ptr,  # []: the drafts that count (HAS_NUM), else num_drafts
        num_drafts,
        n_ptr,  # [] long out
        out_ptr,  # [K + 1] long out
        V,
        K: tl.constexpr,
        ACCEPT: tl.constexpr,
        SAMPLE: tl.constexpr,
        HAS_Q: tl.constexpr,
        HAS_NUM: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        g, counted, n = num_accepted(
            p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, uniforms_ptr, stride_u, index_ptr, num_ptr, num_drafts,
            K, ACCEPT, HAS_Q, HAS_NUM,
        )  # fmt: skip
        offs = tl.arange(0, BLOCK_V)
        valid = offs < V
        p, r = residual(p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, n, counted, offs, valid, K, HAS_Q)
        r = tl.where(tl.max(r, axis=0) > 0.0, r, p)
        token = _draw(r, valid, tl.load(uniforms_ptr + SAMPLE * stride_u + g + n))
        emit(n_ptr, out_ptr, drafts_ptr, n, token, K)

    @triton.jit
    def _accept_greedy_kernel(
        target_ptr,  # [rows] long: each packed verify row's argmax
        start_ptr,  # [G] long: member g's first packed row
        slot_ptr,  # [G] long
        k_ptr,  # [G] long: its drafts this round
        count_ptr,  # [G]: the drafts that count (a gate may cut)
        index_ptr,  # [G] long: its row of befores
        befores_ptr,  # [B, NUM_CTL] int32: the counters as the round started
        ids_ptr,  # [S, R] long: verify ids [pending, drafts]
        head_ptr,  # [S, R] long: head ids
        ctl_ptr,  # [S, NUM_CTL] int32
        out_ptr,  # [S, 2 + R + NUM_CTL] long: the outcome
        a_idx_ptr,  # the commit table [NUM_CTL] each (nextn.cache.hybrid.commit_table)
        a_ptr,
        b_idx_ptr,
        b_ptr,
        kk_ptr,
        c_ptr,
        pads_ptr,  # HAS_PADS: [B] bool, by row of befores: a pad member's counters stay as they were
        R: tl.constexpr,
        NUM_CTL: tl.constexpr,
        NUM_CTL_BLOCK: tl.constexpr,  # next_pow2(NUM_CTL)
        BLOCK_R: tl.constexpr,
        HEADS: tl.constexpr,
        HAS_PADS: tl.constexpr,
    ):
        g = tl.program_id(0)
        slot = tl.load(slot_ptr + g)
        k = tl.load(k_ptr + g)
        count = tl.load(count_ptr + g).to(tl.int64)
        offs = tl.arange(0, BLOCK_R)
        target = tl.load(target_ptr + tl.load(start_ptr + g) + offs, mask=offs <= k, other=-1)
        ids = ids_ptr + slot * R
        nxt = tl.load(ids + offs + 1, mask=offs + 1 < R, other=-2)
        match = (nxt == target) & (offs < count)
        n = tl.min(tl.where(match, BLOCK_R, offs), axis=0)  # drafts before the first mismatch
        out_ids = tl.where(offs <= n, target, -1)  # accepted drafts, then the bonus
        tl.store(ids, tl.sum(tl.where(offs == n, target, 0), axis=0))  # the next round's pending token
        if HEADS:  # the next head pass writes the rows of what this round kept
            tl.store(head_ptr + slot * R + offs, tl.maximum(out_ids, 0), mask=offs <= k)
        f = tl.arange(0, NUM_CTL_BLOCK)
        fm = f < NUM_CTL
        b = tl.load(index_ptr + g)
        before = befores_ptr + b * NUM_CTL
        old = tl.load(before + f, mask=fm).to(tl.int64)
        new = (
            tl.load(before + tl.load(a_idx_ptr + f, mask=fm, other=0), mask=fm).to(tl.int64)
            * tl.load(a_ptr + f, mask=fm)
            + tl.load(before + tl.load(b_idx_ptr + f, mask=fm, other=0), mask=fm).to(tl.int64)
            * tl.load(b_ptr + f, mask=fm)
            + (n + 1) * tl.load(kk_ptr + f, mask=fm)
            + tl.load(c_ptr + f, mask=fm)
        )
        if HAS_PADS:
            new = tl.where(tl.load(pads_ptr + b) != 0, old, new)
        tl.store(ctl_ptr + slot * NUM_CTL + f, new.to(tl.int32), mask=fm)
        out = out_ptr + slot * (2 + R + NUM_CTL)
        tl.store(out, n)
        tl.store(out + 1, count)
        tl.store(out + 2 + offs, out_ids, mask=offs < R)
        tl.store(out + 2 + R + f, old, mask=fm)

    @triton.jit
    def _keep_rows_kernel(
        logits_ptr,  # [S, R, V] float32: the slots' last verify logits
        prev_logits_ptr,  # [S, R, V]
        new_logits_ptr,  # [rows, V]: this verify's packed rows
        hidden_ptr,  # [S, R, H] the model dtype
        prev_hidden_ptr,
        new_hidden_ptr,  # [rows, H]
        slots_ptr,  # [B] the members' slots
        starts_ptr,  # [B] long: each member's first packed row
        ks_ptr,  # [B] long: its drafts (rows 0..k are its verify's)
        V,
        H,
        R: tl.constexpr,
        V_BLOCKS: tl.constexpr,  # programs over a row's V columns (the rest over its H)
        BLOCK: tl.constexpr,
    ):
        """Program (b * R + i, c): slot row i of member b, one BLOCK of its logits (c < V_BLOCKS) or of its
        hidden: prev <- the slot's row, then the row <- the member's packed row i if i <= k."""
        b = tl.program_id(0) // R
        i = tl.program_id(0) % R
        c = tl.program_id(1)
        slot_row = tl.load(slots_ptr + b).to(tl.int64) * R + i
        new_row = tl.load(starts_ptr + b) + i
        take = i <= tl.load(ks_ptr + b)
        if c < V_BLOCKS:
            offs = c * BLOCK + tl.arange(0, BLOCK)
            _keep_row(logits_ptr + slot_row * V, prev_logits_ptr + slot_row * V, new_logits_ptr + new_row * V, offs,
                      offs < V, take)  # fmt: skip
        else:
            offs = (c - V_BLOCKS) * BLOCK + tl.arange(0, BLOCK)
            _keep_row(hidden_ptr + slot_row * H, prev_hidden_ptr + slot_row * H, new_hidden_ptr + new_row * H, offs,
                      offs < H, take)  # fmt: skip

    @triton.jit
    def _keep_row(cur_ptr, prev_ptr, new_ptr, offs, mask, take):
        tl.store(prev_ptr + offs, tl.load(cur_ptr + offs, mask=mask), mask=mask)
        if take:
            tl.store(cur_ptr + offs, tl.load(new_ptr + offs, mask=mask), mask=mask)

    @triton.jit(do_not_specialize=["B", "M", "R"])  # (sizes: one variant for every batch)
    def _follow_slots_kernel(
        src_ptr,  # int32 [B]: the followed slots
        seqs_ptr,  # int32 [B]: the batch's slot row (StepBatch.seqs[0])
        slot_ptr,  # long [B]: StepBatch.slot_index
        row_seq_ptr,  # long [M]: each row's sequence
        row_idx_ptr,  # int32 [M]: its index within the sequence
        row_slot_ptr,  # int32 [M] out
        flat_ptr,  # long [M] out: slot * R + row index
        B,
        M,
        R,
        BASE: tl.constexpr,  # also the per-sequence and per-row slots (else the flat rows alone)
        FLAT: tl.constexpr,  # the flat rows (a batch without a table: the base alone)
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        if BASE:
            seq_mask = offs < B
            slot = tl.load(src_ptr + offs, mask=seq_mask)
            tl.store(seqs_ptr + offs, slot, mask=seq_mask)
            tl.store(slot_ptr + offs, slot.to(tl.int64), mask=seq_mask)
        rows = offs < M
        slot = tl.load(src_ptr + tl.load(row_seq_ptr + offs, mask=rows, other=0), mask=rows)
        if BASE:
            tl.store(row_slot_ptr + offs, slot, mask=rows)
        if FLAT:
            flat = slot.to(tl.int64) * R + tl.load(row_idx_ptr + offs, mask=rows)
            tl.store(flat_ptr + offs, flat, mask=rows)


def _launch(V: int) -> dict:
    if V > MAX_V:
        raise ValueError(f"triton_sample: rows of {V} columns; one program holds at most {MAX_V}")
    block = next_pow2(V)
    return dict(BLOCK_V=block, num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)


def temperature_sample(
    logits: torch.Tensor,  # [N, V] float32 or bf16, rows contiguous
    law: Law,  # the temperature and filters (device scalars)
    u: torch.Tensor | None = None,  # [N] float64: each row's uniform (None: the law only)
    out: torch.Tensor | None = None,  # [N, V] float32: the law (default: a new tensor)
    ids: torch.Tensor | None = None,  # [N] long: the draws (default: a new tensor when u is given)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the filtered law softmax(logits / T), then top-k, top-p, min-p, renormalised [N, V]
    float32, the inverse-CDF draws [N] long or None)."""
    N, V = logits.shape
    out, ids = sample_outputs(logits, u, out, ids)
    temperature, top_k, top_p, min_p = law
    _temperature_kernel[(N,)](
        logits,
        logits.stride(0),
        temperature,
        top_k if top_k is not None else temperature,
        top_p if top_p is not None else temperature,
        min_p if min_p is not None else temperature,
        out,
        out.stride(0),
        u if u is not None else out,
        ids if ids is not None else out,
        V,
        TOP_K=top_k is not None,
        TOP_P=top_p is not None,
        MIN_P=min_p is not None,
        DRAW=u is not None,
        **_launch(V),
    )
    return out, ids


def verify_sampled(
    target_probs: torch.Tensor,  # [K + 1, V] float32
    draft_probs: torch.Tensor | None,  # [K, V] float32 (None: greedy drafts, q one-hot)
    draft_ids: torch.Tensor,  # [K] long
    uniforms: torch.Tensor,  # [streams, U] float64: the request's table (nextn.sample.pipeline.RequestRng.table)
    index: torch.Tensor,  # []: the generated index of row 0
    num_drafts: torch.Tensor | int,  # the drafts that count
):
    """(n [] long, out_ids [K + 1] long): nextn.sample.verifier.verify_sampled's result, with the
    uniforms read from the table at index (ACCEPT at index + j, SAMPLE at index + n)."""
    V = target_probs.shape[1]
    args, flags, n, out_ids = round_args(target_probs, draft_probs, draft_ids, uniforms, index, num_drafts)
    _verify_kernel[(1,)](*args, n, out_ids, V, SAMPLE=int(Stream.SAMPLE), **flags, **_launch(V))
    return n, out_ids


class GreedyGroup(NamedTuple):
    """The G members of a batched greedy round, one entry each (device tensors, in the order
    _accept_greedy_kernel takes them)."""

    starts: torch.Tensor  # [G] long: each member's first packed verify row
    slots: torch.Tensor  # [G] long
    ks: torch.Tensor  # [G] long: drafts this round
    counts: torch.Tensor  # [G]: the drafts that count
    index: torch.Tensor  # [G] long: each member's row of befores


def accept_greedy(
    target: torch.Tensor,  # [rows] long: the argmax of each packed verify row
    group: GreedyGroup,
    befores: torch.Tensor,  # [B, NUM_CTL] int32
    tensors: dict,  # the slots' round buffers: verify_ids, head_ids, ctl, out
    table: tuple[torch.Tensor, ...],  # nextn.cache.hybrid.commit_table's (a_idx, a, b_idx, b, k, c)
    heads: bool,  # write head_ids (a round with drafts)
    pads: torch.Tensor | None = None,  # [B] bool by row of befores: pad members, whose counters stay
) -> None:
    """The greedy accept and commit of G members in one launch (nextn.engine.device_round._accept_greedy;
    with pads, also its restore of the pad members' counters)."""
    ids, ctl = tensors["verify_ids"], tensors["ctl"]
    R, num_ctl = ids.shape[1], ctl.shape[1]
    if not all(t.is_contiguous() for t in (target, befores, ids, tensors["head_ids"], ctl, tensors["out"], *table)):
        raise ValueError("accept_greedy: the buffers must be contiguous")
    _accept_greedy_kernel[(group.slots.numel(),)](
        target,
        *group,
        befores,
        ids,
        tensors["head_ids"],
        ctl,
        tensors["out"],
        *table,
        pads if pads is not None else befores,
        R=R,
        NUM_CTL=num_ctl,
        NUM_CTL_BLOCK=next_pow2(num_ctl),
        BLOCK_R=max(2, next_pow2(R)),
        HEADS=heads,
        HAS_PADS=pads is not None,
        num_warps=1,
    )


def keep_verify_rows(
    tensors: dict,  # the slots' round buffers: logits, prev_logits [S, R, V]; hidden, prev_hidden [S, R, H]
    logits: torch.Tensor,  # [rows, V] float32: the verify's packed rows
    hidden: torch.Tensor,  # [rows, H]
    slots: torch.Tensor,  # [B]: the members' slots
    starts: torch.Tensor,  # [B] long: each member's first packed row
    ks: torch.Tensor,  # [B] long: its drafts
    block: int = 4096,
) -> None:
    """A round's verify rows into its members' slots in one launch: each slot's logits and hidden move
    to prev_logits / prev_hidden (what a request ending in the round before reads), then its rows
    0..k take the verify's. Reference: the index_copy_ pairs of nextn.engine.device_round."""
    cur_l, prev_l, cur_h, prev_h = (tensors[n] for n in ("logits", "prev_logits", "hidden", "prev_hidden"))
    S, R, V = cur_l.shape
    H = cur_h.shape[2]
    if not all(t.is_contiguous() for t in (cur_l, prev_l, cur_h, prev_h, logits, hidden)):
        raise ValueError("keep_verify_rows: the buffers must be contiguous")
    if logits.shape[1] != V or hidden.shape[1] != H or logits.dtype != cur_l.dtype or hidden.dtype != cur_h.dtype:
        raise ValueError(
            f"keep_verify_rows: rows {tuple(logits.shape)} / {tuple(hidden.shape)} for slots of V={V}, H={H}"
        )
    block = min(block, next_pow2(max(V, H)))
    v_blocks = triton.cdiv(V, block)
    grid = (slots.numel() * R, v_blocks + triton.cdiv(H, block))
    _keep_rows_kernel[grid](
        cur_l, prev_l, logits, cur_h, prev_h, hidden, slots, starts, ks, V, H, R=R, V_BLOCKS=v_blocks, BLOCK=block,
        num_warps=4,
    )  # fmt: skip


def follow_slots(
    src: torch.Tensor,  # int32 [B]: the followed slots
    seqs: torch.Tensor,  # int32 [B] out
    slot_index: torch.Tensor,  # long [B] out
    row_seq: torch.Tensor,  # long [M]
    row_idx: torch.Tensor,  # int32 [M]
    row_slot: torch.Tensor,  # int32 [M] out
    flats: dict,  # R -> long [M] out: slot * R + row index
) -> None:
    """A followed step batch's slot tensors re-derived from its device slots in one launch a flat-row
    table, the first also writing the per-sequence and per-row slots (nextn.cache.hybrid.StepBatch.refresh,
    whose torch ops are the reference: two copies, a gather and three ops a table)."""
    B, M = src.numel(), row_seq.numel()
    tables = list(flats.items()) or [(0, slot_index)]  # (no table: the base alone, flat_ptr unused)
    for i, (R, flat) in enumerate(tables):
        _follow_slots_kernel[(triton.cdiv(max(B, M), FOLLOW_BLOCK),)](
            src, seqs, slot_index, row_seq, row_idx, row_slot, flat, B, M, R, BASE=i == 0, FLAT=bool(flats),
            BLOCK=FOLLOW_BLOCK, num_warps=4,
        )  # fmt: skip
