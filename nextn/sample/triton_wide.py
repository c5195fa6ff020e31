"""Token choice over rows wider than one program holds (the released models' 248,320 columns):
`temperature_sample` and `verify_sampled` of nextn.sample.triton_sample, with every row split into
chunks of CHUNK columns, one program a chunk, in a few launches instead of torch's sort, scans and
softmax (bench/results/profile_sampled_qwen3.5-9b_run112.json: a sampled K = 3 round on the 9B
shape spends 1.36 ms more than a greedy one with top-k 20 and top-p 0.8, 0.45 ms with neither).

The law (the same as the one-program kernel's, up to rounding):
1. `_stats` (a program a chunk): x = logits / T (correctly rounded), the chunk's max m and
   sum exp(x - m).
2. `_select` (a program a chunk; filtered laws): the row's max M and normaliser S from its chunks'
   statistics, p = exp(x - M) / S written out, the chunk's mass, and its KCAP most probable
   columns in the reference's order (probability descending, then index) as candidates (KCAP = 64
   under top-k, else KCAP_NUCLEUS = 256), with the largest probability it left out (its floor).
3. `_decide` (a program a row): top-k, then top-p, then min-p over the candidates, which are in
   index order, by nextn.sample.triton_common's `filters`. What they keep is a prefix of the order,
   so it is written as a bound (the last kept probability and, of the columns tied at it, the last
   kept index), a min-p threshold and the kept mass. The candidates decide exactly when the bound
   lies above every chunk's floor (and, for min-p alone, the threshold does): every column the
   reference keeps is then a candidate, and the bisections see the row's true counts and masses
   above the floor. Otherwise the program decides by streaming the row (the same bisections, each
   step a pass over the chunks, pipelined): exact, slow (~35 passes over 1 MB a row: ~0.9 ms, where
   torch's sort takes 0.2 ms a row, run 116); `covered` tells which (top-k above KCAP, or a nucleus
   wider than a chunk's candidates, as on near-uniform rows).
4. `_write` (a program a chunk): the kept columns' p / kept mass (every column's p without
   filters), and the chunk's float64 mass for the draw.
5. `_draw_kernel` (a program a row): the inverse-CDF draw in two levels: the chunk, over the chunks'
   running masses, then the column, over the chunk's running sum from there; each level capped at
   its last entry with mass, so no zero-mass token is drawn. In exact arithmetic that is the flat
   draw; in float64 it differs only where a uniform falls within rounding of a boundary.

`verify_sampled`: `_residual_kernel` (a program a chunk) finds the round's n as the one-program
kernel does and sums the chunk's residual max(0, p_n - q_n) and p_n; `_verify_draw` draws the
recovered or bonus token from them in the same two levels and writes n and the emitted ids.

Every row's result depends on its own values only (fixed chunks, sums in fixed orders), so a verify
row equals the decode row bitwise, and a request's plain and speculative rounds run the same
kernels: spec stays exact in distribution against plain decoding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nextn.ops.triton_utils import HAVE_TRITON, next_pow2
from nextn.sample.pipeline import Law, Stream
from nextn.sample.triton_common import round_args, sample_outputs

CHUNK = 8192  # columns a program holds
KCAP = 64  # candidates a chunk offers the filters under top-k: top-k up to KCAP always decides on them
KCAP_NUCLEUS = 256  # without top-k: a top-p nucleus (or min-p set) up to 256 columns a chunk decides on them

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from nextn.sample.triton_common import emit, filters, inverse_cdf, num_accepted, residual, top_k_keep

    @triton.jit
    def _row_norm(stats_ptr, row, C, CB: tl.constexpr):
        """(M, S): the row's max of x and sum of exp(x - M), from its C chunks' (m, s)."""
        c = tl.arange(0, CB)
        m = tl.load(stats_ptr + (row * C + c) * 2, mask=c < C, other=float("-inf"))
        s = tl.load(stats_ptr + (row * C + c) * 2 + 1, mask=c < C, other=0.0)
        big = tl.max(m, axis=0)
        return big, tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - big), 0.0), axis=0)

    @triton.jit
    def _scaled(logits_ptr, stride_l, temp_ptr, row, offs, valid):
        logit = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
        return tl.math.div_rn(logit, tl.load(temp_ptr).to(tl.float32))

    @triton.jit
    def _chunk_law(logits_ptr, stride_l, temp_ptr, stats_ptr, row, offs, valid, C, CB: tl.constexpr):
        """p = exp(x - M) / S at columns offs of the row (0 where masked)."""
        big, total = _row_norm(stats_ptr, row, C, CB)
        x = _scaled(logits_ptr, stride_l, temp_ptr, row, offs, valid)
        return tl.where(x > float("-inf"), tl.exp(x - big), 0.0) / total

    @triton.jit
    def _stats_kernel(logits_ptr, stride_l, temp_ptr, stats_ptr, V, C, CHUNK: tl.constexpr):
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        x = _scaled(logits_ptr, stride_l, temp_ptr, row, offs, offs < V)
        m = tl.max(x, axis=0)
        shift = tl.where(m > float("-inf"), m, 0.0)  # a chunk of banned columns: s = 0
        s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - shift), 0.0), axis=0)
        tl.store(stats_ptr + (row * C + c) * 2, m)
        tl.store(stats_ptr + (row * C + c) * 2 + 1, s)

    @triton.jit
    def _select_kernel(
        logits_ptr,
        stride_l,
        temp_ptr,
        stats_ptr,  # [N, C, 2] float32
        probs_ptr,  # [N, V] float32 out: the unfiltered law
        stride_p,
        mass_ptr,  # [N, C] float32 out: each chunk's mass
        cand_ptr,  # [N, C * KCAP] int32 out: candidates' probability bits (-1: none)
        cidx_ptr,  # [N, C * KCAP] int32 out: their columns
        floor_ptr,  # [N, C] int32 out: the largest probability bits a chunk left out (-1: none)
        V,
        C,
        CB: tl.constexpr,
        CHUNK: tl.constexpr,
        KCAP: tl.constexpr,
    ):
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        valid = offs < V
        p = _chunk_law(logits_ptr, stride_l, temp_ptr, stats_ptr, row, offs, valid, C, CB)
        tl.store(probs_ptr + row * stride_p + offs, p, mask=valid)
        tl.store(mass_ptr + row * C + c, tl.sum(p, axis=0))
        # the KCAP-th largest bits: count(bits >= lo) >= KCAP (lo = -1: the chunk has fewer columns)
        bits = tl.where(valid, p.to(tl.int32, bitcast=True), -1)
        chosen = top_k_keep(bits, valid, KCAP, tl.full((), -1, tl.int32))
        slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # candidates stay in index order
        base = row * C * KCAP + c * KCAP
        tl.store(cand_ptr + base + slot, bits, mask=chosen)
        tl.store(cidx_ptr + base + slot, offs, mask=chosen)
        k = tl.arange(0, KCAP)
        tl.store(cand_ptr + base + k, -1, mask=k >= tl.sum(chosen.to(tl.int32), axis=0))
        tl.store(floor_ptr + row * C + c, tl.max(tl.where(valid & ~chosen, bits, -1), axis=0))

    @triton.jit
    def _in_bound(bits, offs, bound, last):
        """Whether columns offs of probability bits come no later than (bound, last) in the order
        probability descending, then index."""
        return (bits > bound) | ((bits == bound) & (offs <= last))

    @triton.jit
    def _stream_count(probs_ptr, V, C, mid, bound, last, CHUNK: tl.constexpr):
        """(count, mass) of the row's columns within (bound, last) whose bits are above mid."""
        count = tl.full((), 0, tl.int32)
        mass = tl.full((), 0.0, tl.float32)
        for c in tl.range(0, C, num_stages=3):
            offs = c * CHUNK + tl.arange(0, CHUNK)
            p = tl.load(probs_ptr + offs, mask=offs < V, other=-1.0)
            bits = p.to(tl.int32, bitcast=True)
            hit = (offs < V) & _in_bound(bits, offs, bound, last) & (bits > mid)
            count += tl.sum(hit.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(hit, p, 0.0), axis=0)
        return count, mass

    @triton.jit
    def _stream_decide(
        probs_ptr, top_k_ptr, top_p_ptr, V, C, TOP_K: tl.constexpr, TOP_P: tl.constexpr, CHUNK: tl.constexpr
    ):
        """(bound, last) of top-k then top-p by passes over the row (`filters`' bisections, each
        step's count or mass summed over the chunks in order)."""
        bound = tl.full((), -1, tl.int32)
        last = tl.full((), 0x7FFFFFFF, tl.int32)
        if TOP_K:
            k = tl.minimum(tl.load(top_k_ptr).to(tl.int32), V)
            lo = tl.full((), 0, tl.int32)  # count(bits >= lo) >= k
            hi = tl.full((), 0x3F800001, tl.int32)
            for _ in range(31):
                mid = lo + (hi - lo) // 2
                enough = _stream_count(probs_ptr, V, C, mid - 1, bound, last, CHUNK)[0] >= k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid)
            room = k - _stream_count(probs_ptr, V, C, lo, bound, last, CHUNK)[0]
            seen = tl.full((), 0, tl.int32)
            cut = tl.full((), -1, tl.int32)
            # the room-th column tied at lo, in index order
            for c in tl.range(0, C, num_stages=3):
                offs = c * CHUNK + tl.arange(0, CHUNK)
                bits = tl.load(probs_ptr + offs, mask=offs < V, other=-1.0).to(tl.int32, bitcast=True)
                ties = (offs < V) & (bits == lo)
                rank = seen + tl.cumsum(ties.to(tl.int32), axis=0)
                cut = tl.maximum(cut, tl.max(tl.where(ties & (rank <= room), offs, -1), axis=0))
                seen += tl.sum(ties.to(tl.int32), axis=0)
            bound, last = lo, cut
        if TOP_P:
            target = tl.load(top_p_ptr).to(tl.float32) * _stream_count(probs_ptr, V, C, -1, bound, last, CHUNK)[1]
            lo = tl.full((), -1, tl.int32)  # kept mass above lo >= target
            hi = tl.full((), 0x3F800000, tl.int32)  # kept mass above hi < target
            for _ in range(31):
                mid = lo + (hi - lo) // 2
                below = _stream_count(probs_ptr, V, C, mid, bound, last, CHUNK)[1] < target
                lo = tl.where(below, lo, mid)
                hi = tl.where(below, mid, hi)
            heavier = _stream_count(probs_ptr, V, C, hi, bound, last, CHUNK)[1]
            before = tl.full((), 0.0, tl.float32)
            cut = tl.full((), -1, tl.int32)
            # the tokens tied at hi whose kept mass before them stays below target
            for c in tl.range(0, C, num_stages=3):
                offs = c * CHUNK + tl.arange(0, CHUNK)
                p = tl.load(probs_ptr + offs, mask=offs < V, other=-1.0)
                bits = p.to(tl.int32, bitcast=True)
                ties = (offs < V) & _in_bound(bits, offs, bound, last) & (bits == hi)
                tied = tl.where(ties, p, 0.0)
                run = before + tl.cumsum(tied, axis=0) - tied
                cut = tl.maximum(cut, tl.max(tl.where(ties & (heavier + run < target), offs, -1), axis=0))
                before += tl.sum(tied, axis=0)
            bound, last = hi, cut
        return bound, last

    @triton.jit
    def _decide_kernel(
        probs_ptr,  # [N, V] float32: the unfiltered law
        stride_p,
        mass_ptr,  # [N, C] float32
        cand_ptr,  # [N, C * KCAP] int32
        cidx_ptr,  # [N, C * KCAP] int32
        floor_ptr,  # [N, C] int32
        top_k_ptr,
        top_p_ptr,
        min_p_ptr,
        bound_ptr,  # [N, 3] int32 out: bound bits, last index, covered
        kept_ptr,  # [N, 2] float32 out: min-p threshold, kept mass
        V, C, CB: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr, KCAP: tl.constexpr,
        TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, NB)
        bits = tl.load(cand_ptr + row * C * KCAP + i, mask=i < C * KCAP, other=-1)
        idx = tl.load(cidx_ptr + row * C * KCAP + i, mask=i < C * KCAP, other=0)
        valid = bits >= 0
        p = tl.where(valid, bits.to(tl.float32, bitcast=True), 0.0)
        c = tl.arange(0, CB)
        floor = tl.max(tl.load(floor_ptr + row * C + c, mask=c < C, other=-1), axis=0)
        row_mass = tl.sum(tl.load(mass_ptr + row * C + c, mask=c < C, other=0.0), axis=0)
        covered = tl.full((), 1, tl.int32)
        bound = tl.full((), -1, tl.int32)
        last = tl.full((), 0x7FFFFFFF, tl.int32)
        if TOP_K or TOP_P:
            keep = valid
            if TOP_K:  # the k-th largest must lie above every column left out
                keep = filters(p, valid, top_k_ptr, top_p_ptr, min_p_ptr, V, row_mass, True, False, False)
                covered = (tl.min(tl.where(keep, bits, 0x7FFFFFFF), axis=0) > floor).to(tl.int32)
                row_mass = tl.sum(tl.where(keep, p, 0.0), axis=0)  # top-p's base: the mass top-k kept
            if TOP_P:
                keep = filters(p, keep, top_k_ptr, top_p_ptr, min_p_ptr, V, row_mass, False, True, False)
            bound = tl.min(tl.where(keep, bits, 0x7FFFFFFF), axis=0)
            last = tl.max(tl.where(keep & (bits == bound), idx, -1), axis=0)
            covered = covered & (bound > floor).to(tl.int32)
        threshold = tl.full((), 0.0, tl.float32)
        if MIN_P:  # the row's largest probability is a candidate (every chunk offers its largest)
            threshold = tl.load(min_p_ptr).to(tl.float32) * tl.max(p, axis=0)
            if not (TOP_K or TOP_P):
                covered = ((floor < 0) | (floor.to(tl.float32, bitcast=True) < threshold)).to(tl.int32)
        kept = valid & _in_bound(bits, idx, bound, last) & (p >= threshold)
        mass = tl.sum(tl.where(kept, p, 0.0), axis=0)
        if covered == 0:
            row_ptr = probs_ptr + row * stride_p
            bound, last = _stream_decide(row_ptr, top_k_ptr, top_p_ptr, V, C, TOP_K, TOP_P, CHUNK)
            mass = tl.full((), 0.0, tl.float32)
            for j in tl.range(0, C, num_stages=3):
                offs = j * CHUNK + tl.arange(0, CHUNK)
                q = tl.load(row_ptr + offs, mask=offs < V, other=-1.0)
                hit = (offs < V) & _in_bound(q.to(tl.int32, bitcast=True), offs, bound, last) & (q >= threshold)
                mass += tl.sum(tl.where(hit, q, 0.0), axis=0)
        tl.store(bound_ptr + row * 3, bound)
        tl.store(bound_ptr + row * 3 + 1, last)
        tl.store(bound_ptr + row * 3 + 2, covered)
        tl.store(kept_ptr + row * 2, threshold)
        tl.store(kept_ptr + row * 2 + 1, mass)

    @triton.jit
    def _write_kernel(
        logits_ptr,
        stride_l,
        temp_ptr,
        stats_ptr,
        probs_ptr,  # [N, V] float32: the unfiltered law (FILTERED) -> the law
        stride_p,
        bound_ptr,
        kept_ptr,
        sums_ptr,  # [N, C] float64 out: each chunk's mass of the law (DRAW)
        V,
        C,
        CB: tl.constexpr,
        CHUNK: tl.constexpr,
        FILTERED: tl.constexpr,
        DRAW: tl.constexpr,
    ):
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        valid = offs < V
        if FILTERED:
            p = tl.load(probs_ptr + row * stride_p + offs, mask=valid, other=0.0)
            bound, last = tl.load(bound_ptr + row * 3), tl.load(bound_ptr + row * 3 + 1)
            keep = _in_bound(p.to(tl.int32, bitcast=True), offs, bound, last) & (p >= tl.load(kept_ptr + row * 2))
            p = tl.where(keep, p, 0.0) / tl.load(kept_ptr + row * 2 + 1)
        else:
            p = _chunk_law(logits_ptr, stride_l, temp_ptr, stats_ptr, row, offs, valid, C, CB)
        tl.store(probs_ptr + row * stride_p + offs, p, mask=valid)
        if DRAW:
            tl.store(sums_ptr + row * C + c, tl.sum(tl.where(valid, p, 0.0).to(tl.float64), axis=0))

    @triton.jit
    def _pick_chunk(sums_ptr, u, C, CB: tl.constexpr):
        """(chunk, t): the chunk drawn with uniform u over the running sum of its C float64 masses
        (the last chunk with mass at the top), and the draw's point t within it."""
        c = tl.arange(0, CB)
        s = tl.load(sums_ptr + c, mask=c < C, other=0.0)
        run = tl.cumsum(s, axis=0)
        t = u * tl.max(tl.where(c < C, run, 0.0), axis=0)
        chunk = inverse_cdf(run, (c < C) & (s > 0.0), t)
        return chunk, t - tl.sum(tl.where(c == chunk - 1, run, 0.0), axis=0)

    @triton.jit
    def _pick_column(r, valid, t):
        """The column of r (float32 >= 0, a chunk) where its float64 running sum passes t (its last
        column with mass when it does not)."""
        return inverse_cdf(tl.cumsum(r.to(tl.float64), axis=0), valid & (r > 0.0), t)

    @triton.jit
    def _draw_kernel(probs_ptr, stride_p, sums_ptr, u_ptr, ids_ptr, V, C, CB: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk, t = _pick_chunk(sums_ptr + row * C, tl.load(u_ptr + row), C, CB)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = offs < V
        r = tl.load(probs_ptr + row * stride_p + offs, mask=valid, other=0.0)
        tl.store(ids_ptr + row, chunk * CHUNK + _pick_column(r, valid, t))

    @triton.jit
    def _residual_kernel(
        # the round's arguments, as triton_sample._verify_kernel's: p [K + 1, V], q [K, V] (HAS_Q), ...
        p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, uniforms_ptr, stride_u, index_ptr, num_ptr, num_drafts,
        sums_ptr,  # [2, C] float64 out: each chunk's residual mass, then its p_n mass
        V, C,
        K: tl.constexpr, ACCEPT: tl.constexpr, HAS_Q: tl.constexpr, HAS_NUM: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        c = tl.program_id(0)
        _, counted, n = num_accepted(
            p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, uniforms_ptr, stride_u, index_ptr, num_ptr, num_drafts,
            K, ACCEPT, HAS_Q, HAS_NUM,
        )  # fmt: skip
        offs = c * CHUNK + tl.arange(0, CHUNK)
        valid = offs < V
        p, r = residual(p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, n, counted, offs, valid, K, HAS_Q)
        tl.store(sums_ptr + c, tl.sum(r.to(tl.float64), axis=0))
        tl.store(sums_ptr + C + c, tl.sum(p.to(tl.float64), axis=0))

    @triton.jit
    def _verify_draw_kernel(
        p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, uniforms_ptr, stride_u, index_ptr, num_ptr, num_drafts,
        sums_ptr,  # [2, C] float64: _residual_kernel's
        n_ptr,  # [] long out
        out_ptr,  # [K + 1] long out
        V, C, CB: tl.constexpr,
        K: tl.constexpr, ACCEPT: tl.constexpr, SAMPLE: tl.constexpr, HAS_Q: tl.constexpr, HAS_NUM: tl.constexpr,
        CHUNK: tl.constexpr,
    ):  # fmt: skip
        g, counted, n = num_accepted(
            p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, uniforms_ptr, stride_u, index_ptr, num_ptr, num_drafts,
            K, ACCEPT, HAS_Q, HAS_NUM,
        )  # fmt: skip
        c = tl.arange(0, CB)
        has_mass = tl.max(tl.load(sums_ptr + c, mask=c < C, other=0.0), axis=0) > 0.0  # else draw from p_n
        u = tl.load(uniforms_ptr + SAMPLE * stride_u + g + n)
        chunk, t = _pick_chunk(sums_ptr + tl.where(has_mass, 0, C), u, C, CB)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = offs < V
        p, r = residual(p_ptr, stride_p, q_ptr, stride_q, drafts_ptr, n, counted, offs, valid, K, HAS_Q)
        token = chunk * CHUNK + _pick_column(tl.where(has_mass, r, p), valid, t)
        emit(n_ptr, out_ptr, drafts_ptr, n, token, K)


def _warps(chunk: int) -> int:
    return 4 if chunk <= 2048 else 8


class Chunks(NamedTuple):
    """How temperature_sample splits a row (tests shrink both, to cross chunks at small widths)."""

    size: int  # columns a program holds
    kcap: int  # candidates a chunk offers the filters


def temperature_sample(
    logits, law: Law, u=None, out=None, ids=None,
    bounds: torch.Tensor | None = None,  # [N, 3] int32 out (filtered laws): bound bits, last index, covered
    chunks: Chunks | None = None,  # default CHUNK, and KCAP with top-k, else KCAP_NUCLEUS
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """nextn.sample.triton_sample.temperature_sample (the arguments as there) for rows of any width, in
    chunks."""
    temperature, top_k, top_p, min_p = law
    chunk, kcap = chunks or (CHUNK, KCAP if top_k is not None else KCAP_NUCLEUS)
    N, V = logits.shape
    out, ids = sample_outputs(logits, u, out, ids)
    dev = logits.device
    C = triton.cdiv(V, chunk)
    CB, warps = max(2, next_pow2(C)), _warps(chunk)
    stats = torch.empty(N, C, 2, device=dev, dtype=torch.float32)
    _stats_kernel[(N, C)](logits, logits.stride(0), temperature, stats, V, C, CHUNK=chunk, num_warps=warps)
    filtered = top_k is not None or top_p is not None or min_p is not None
    kept = None
    if filtered:
        mass = torch.empty(N, C, device=dev, dtype=torch.float32)
        cand = torch.empty(N, C * kcap, device=dev, dtype=torch.int32)
        cidx, floor = torch.empty_like(cand), torch.empty(N, C, device=dev, dtype=torch.int32)
        _select_kernel[(N, C)](
            logits, logits.stride(0), temperature, stats, out, out.stride(0), mass, cand, cidx, floor, V, C,
            CB=CB, CHUNK=chunk, KCAP=kcap, num_warps=warps,
        )  # fmt: skip
        bounds = torch.empty(N, 3, device=dev, dtype=torch.int32) if bounds is None else bounds
        kept = torch.empty(N, 2, device=dev, dtype=torch.float32)
        values = [t if t is not None else temperature for t in (top_k, top_p, min_p)]
        _decide_kernel[(N,)](
            out, out.stride(0), mass, cand, cidx, floor, *values, bounds, kept, V, C,
            CB=CB, NB=max(2, next_pow2(C * kcap)), CHUNK=chunk, KCAP=kcap,
            TOP_K=top_k is not None, TOP_P=top_p is not None, MIN_P=min_p is not None,
            num_warps=warps if top_k is not None else 2 * warps,  # the nucleus's 4x candidates, its passes: run 116
        )  # fmt: skip
    sums = torch.empty(N, C, device=dev, dtype=torch.float64) if u is not None else out
    _write_kernel[(N, C)](
        logits, logits.stride(0), temperature, stats, out, out.stride(0),
        bounds if filtered else stats, kept if filtered else stats, sums, V, C,
        CB=CB, CHUNK=chunk, FILTERED=filtered, DRAW=u is not None, num_warps=warps,
    )  # fmt: skip
    if u is not None:
        _draw_kernel[(N,)](out, out.stride(0), sums, u, ids, V, C, CB=CB, CHUNK=chunk, num_warps=warps)
    return out, ids


def verify_sampled(target_probs, draft_probs, draft_ids, uniforms, index, num_drafts, chunk: int | None = None):
    """nextn.sample.triton_sample.verify_sampled (the arguments as there) for rows of any width, in chunks."""
    chunk = chunk or CHUNK
    V = target_probs.shape[1]
    args, flags, n, out_ids = round_args(target_probs, draft_probs, draft_ids, uniforms, index, num_drafts)
    C = triton.cdiv(V, chunk)
    sums = torch.empty(2, C, device=target_probs.device, dtype=torch.float64)
    _residual_kernel[(C,)](*args, sums, V, C, **flags, CHUNK=chunk, num_warps=_warps(chunk))
    _verify_draw_kernel[(1,)](
        *args, sums, n, out_ids, V, C, CB=max(2, next_pow2(C)), SAMPLE=int(Stream.SAMPLE), **flags, CHUNK=chunk,
        num_warps=_warps(chunk),
    )  # fmt: skip
    return n, out_ids
