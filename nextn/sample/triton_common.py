"""The Triton helpers both sampling kernel modules build on: the one-program kernels
(nextn.sample.triton_sample, a row in one program) and the chunked ones (nextn.sample.triton_wide,
rows of any width). `inverse_cdf` (the capped searchsorted of every draw), `top_k_keep` and
`filters` (top-k, top-p, min-p by bisection over the probabilities' bit patterns), and the pieces
of a round's rejection sampling: `num_accepted` (the accept tests), `residual` (the law of the
recovered token) and `emit` (the round's outcome). On the host, the checks and buffers of their
entry points (`Law` and `sample_outputs` for `temperature_sample`, `round_args` for `verify_sampled`). Their
references: nextn.sample.pipeline (`probs_from_logits`, `sample`) and nextn.sample.verifier
(`verify_sampled`); the kernel modules' docstrings say how the arithmetic compares.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nextn.ops.triton_utils import HAVE_TRITON
from nextn.sample.pipeline import Stream


def contiguous_rows(name: str, *tensors: torch.Tensor | None) -> None:
    """Raise unless every given tensor's rows are contiguous (the kernels step columns by one)."""
    if any(t is not None and t.stride(1) != 1 for t in tensors):
        raise ValueError(f"{name}: rows must be contiguous")


def sample_outputs(
    logits: torch.Tensor, u: torch.Tensor | None, out: torch.Tensor | None, ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """temperature_sample's (out [N, V] float32, ids [N] long or None): the caller's, else new ones
    (ids only where there is a draw, u given), after checking that the rows are contiguous."""
    contiguous_rows("temperature_sample", logits, out)
    N, V = logits.shape
    out = torch.empty(N, V, device=logits.device, dtype=torch.float32) if out is None else out
    if u is not None and ids is None:
        ids = torch.empty(N, device=logits.device, dtype=torch.long)
    return out, ids


class RoundArgs(NamedTuple):
    args: tuple  # the verify kernels' leading arguments: p, stride, q, stride, drafts, uniforms, stride, index, num
    flags: dict  # their constexprs K, ACCEPT, HAS_Q, HAS_NUM
    n: torch.Tensor  # [] long out: the accepted drafts
    out_ids: torch.Tensor  # [K + 1] long out


def round_args(target_probs, draft_probs, draft_ids, uniforms, index, num_drafts) -> RoundArgs:
    """verify_sampled's inputs (nextn.sample.triton_sample.verify_sampled's arguments) as the verify
    kernels take them (`num_accepted`'s arguments), and its outputs, after checking that the rows are
    contiguous."""
    contiguous_rows("verify_sampled", target_probs, draft_probs, uniforms)
    device, K = target_probs.device, draft_ids.numel()
    has_num = isinstance(num_drafts, torch.Tensor)
    args = (
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
    )
    flags = dict(K=K, ACCEPT=int(Stream.ACCEPT), HAS_Q=draft_probs is not None, HAS_NUM=has_num)
    n = torch.empty((), device=device, dtype=torch.long)
    return RoundArgs(args, flags, n, torch.empty(K + 1, device=device, dtype=torch.long))


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def inverse_cdf(cdf, positive, t):
        """The first entry with mass (`positive`) whose running sum cdf (float64) exceeds t, else the
        last entry with mass (searchsorted, right, capped at the last entry that adds mass, without
        assuming the parallel scan's sums never fall by rounding): never an entry without mass."""
        i = tl.arange(0, cdf.shape[0])
        first = tl.min(tl.where(positive & (cdf > t), i, cdf.shape[0]), axis=0)
        last = tl.maximum(tl.max(tl.where(positive, i, -1), axis=0), 0)
        return tl.where(first < cdf.shape[0], first, last).to(tl.int64)

    @triton.jit
    def top_k_keep(bits, valid, k, lo):
        """The keep mask of the k largest of bits (int32 patterns of float32 >= 0, which order like
        their values; entries in index order) among the valid entries: the ones above the k-th
        largest value and, of the ones equal to it, the first by index. The k-th largest is bisected
        over the bit patterns from lo, where count(bits >= lo) >= k holds (31 steps of one
        reduction each)."""
        hi = tl.full((), 0x3F800001, tl.int32)  # count(bits >= hi) < k
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            enough = tl.sum((valid & (bits >= mid)).to(tl.int32), axis=0) >= k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        above = valid & (bits > lo)  # lo: the k-th largest value
        ties = valid & (bits == lo)
        room = k - tl.sum(above.to(tl.int32), axis=0)
        return above | (ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= room))

    @triton.jit
    def filters(
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
            keep = top_k_keep(bits, valid, k, tl.full((), 0, tl.int32))
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
    def num_accepted(
        p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, uniforms_ptr, stride_u, index_ptr, num_ptr, num_drafts,
        K: tl.constexpr, ACCEPT: tl.constexpr, HAS_Q: tl.constexpr, HAS_NUM: tl.constexpr,
    ):  # fmt: skip
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
    def emit(n_ptr, out_ptr, drafts_ptr, n, token, K: tl.constexpr):
        """The round's outcome: n, then the accepted drafts, the drawn token, -1 after it."""
        tl.store(n_ptr, n.to(tl.int64))
        for j in tl.static_range(K + 1):
            d = tl.full((), -1, tl.int64)
            if j < K:
                d = tl.load(drafts_ptr + j)
            tl.store(out_ptr + j, tl.where(j < n, d, tl.where(j == n, token, -1)))

    @triton.jit
    def residual(
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
