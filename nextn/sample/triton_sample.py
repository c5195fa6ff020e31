"""Token choice in one launch each: a draw from softmax(logits / T), the rejection sampling of a
speculative round, and a greedy round's accept and commit. A round on a small model is
launch-bound: the reference draw (nextn.sample.pipeline: divide, softmax, float64 cumsum, searchsorted,
the zero-mass guard) is ~11 launches per draft, `verify_sampled` ~40 per round, and the greedy
accept (nextn.engine.rounds) ~30; each of these kernels is one.

One program holds a whole row in registers (up to MAX_V columns: the bundled model's 8,192, not the
released models' 248k, which nextn.sample.triton_wide splits into chunks with these kernels'
helpers); the caller (nextn.sample.sampler) chooses by the vocabulary's size.

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

`accept_greedy`: for each member of a batched greedy round, the longest prefix of its counted
drafts that matches the argmax of the rows before them, the next pending token, the head pass's
ids, the commit of the slot's counters (nextn.cache.hybrid.commit_ctl's affine table) and the
round's outcome row. Integer work only: bitwise the reference (`_accept_greedy` in rounds.py).
"""

from __future__ import annotations

import torch

from nextn.ops.triton_utils import HAVE_TRITON, next_pow2
from nextn.sample.pipeline import Stream

MAX_V = 32768  # the widest row one program holds (the sampler keeps the torch ops above it)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _inverse_cdf(cdf, positive, t):
        """The first entry with mass (`positive`) whose running sum cdf (float64) exceeds t, else the
        last entry with mass (searchsorted, right, capped at the last entry that adds mass, without
        assuming the parallel scan's sums never fall by rounding): never an entry without mass."""
        i = tl.arange(0, cdf.shape[0])
        first = tl.min(tl.where(positive & (cdf > t), i, cdf.shape[0]), axis=0)
        last = tl.maximum(tl.max(tl.where(positive, i, -1), axis=0), 0)
        return tl.where(first < cdf.shape[0], first, last).to(tl.int64)

    @triton.jit
    def _draw(r, valid, u):
        """The inverse-CDF draw with uniform u from the row r (float32 >= 0, in registers) over its
        float64 running sum."""
        cdf = tl.cumsum(r.to(tl.float64), axis=0)
        total = tl.max(tl.where(valid, cdf, 0.0), axis=0)
        return _inverse_cdf(cdf, valid & (r > 0.0), u * total)

    @triton.jit
    def _filters(
        p,
        valid,
        top_k_ptr,
        top_p_ptr,
        min_p_ptr,
        V,
        total,
        TOP_K: tl.constexpr,
        TOP_P: tl.constexpr,
        MIN_P: tl.constexpr,
    ):
        """The keep mask of top-k, then top-p, then min-p over p (float32 >= 0: its bit patterns
        order like its values; entries in index order), with the reference's stable descending
        order (ties: the lower index first): top-k keeps the values above the k-th largest and, of
        the ones equal to it, the first by index; top-p keeps a token while the kept mass before it
        in that order is below top_p of the kept mass (`total`, the row's mass, where top-k is off).
        Each threshold is bisected over the bit patterns (p <= 1: below 2**30, 31 steps of one
        reduction each). V: the row's width (top-k keeps at most V)."""
        bits = p.to(tl.int32, bitcast=True)
        keep = valid
        if TOP_K:
            k = tl.minimum(tl.load(top_k_ptr).to(tl.int32), V)
            lo = tl.full((), 0, tl.int32)  # count(bits >= lo) >= k
            hi = tl.full((), 0x3F800001, tl.int32)  # count(bits >= hi) < k
            for _ in range(31):
                mid = lo + (hi - lo) // 2
                enough = tl.sum((valid & (bits >= mid)).to(tl.int32), axis=0) >= k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid)
            above = valid & (bits > lo)  # lo: the k-th largest value
            ties = valid & (bits == lo)
            room = k - tl.sum(above.to(tl.int32), axis=0)
            keep = above | (ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= room))
        if TOP_P:
            kept = tl.where(keep, p, 0.0)
            if TOP_K:
                total = tl.sum(kept, axis=0)
            target = tl.load(top_p_ptr).to(tl.float32) * total
            lo = tl.full((), -1, tl.int32)  # kept mass above lo >= target
            hi = tl.full((), 0x3F800000, tl.int32)  # kept mass above hi < target
            for _ in range(31):
                mid = lo + (hi - lo) // 2
                below = tl.sum(tl.where(bits > mid, kept, 0.0), axis=0) < target
                lo = tl.where(below, lo, mid)
                hi = tl.where(below, mid, hi)
            # hi: the smallest kept value whose heavier tokens hold less than the target; of the
            # tokens equal to it, those whose mass before them (in index order) stays below it
            ties = keep & (bits == hi)
            tied = tl.where(ties, p, 0.0)
            heavier = tl.sum(tl.where(bits > hi, kept, 0.0), axis=0)
            keep = (keep & (bits > hi)) | (ties & (heavier + tl.cumsum(tied, axis=0) - tied < target))
        if MIN_P:
            keep = keep & (p >= tl.load(min_p_ptr).to(tl.float32) * tl.max(p, axis=0))
        return keep

    @triton.jit
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
            keep = _filters(p, valid, top_k_ptr, top_p_ptr, min_p_ptr, V, tl.sum(p, axis=0), TOP_K, TOP_P, MIN_P)
            p = tl.where(keep, p, 0.0)
            p = p / tl.sum(p, axis=0)
        tl.store(probs_ptr + i * stride_p + offs, p, mask=valid)
        if DRAW:
            tl.store(ids_ptr + i, _draw(p, valid, tl.load(u_ptr + i)))

    @triton.jit
    def _num_accepted(
        p_ptr,
        stride_p,
        q_ptr,
        stride_q,
        drafts_ptr,
        uniforms_ptr,
        stride_u,
        index_ptr,
        num_ptr,
        num_drafts,
        K: tl.constexpr,
        ACCEPT: tl.constexpr,
        HAS_Q: tl.constexpr,
        HAS_NUM: tl.constexpr,
    ):
        """(g, counted, n): the round's generated index, the drafts that count (num_ptr's with
        HAS_NUM, else num_drafts), and the first draft rejected (or not counted), K when every one is
        accepted: draft j is accepted when u * q(x) < p(x) in float64 (q one-hot without HAS_Q), u
        its ACCEPT uniform."""
        g = tl.load(index_ptr).to(tl.int64)
        counted = num_drafts
        if HAS_NUM:
            counted = tl.load(num_ptr).to(tl.int32)
        n = tl.full((), K, tl.int32)
        for j in tl.static_range(K):
            x = tl.load(drafts_ptr + j)
            px = tl.load(p_ptr + j * stride_p + x).to(tl.float64)
            qx = tl.full((), 1.0, tl.float64)
            if HAS_Q:
                qx = tl.load(q_ptr + j * stride_q + x).to(tl.float64)
            u = tl.load(uniforms_ptr + ACCEPT * stride_u + g + j)
            accepted = (u * qx < px) & (j < counted)
            n = tl.where((n == K) & ~accepted, j, n)
        return g, counted, n

    @triton.jit
    def _emit(n_ptr, out_ptr, drafts_ptr, n, token, K: tl.constexpr):
        """The round's outcome: n, then the accepted drafts, the drawn token, -1 after it."""
        tl.store(n_ptr, n.to(tl.int64))
        for j in tl.static_range(K + 1):
            d = tl.full((), -1, tl.int64)
            if j < K:
                d = tl.load(drafts_ptr + j)
            tl.store(out_ptr + j, tl.where(j < n, d, tl.where(j == n, token, -1)))

    @triton.jit
    def _residual(
        p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, n, counted, offs, valid, K: tl.constexpr, HAS_Q: tl.constexpr
    ):
        """(p_n, max(0, p_n - q_n)) at columns offs: the law the recovered token is drawn from (the
        caller takes p_n where that has no mass); q_n is zero at the bonus row (no draft there)."""
        live = (n < counted).to(tl.float32)
        p = tl.load(p_ptr + n.to(tl.int64) * stride_p + offs, mask=valid, other=0.0).to(tl.float32)
        r = p
        if K > 0:
            last = tl.minimum(n, K - 1).to(tl.int64)
            if HAS_Q:
                q = tl.load(q_ptr + last * stride_q + offs, mask=valid, other=0.0).to(tl.float32)
            else:  # greedy drafts: q_n is one-hot at the draft
                q = tl.where(offs == tl.load(drafts_ptr + last), 1.0, 0.0)
            r = tl.maximum(p - q * live, 0.0)
        return p, r

    @triton.jit
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
        g, counted, n = _num_accepted(
            p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, uniforms_ptr, stride_u, index_ptr, num_ptr, num_drafts,
            K, ACCEPT, HAS_Q, HAS_NUM,
        )  # fmt: skip
        offs = tl.arange(0, BLOCK_V)
        valid = offs < V
        p, r = _residual(p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, n, counted, offs, valid, K, HAS_Q)
        r = tl.where(tl.max(r, axis=0) > 0.0, r, p)
        token = _draw(r, valid, tl.load(uniforms_ptr + SAMPLE * stride_u + g + n))
        _emit(n_ptr, out_ptr, drafts_ptr, n, token, K)

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
        R: tl.constexpr,
        NUM_CTL: tl.constexpr,
        NUM_CTL_BLOCK: tl.constexpr,  # next_pow2(NUM_CTL)
        BLOCK_R: tl.constexpr,
        HEADS: tl.constexpr,
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
        before = befores_ptr + tl.load(index_ptr + g) * NUM_CTL
        old = tl.load(before + f, mask=fm).to(tl.int64)
        new = (
            tl.load(before + tl.load(a_idx_ptr + f, mask=fm, other=0), mask=fm).to(tl.int64)
            * tl.load(a_ptr + f, mask=fm)
            + tl.load(before + tl.load(b_idx_ptr + f, mask=fm, other=0), mask=fm).to(tl.int64)
            * tl.load(b_ptr + f, mask=fm)
            + (n + 1) * tl.load(kk_ptr + f, mask=fm)
            + tl.load(c_ptr + f, mask=fm)
        )
        tl.store(ctl_ptr + slot * NUM_CTL + f, new.to(tl.int32), mask=fm)
        out = out_ptr + slot * (2 + R + NUM_CTL)
        tl.store(out, n)
        tl.store(out + 1, count)
        tl.store(out + 2 + offs, out_ids, mask=offs < R)
        tl.store(out + 2 + R + f, old, mask=fm)


def _launch(V: int) -> dict:
    if V > MAX_V:
        raise ValueError(f"triton_sample: rows of {V} columns; one program holds at most {MAX_V}")
    block = next_pow2(V)
    return dict(BLOCK_V=block, num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)


def temperature_sample(
    logits: torch.Tensor,  # [N, V] float32 or bf16, rows contiguous
    temperature: torch.Tensor,  # [] float32 > 0 (device)
    u: torch.Tensor | None = None,  # [N] float64: each row's uniform (None: the law only)
    out: torch.Tensor | None = None,  # [N, V] float32: the law (default: a new tensor)
    ids: torch.Tensor | None = None,  # [N] long: the draws (default: a new tensor when u is given)
    top_k: torch.Tensor | None = None,  # [] long >= 1 (device; None: off)
    top_p: torch.Tensor | None = None,  # [] float32 in (0, 1] (device; None: off)
    min_p: torch.Tensor | None = None,  # [] float32 (device; None: off)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the filtered law softmax(logits / T), then top-k, top-p, min-p, renormalised [N, V]
    float32, the inverse-CDF draws [N] long or None)."""
    N, V = logits.shape
    if logits.stride(1) != 1 or (out is not None and out.stride(1) != 1):
        raise ValueError("temperature_sample: rows must be contiguous")
    out = torch.empty(N, V, device=logits.device, dtype=torch.float32) if out is None else out
    if u is not None and ids is None:
        ids = torch.empty(N, device=logits.device, dtype=torch.long)
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
    K, V = draft_ids.numel(), target_probs.shape[1]
    for t in (target_probs, draft_probs, uniforms):
        if t is not None and t.stride(1) != 1:
            raise ValueError("verify_sampled: rows must be contiguous")
    device = target_probs.device
    n = torch.empty((), device=device, dtype=torch.long)
    out_ids = torch.empty(K + 1, device=device, dtype=torch.long)
    has_num = isinstance(num_drafts, torch.Tensor)
    _verify_kernel[(1,)](
        target_probs,
        target_probs.stride(0),
        draft_probs if draft_probs is not None else target_probs,
        draft_probs.stride(0) if draft_probs is not None else 0,
        draft_ids,
        uniforms,
        uniforms.stride(0),
        index,
        num_drafts if has_num else index,
        0 if has_num else int(num_drafts),
        n,
        out_ids,
        V,
        K=K,
        ACCEPT=int(Stream.ACCEPT),
        SAMPLE=int(Stream.SAMPLE),
        HAS_Q=draft_probs is not None,
        HAS_NUM=has_num,
        **_launch(V),
    )
    return n, out_ids


def accept_greedy(
    target: torch.Tensor,  # [rows] long: the argmax of each packed verify row
    starts: torch.Tensor,  # [G] long: each member's first row
    slots: torch.Tensor,  # [G] long
    ks: torch.Tensor,  # [G] long: drafts this round
    counts: torch.Tensor,  # [G]: the drafts that count
    index: torch.Tensor,  # [G] long: each member's row of befores
    befores: torch.Tensor,  # [B, NUM_CTL] int32
    tensors: dict,  # the slots' round buffers: verify_ids, head_ids, ctl, out
    table: tuple[torch.Tensor, ...],  # nextn.cache.hybrid.commit_table's (a_idx, a, b_idx, b, k, c)
    heads: bool,  # write head_ids (a round with drafts)
) -> None:
    """The greedy accept and commit of G members in one launch (nextn.engine.rounds._accept_greedy)."""
    ids, ctl = tensors["verify_ids"], tensors["ctl"]
    R, num_ctl = ids.shape[1], ctl.shape[1]
    if not all(t.is_contiguous() for t in (target, befores, ids, tensors["head_ids"], ctl, tensors["out"], *table)):
        raise ValueError("accept_greedy: the buffers must be contiguous")
    _accept_greedy_kernel[(slots.numel(),)](
        target,
        starts,
        slots,
        ks,
        counts,
        index,
        befores,
        ids,
        tensors["head_ids"],
        ctl,
        tensors["out"],
        *table,
        R=R,
        NUM_CTL=num_ctl,
        NUM_CTL_BLOCK=next_pow2(num_ctl),
        BLOCK_R=max(2, next_pow2(R)),
        HEADS=heads,
        num_warps=1,
    )
