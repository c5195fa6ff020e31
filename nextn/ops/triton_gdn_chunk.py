"""Chunked gated delta rule for prefill, in three Triton kernels; reference:
`nextn.ops.gdn.chunk_gated_delta_rule` (same signature, same chunk algebra, float32 throughout).

1. `_chunk_prep_kernel`, one program per (chunk, batch x value head), all chunks at once: the
   chunk's cumulative log decay gc, the causal intra-chunk scores causal(q k^T * exp(gc_i - gc_j)),
   A = strictly-lower(k_beta k^T * exp(gc_i - gc_j)), the inverse of the unit lower-triangular
   (I + A), and from it w = (I+A)^-1 (k_beta * exp(gc)) and u = (I+A)^-1 v_beta (the UT transform):
   float32 scratch. The inverse is blocked from 1 x 1 blocks up: each of six levels merges pairs of
   diagonal blocks, X21 = -X22 L21 X11 (two dots a level over the whole 64 x 64 tile, the first level
   elementwise: the 1 x 1 blocks' inverses are 1), what a blocked triangular inverse does; no power
   series, whose terms can cancel catastrophically when keys repeat.
2. `_chunk_states_kernel`, one program per (batch x value head, block of value columns), walks the
   chunks in order with its [K, BLOCK_V] slice of the state in registers (two halves of the key rows),
   storing the state each chunk starts from and v_new in place of u (with `chunk_starts`, the batch is
   pieces one after another in one sequence of whole chunks, each program walking its piece's: the
   launches' sizes then depend on the pieces' count and chunks, not their split):
       v_new = u - w S;  S = exp(gc_last) S + (k * exp(gc_last - gc))^T v_new
3. `_chunk_output_kernel`, one program per (chunk, batch x value head, block of value columns), all
   chunks at once from the states the walk stored: o = (q * exp(gc)) S + intra v_new. (Only the walk
   runs serially: two of the four products a chunk, where one scan kernel ran all four in its loop.)

Every product is a `tl.dot` on float32 operands on tensor cores: those that make the state (the
walk's, and A, the inverse, u, w that feed it) at "tf32x3" precision (three TF32 products, near
float32), the output's at "tf32" (one: 1.6x the speed at 16 prompts of 512 rows; PRECISIONS says what
each costs). At the 9B shape over 517 tokens the final states stay within 1e-4 of the reference's
(tests/test_kernels.py): the prompt's states must agree with the reference's closely, since decoding
continues from them. Rows past T are loaded as zeros with g = 0, exactly as the reference pads, so
they change nothing.

Around them, for prompt pieces in a trunk step (nextn.models.qwen3_5_step, StepBatch.chunked), two
launches where the module runs a dozen ops each: `chunk_inputs` lays out the step rows' conv outputs
and gates as pieces in whole chunks (q and k l2-normalised, beta, g; zeros past a piece, which the rule
passes through unchanged) and `gated_norm_rows` applies the layer's RMSNormGated * silu(z)
to the pieces' rows of the rule's output, each op rounded as the module rounds it.
"""

from __future__ import annotations

import torch

from nextn.config import GDN_CHUNK
from nextn.ops.triton_utils import HAVE_TRITON, next_pow2, require_triton

CHUNK = GDN_CHUNK
STATES_BLOCK_V = 32  # value columns of the state per states program (fewer when V is smaller)
OUTPUT_BLOCK_V = 64  # value columns of the output per output program (fewer when V is smaller)
# launch options of the three kernels; bench/sm90_compile.py compiles the kernels with them (and with
# `launch_constexprs`) for sm90 on the CPU and checks their shared memory fits an H200 block
# (run 212, H100, bench/chunk_rule_probe.py, us a call at 1 x 256 / 1 x 512 / 16 x 512 rows: the two kernels of
# 74b882b 114.1 / 218.0 / 3,455.6; these three with the prep at 8 warps 88.2 / 185.8 / 2,474.3, at 4 warps 89.1 /
# 147.3 / 1,910.9 (the prep 97.6 -> 61.1 us at 1 x 512); the states kernel at 8 warps or 64 columns and the output
# kernel's other tiles were slower or equal)
PREP_OPTIONS = dict(num_warps=4, num_stages=1)
STATES_OPTIONS = dict(num_warps=4, num_stages=1)  # (sm90: 8 bytes of spill stores at 4 warps, 304 at 8)
OUTPUT_OPTIONS = dict(num_warps=4, num_stages=1)


# Each dot's input precision ("tf32x3": three TF32 products, near float32; "tf32": one, a 10-bit mantissa):
# A = k_beta k^T, INV the inverse's merges, UW u and w, O the intra-chunk scores and the output's two
# products, S the states walk's two products. Measured at the 9B's heads (runs 194-195, H100,
# bench/chunk_rule_probe.py, from a state, us; every dot tf32x3 -> O in tf32 -> O and INV in tf32): 1 x 64
# rows 111 / 73 / 47, 1 x 512 336 / 218 / 160, 16 x 512 5,703 / 3,504 / 2,700. O in tf32 leaves the states
# as they were (within 3e-7 of the float32 reference's) and the output within 2e-4 (an eighth of a bf16 ulp
# at 1); INV in tf32 moves the states by up to 1e-4 (run 197, heads of 128 from a state of 0.1) and every dot
# in tf32 by 9e-4: the state's products and those feeding it keep three passes, decoding continues from them.
PRECISIONS = dict(A="tf32x3", INV="tf32x3", UW="tf32x3", O="tf32", S="tf32x3")
# The inverse's chain: 10 dependent 64 x 64 dots at INV's precision (five merging levels), where 74b882b ran
# 19 (15 forward-substitution steps inside the 16 x 16 diagonal blocks, each a 64 x 64 dot, then merges at 16
# and 32 rows). The four blocks as [4, 16, 16], each step's row from the rows above it in float32 on CUDA
# cores, was slower still (run 208, H100: 1 x 512 rows 276 / 218 us at 8 / 4 warps against 219).


def scratch_floats_per_row(HV: int, K: int, V: int) -> int:
    """float32 elements `chunk_gated_delta_rule` allocates a (padded) row beside its output, for HV value heads of
    dims K and V: u (v_new after the walk), w, the intra-chunk scores, gc, and each chunk's first state (K x V
    per CHUNK rows); nextn.engine.memory counts them in a prefill's activations."""
    return HV * (V + K + CHUNK + 1 + -(-K * V // CHUNK))


def launch_constexprs(
    H: int, HV: int, K: int, V: int, has_h0: bool, slots: bool = False, varlen: bool = False
) -> tuple[dict, dict, dict]:
    """The constexprs of (`_chunk_prep_kernel`, `_chunk_states_kernel`, `_chunk_output_kernel`) for H key
    heads and HV value heads of dims K and V, as `chunk_gated_delta_rule` launches them (varlen: with
    chunk_starts)."""
    BK, BV = max(16, next_pow2(K)), max(16, next_pow2(V))
    HK = max(16, BK // 2)  # the prep and states kernels hold the key columns in two halves (a dot's least: 16)
    # (a one-pass tf32 dot over a transposed operand of 16 rows, q k^T or k_beta k^T at key heads of 16 or
    # fewer, made an illegal memory access on an H100, run 197: those dots take three passes, the prep's
    # wherever its halves are 16 columns, the output kernel's products at key heads of 16)
    prec = dict(PRECISIONS, O="tf32x3", A="tf32x3") if HK < 32 else PRECISIONS
    out_prec = dict(PRECISIONS, O="tf32x3") if BK < 32 else PRECISIONS
    common = dict(HV=HV, GROUPS=HV // H, K=K, V=V, C=CHUNK)
    prep = dict(common, HK=HK, HALF_V=max(16, BV // 2), P_O=prec["O"], P_A=prec["A"])
    prep.update(P_INV=prec["INV"], P_UW=prec["UW"])
    states = dict(common, HK=HK, BLOCK_V=min(STATES_BLOCK_V, BV), HAS_H0=has_h0, SLOTS=slots, P_S=prec["S"])
    states.update(VARLEN=varlen)
    output = dict(common, BK=BK, BLOCK_V=min(OUTPUT_BLOCK_V, BV), P_O=out_prec["O"])
    return prep, states, output


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _dotp(a, b, PREC: tl.constexpr):
        return tl.dot(a, b, input_precision=PREC)

    # (the gates' batch strides, T x HV, are 16-divisible or not by the piece's rows: a variant each)
    @triton.jit(do_not_specialize=["T", "sg_b", "sb_b"])
    def _chunk_prep_kernel(
        q_ptr,
        sq_b,
        sq_t,
        sq_h,  # [B, T, H, K]
        k_ptr,
        sk_b,
        sk_t,
        sk_h,  # [B, T, H, K]
        v_ptr,
        sv_b,
        sv_t,
        sv_h,  # [B, T, HV, V]
        g_ptr,
        beta_ptr,
        sg_b,
        sg_t,
        sb_b,
        sb_t,  # [B, T, HV] (head stride 1)
        u_ptr,
        w_ptr,
        a_ptr,
        gc_ptr,  # scratch [B*HV, Tp, V], [.., K], [.., C], [B*HV, Tp] float32
        T,
        Tp,
        scale,
        HV: tl.constexpr,
        GROUPS: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        HK: tl.constexpr,
        HALF_V: tl.constexpr,
        C: tl.constexpr,
        P_O: tl.constexpr,
        P_A: tl.constexpr,
        P_INV: tl.constexpr,
        P_UW: tl.constexpr,
    ):
        tl.static_assert(C == 64, "the blocked inverse merges six levels of blocks: C = 64 exactly")
        ic = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HV
        hv = bh % HV
        h = hv // GROUPS
        r = tl.arange(0, C)
        t = ic * C + r
        tm = t < T
        rows = bh * Tp + t
        # (the key and value columns in halves, HK and HALF_V each, in the order that keeps fewest tiles
        # live: the scores and A, the inverse, then w and u)
        k1 = tl.arange(0, HK)
        k2 = HK + tl.arange(0, HK)
        m1 = tm[:, None] & (k1 < K)[None, :]
        m2 = tm[:, None] & (k2 < K)[None, :]
        k_at = k_ptr + b * sk_b + t[:, None] * sk_t + h * sk_h
        q_at = q_ptr + b * sq_b + t[:, None] * sq_t + h * sq_h
        g = tl.load(g_ptr + b * sg_b + t * sg_t + hv, mask=tm, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, axis=0)
        tl.store(gc_ptr + rows, gc)
        beta = tl.load(beta_ptr + b * sb_b + t * sb_t + hv, mask=tm, other=0.0).to(tl.float32)
        ka = tl.load(k_at + k1[None, :], mask=m1, other=0.0).to(tl.float32)
        qa = tl.load(q_at + k1[None, :], mask=m1, other=0.0).to(tl.float32)
        qk = _dotp(qa * scale, tl.trans(ka), P_O)
        kbk = _dotp(ka * beta[:, None], tl.trans(ka), P_A)  # k_beta k^T
        kb = tl.load(k_at + k2[None, :], mask=m2, other=0.0).to(tl.float32)
        qb = tl.load(q_at + k2[None, :], mask=m2, other=0.0).to(tl.float32)
        qk = tl.dot(qb * scale, tl.trans(kb), qk, input_precision=P_O)
        kbk = tl.dot(kb * beta[:, None], tl.trans(kb), kbk, input_precision=P_A)
        causal = r[:, None] >= r[None, :]
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0))
        tl.store(a_ptr + rows[:, None] * C + r[None, :], tl.where(causal, qk * decay, 0.0))  # the intra scores
        A = tl.where(r[:, None] > r[None, :], kbk * decay, 0.0)
        # (I + A)^-1, blocked from 1 x 1 blocks up: each level merges pairs of s-row diagonal blocks,
        # X21 = -X22 L21 X11, as X - X (L_pairs X) with X block diagonal; at s = 1 the blocks' inverses
        # are 1, so the first level is I - (A's entries below the pairs' diagonal)
        eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        X = eye - tl.where((r[:, None] == r[None, :] + 1) & (r[:, None] % 2 == 1), A, 0.0)
        for level in range(1, 6):  # pairs of 2, 4, 8, 16, 32-row blocks (C = 64)
            pairs = ((r[:, None] >> level) == (r[None, :] >> level) + 1) & ((r[:, None] >> level) % 2 == 1)
            X = X - _dotp(X, _dotp(tl.where(pairs, A, 0.0), X, P_INV), P_INV)
        to_w = beta * tl.exp(gc)
        for half in range(2):  # w = X (k_beta * exp(gc)), a half of the key columns at a time (k loaded again)
            kh = half * HK + tl.arange(0, HK)
            mh = tm[:, None] & (kh < K)[None, :]
            k = tl.load(k_at + kh[None, :], mask=mh, other=0.0).to(tl.float32)
            w = _dotp(X, k * to_w[:, None], P_UW)
            tl.store(w_ptr + rows[:, None] * K + kh[None, :], w, mask=(kh < K)[None, :])
        for half in range(2):  # u = X (v * beta), a half of the value columns at a time
            vh = half * HALF_V + tl.arange(0, HALF_V)
            v = tl.load(
                v_ptr + b * sv_b + t[:, None] * sv_t + hv * sv_h + vh[None, :],
                mask=tm[:, None] & (vh < V)[None, :],
                other=0.0,
            )
            u = _dotp(X, v.to(tl.float32) * beta[:, None], P_UW)
            tl.store(u_ptr + rows[:, None] * V + vh[None, :], u, mask=(vh < V)[None, :])

    @triton.jit(do_not_specialize=["T"])
    def _chunk_states_kernel(
        k_ptr,
        sk_b,
        sk_t,
        sk_h,  # [B, T, H, K]
        u_ptr,  # from the prep kernel: u in, v_new out (in place)
        w_ptr,
        gc_ptr,  # from the prep kernel
        h0_ptr,  # [B*HV, K, V] float32, if HAS_H0
        hs_ptr,  # [B*HV, Tp / C, K, V] float32 out: the state each chunk starts from
        ht_ptr,  # [B*HV, K, V] float32 out: the final state
        h0_at_ptr,
        ht_at_ptr,  # SLOTS: [B] long, where sequence b's [HV, K, V] state starts in h0 / ht (a cache's halves)
        starts_ptr,  # VARLEN: [B + 1] int32, piece b's chunks (in the one sequence of rows) start .. end
        T,
        Tp,
        HV: tl.constexpr,
        GROUPS: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        HK: tl.constexpr,
        BLOCK_V: tl.constexpr,
        C: tl.constexpr,
        HAS_H0: tl.constexpr,
        SLOTS: tl.constexpr,
        P_S: tl.constexpr,
        VARLEN: tl.constexpr,
    ):
        bh = tl.program_id(0)
        vb = tl.program_id(1)
        b = bh // HV
        hv = bh % HV
        h = hv // GROUPS
        if VARLEN:  # b is a piece of the one sequence of rows: its chunks, from its slot's state
            first_chunk = tl.load(starts_ptr + b)
            end_chunk = tl.load(starts_ptr + b + 1)
            src = hv  # (the inputs', scratch's and output's sequence is 0)
            bq = 0
        else:
            first_chunk = 0
            end_chunk = tl.cdiv(T, C)
            src = bh
            bq = b
        r = tl.arange(0, C)
        k1 = tl.arange(0, HK)
        k2 = HK + tl.arange(0, HK)
        vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vm = vv < V
        m1 = (k1 < K)[:, None] & vm[None, :]
        m2 = (k2 < K)[:, None] & vm[None, :]
        t1 = k1[:, None] * V + vv[None, :]
        t2 = k2[:, None] * V + vv[None, :]
        h0_at = bh * K * V
        ht_at = bh * K * V
        if SLOTS:  # the states in a cache: sequence b's at its own offsets
            h0_at = tl.load(h0_at_ptr + b) + hv * K * V
            ht_at = tl.load(ht_at_ptr + b) + hv * K * V
        if HAS_H0:
            S1 = tl.load(h0_ptr + h0_at + t1, mask=m1, other=0.0)
            S2 = tl.load(h0_ptr + h0_at + t2, mask=m2, other=0.0)
        else:
            S1 = tl.zeros((HK, BLOCK_V), tl.float32)
            S2 = tl.zeros((HK, BLOCK_V), tl.float32)
        hs_at = hs_ptr + src.to(tl.int64) * (Tp // C) * K * V
        for ic in range(first_chunk, end_chunk):
            t = ic * C + r
            tm = t < T
            rows = src * Tp + t
            tl.store(hs_at + ic * K * V + t1, S1, mask=m1)
            tl.store(hs_at + ic * K * V + t2, S2, mask=m2)
            u_at = u_ptr + rows[:, None] * V + vv[None, :]
            u = tl.load(u_at, mask=vm[None, :], other=0.0)
            w1 = tl.load(w_ptr + rows[:, None] * K + k1[None, :], mask=(k1 < K)[None, :], other=0.0)
            ws = _dotp(w1, S1, P_S)
            w2 = tl.load(w_ptr + rows[:, None] * K + k2[None, :], mask=(k2 < K)[None, :], other=0.0)
            ws = tl.dot(w2, S2, ws, input_precision=P_S)
            v_new = u - ws
            tl.store(u_at, v_new, mask=vm[None, :])
            gc = tl.load(gc_ptr + rows)
            g_last = tl.sum(tl.where(r == C - 1, gc, 0.0), axis=0)
            to_end = tl.exp(g_last - gc)[:, None]
            k_at = k_ptr + bq * sk_b + t[:, None] * sk_t + h * sk_h
            ka = tl.load(k_at + k1[None, :], mask=tm[:, None] & (k1 < K)[None, :], other=0.0).to(tl.float32)
            S1 = S1 * tl.exp(g_last) + _dotp(tl.trans(ka * to_end), v_new, P_S)
            kb = tl.load(k_at + k2[None, :], mask=tm[:, None] & (k2 < K)[None, :], other=0.0).to(tl.float32)
            S2 = S2 * tl.exp(g_last) + _dotp(tl.trans(kb * to_end), v_new, P_S)
        tl.store(ht_ptr + ht_at + t1, S1, mask=m1)
        tl.store(ht_ptr + ht_at + t2, S2, mask=m2)

    @triton.jit(do_not_specialize=["T"])
    def _chunk_output_kernel(
        q_ptr,
        sq_b,
        sq_t,
        sq_h,  # [B, T, H, K]
        u_ptr,  # v_new, from the states kernel
        a_ptr,
        gc_ptr,  # from the prep kernel
        hs_ptr,  # [B*HV, Tp / C, K, V] float32, from the states kernel
        o_ptr,
        so_b,
        so_t,
        so_h,  # [B, T, HV, V] out
        T,
        Tp,
        scale,
        HV: tl.constexpr,
        GROUPS: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BK: tl.constexpr,
        BLOCK_V: tl.constexpr,
        C: tl.constexpr,
        P_O: tl.constexpr,
    ):
        ic = tl.program_id(0)
        bh = tl.program_id(1)
        vb = tl.program_id(2)
        b = bh // HV
        hv = bh % HV
        h = hv // GROUPS
        r = tl.arange(0, C)
        kk = tl.arange(0, BK)
        vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        km = kk < K
        vm = vv < V
        t = ic * C + r
        tm = t < T
        rows = bh * Tp + t
        q = tl.load(
            q_ptr + b * sq_b + t[:, None] * sq_t + h * sq_h + kk[None, :], mask=tm[:, None] & km[None, :], other=0.0
        )
        gc = tl.load(gc_ptr + rows)
        S = tl.load(
            hs_ptr + (bh.to(tl.int64) * (Tp // C) + ic) * K * V + kk[:, None] * V + vv[None, :],
            mask=km[:, None] & vm[None, :],
            other=0.0,
        )
        v_new = tl.load(u_ptr + rows[:, None] * V + vv[None, :], mask=vm[None, :], other=0.0)
        intra = tl.load(a_ptr + rows[:, None] * C + r[None, :])
        o = _dotp(q.to(tl.float32) * scale * tl.exp(gc)[:, None], S, P_O) + _dotp(intra, v_new, P_O)
        tl.store(
            o_ptr + b * so_b + t[:, None] * so_t + hv * so_h + vv[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=tm[:, None] & vm[None, :],
        )


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["M"])
    def _chunk_inputs_kernel(
        conv_ptr,
        stride_c,  # [M, 2 H K + HV V]: the step rows' conv outputs (q | k | v channels)
        proj_ptr,
        stride_p,  # [M, ...]: the in_proj output, its b | a columns from gate_col
        index_ptr,  # [B * T] long: each padded row's step row, M past a piece
        a_log_ptr,
        dt_bias_ptr,  # [HV]
        q_ptr,
        k_ptr,  # [B * T, H, K] float32
        v_ptr,  # [B * T, HV, V] (conv's dtype)
        g_ptr,
        beta_ptr,  # [B * T, HV] float32
        M,
        gate_col,
        eps,
        H: tl.constexpr,
        HV: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        BHV: tl.constexpr,
    ):
        """Padded row r: its q and k per key head l2-normalised in float32, its v, and its gates
        beta = sigmoid(b) (rounded to the input dtype, as the module computes it) and the log decay
        g = -exp(A_log) * softplus(a + dt_bias); all zero past a piece."""
        r = tl.program_id(0)
        row = tl.load(index_ptr + r)
        dtype = conv_ptr.dtype.element_ty
        kk = tl.arange(0, BK)
        km = (kk < K) & ((tl.zeros_like(kk) + row) < M)  # (block masks: the interpreter refuses a scalar's)
        for h in range(H):  # q's heads (the channels' first H K), then k's
            x = tl.load(conv_ptr + row * stride_c + h * K + kk, mask=km, other=0.0).to(tl.float32)
            tl.store(q_ptr + (r * H + h) * K + kk, x * tl.rsqrt(tl.sum(x * x, axis=0) + eps), mask=kk < K)
            x = tl.load(conv_ptr + row * stride_c + (H + h) * K + kk, mask=km, other=0.0).to(tl.float32)
            tl.store(k_ptr + (r * H + h) * K + kk, x * tl.rsqrt(tl.sum(x * x, axis=0) + eps), mask=kk < K)
        vv = tl.arange(0, BV)
        vm = (vv < V) & ((tl.zeros_like(vv) + row) < M)
        for hv in range(HV):
            x = tl.load(conv_ptr + row * stride_c + 2 * H * K + hv * V + vv, mask=vm, other=0.0)
            tl.store(v_ptr + (r * HV + hv) * V + vv, x, mask=vv < V)
        hh = tl.arange(0, BHV)
        hm = hh < HV
        live = (tl.zeros_like(hh) + row) < M
        b = tl.load(proj_ptr + row * stride_p + gate_col + hh, mask=hm & live, other=0.0).to(tl.float32)
        a = tl.load(proj_ptr + row * stride_p + gate_col + HV + hh, mask=hm & live, other=0.0).to(tl.float32)
        a = a + tl.load(dt_bias_ptr + hh, mask=hm, other=0.0).to(tl.float32)
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        g = -tl.exp(tl.load(a_log_ptr + hh, mask=hm, other=0.0).to(tl.float32)) * softplus
        beta = (1.0 / (1.0 + tl.exp(-b))).to(dtype).to(tl.float32)
        tl.store(g_ptr + r * HV + hh, tl.where(live, g, 0.0), mask=hm)
        tl.store(beta_ptr + r * HV + hh, tl.where(live, beta, 0.0), mask=hm)


if HAVE_TRITON:

    @triton.jit
    def _gated_norm_kernel(
        o_ptr,
        stride_o,  # [*, HV V]: the rule's output rows
        rows_ptr,  # [R] long: row i's row of o
        z_ptr,
        stride_z,  # [R, HV V] the gate
        w_ptr,  # [V]
        out_ptr,
        stride_out,  # [R, HV V]
        eps,
        V: tl.constexpr,
        BV: tl.constexpr,
    ):
        """Row i, value head hv: RMSNormGated as the module rounds it (nextn.layers.norm)."""
        i = tl.program_id(0)
        hv = tl.program_id(1)
        vv = tl.arange(0, BV)
        m = vv < V
        src = tl.load(rows_ptr + i)
        x = tl.load(o_ptr + src * stride_o + hv * V + vv, mask=m, other=0.0)
        dtype = x.dtype
        x = x.to(tl.float32)
        normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / V + eps)).to(dtype).to(tl.float32)
        y = (tl.load(w_ptr + vv, mask=m, other=0.0).to(tl.float32) * normed).to(dtype).to(tl.float32)
        z = tl.load(z_ptr + i * stride_z + hv * V + vv, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + i * stride_out + hv * V + vv, (y * (z / (1.0 + tl.exp(-z)))).to(dtype), mask=m)


def gated_norm_rows(
    o: torch.Tensor,  # [*, HV V] (rows contiguous)
    rows: torch.Tensor,  # [R] long: the rows of o to normalise, in order
    z: torch.Tensor,  # [R, HV V]
    weight: torch.Tensor,  # [V]
    eps: float,
    out: torch.Tensor,  # [R, HV V]
) -> torch.Tensor:
    """out[i] = RMSNormGated(o[rows[i]], z[i]) per value head (the GDN layer's output norm, each op
    rounded as nextn.layers.norm.RMSNormGated rounds it), in one launch."""
    require_triton()
    V = weight.shape[0]
    R, HVV = z.shape
    if R:
        _gated_norm_kernel[(R, HVV // V)](
            o, o.stride(0), rows, z, z.stride(0), weight, out, out.stride(0), eps, V=V, BV=next_pow2(V)
        )
    return out


def chunk_inputs(
    conv: torch.Tensor,  # [M, 2 H K + HV V] the step rows' conv outputs
    proj: torch.Tensor,  # [M, ...] the in_proj output: b | a at gate_col
    gate_col: int,
    index: torch.Tensor,  # [B, T] long: each padded row's step row (M: past a piece)
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    heads: tuple[int, int, int, int],  # H, K, HV, V
    eps: float = 1e-6,
) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta) of `chunk_gated_delta_rule` for step rows laid out as pieces padded to T rows
    (nextn.cache.hybrid.ChunkLayout), in one launch: the module's inputs (nextn.layers.gdn: l2norm of q
    and k, GatedDeltaNet.gates) after its conv, zeros past a piece (rows that change nothing)."""
    require_triton()
    H, K, HV, V = heads
    B, T = index.shape
    dev, n = conv.device, B * T
    q = torch.empty(B, T, H, K, device=dev, dtype=torch.float32)
    k = torch.empty_like(q)
    v = torch.empty(B, T, HV, V, device=dev, dtype=conv.dtype)
    g = torch.empty(B, T, HV, device=dev, dtype=torch.float32)
    beta = torch.empty_like(g)
    if n:
        _chunk_inputs_kernel[(n,)](
            conv, conv.stride(0), proj, proj.stride(0), index, A_log, dt_bias, q, k, v, g, beta,
            conv.shape[0], gate_col, eps,
            H=H, HV=HV, K=K, V=V, BK=next_pow2(K), BV=next_pow2(V), BHV=next_pow2(HV),
        )  # fmt: skip
    return q, k, v, g, beta


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [B, T, H, K] L2-normalised
    k: torch.Tensor,  # [B, T, H, K] L2-normalised
    v: torch.Tensor,  # [B, T, HV, V]
    g: torch.Tensor,  # [B, T, HV] log decay
    beta: torch.Tensor,  # [B, T, HV]
    initial_state: torch.Tensor | None = None,  # [B, HV, K, V] float32
    slot_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    chunk_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] float32). Inference only.
    slot_states = (states, read, write): the initial states read from and the final ones written
    to float32 `states` (a cache's, each [HV, K, V] block contiguous) at element offsets read / write
    [B] long, in place of initial_state and the returned final state (None then).
    chunk_starts (int32 [P + 1] on the device, with slot_states of [P] offsets): B is 1 and its T
    rows are P pieces of whole chunks, piece p's chunks chunk_starts[p] .. chunk_starts[p + 1]
    (each padded with zero rows to its last chunk's end: rows that change nothing), each run from
    its own state as P sequences padded to the longest would be, chunk for chunk the same
    arithmetic (the same bits) with no chunk past a piece's end; the launches' sizes depend on P
    and T only (a CUDA graph keyed by them serves any split)."""
    require_triton()
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if chunk_starts is not None and (B != 1 or T % CHUNK or slot_states is None):
        raise ValueError("chunk_gated_delta_rule: chunk_starts takes one sequence of whole chunks and slot_states")
    pieces = B if chunk_starts is None else chunk_starts.numel() - 1
    if k.shape != q.shape or v.shape[:2] != (B, T) or g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(
            f"chunk_gated_delta_rule: shapes q {tuple(q.shape)} k {tuple(k.shape)} "
            f"v {tuple(v.shape)} g {tuple(g.shape)} beta {tuple(beta.shape)} do not fit"
        )
    if HV % H:
        raise ValueError(f"chunk_gated_delta_rule: {HV} value heads are not a multiple of {H} key heads")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    dev = q.device
    o = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype)
    final = torch.empty(B * HV, K, V, device=dev, dtype=torch.float32) if slot_states is None else None
    if slot_states is not None and (initial_state is not None or T == 0):
        raise ValueError("chunk_gated_delta_rule: slot_states takes no initial_state and at least one row")
    if T == 0:
        if initial_state is None:
            final.zero_()
        else:
            final.copy_(initial_state.reshape(B * HV, K, V))
        return o, final.view(B, HV, K, V)
    C = CHUNK
    n_chunks = triton.cdiv(T, C)
    Tp = n_chunks * C
    u = torch.empty(B * HV, Tp, V, device=dev, dtype=torch.float32)
    w = torch.empty(B * HV, Tp, K, device=dev, dtype=torch.float32)
    intra = torch.empty(B * HV, Tp, C, device=dev, dtype=torch.float32)
    gc = torch.empty(B * HV, Tp, device=dev, dtype=torch.float32)
    in_slots = slot_states is not None
    varlen = chunk_starts is not None
    has_h0 = initial_state is not None or in_slots
    prep_constexprs, states_constexprs, output_constexprs = launch_constexprs(H, HV, K, V, has_h0, in_slots, varlen)
    _chunk_prep_kernel[(n_chunks, B * HV)](
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v,
        v.stride(0),
        v.stride(1),
        v.stride(2),
        g,
        beta,
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        u,
        w,
        intra,
        gc,
        T,
        Tp,
        K**-0.5,
        **prep_constexprs,
        **PREP_OPTIONS,
    )
    if in_slots:
        states, read, write = slot_states
        if states.dtype != torch.float32 or states.stride()[-3:] != (K * V, V, 1) or read.shape != (pieces,):
            raise ValueError(
                f"chunk_gated_delta_rule: slot_states are float32 [..., HV, K, V] blocks and [{pieces}] offsets"
            )
        h0, ht, at = states, states, (read, write)
    else:
        h0 = None if initial_state is None else initial_state.float().reshape(B * HV, K, V).contiguous()
        h0, ht, at = (final if h0 is None else h0), final, (gc, gc)  # (offsets unused)
    hs = torch.empty(B * HV, n_chunks, K, V, device=dev, dtype=torch.float32)  # (each chunk's first state)
    _chunk_states_kernel[(pieces * HV, triton.cdiv(V, states_constexprs["BLOCK_V"]))](
        k,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        u,
        w,
        gc,
        h0,
        hs,
        ht,
        *at,
        chunk_starts if varlen else gc,  # (unused without)
        T,
        Tp,
        **states_constexprs,
        **STATES_OPTIONS,
    )
    _chunk_output_kernel[(n_chunks, B * HV, triton.cdiv(V, output_constexprs["BLOCK_V"]))](
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        u,
        intra,
        gc,
        hs,
        o,
        o.stride(0),
        o.stride(1),
        o.stride(2),
        T,
        Tp,
        K**-0.5,
        **output_constexprs,
        **OUTPUT_OPTIONS,
    )
    return o, None if final is None else final.view(B, HV, K, V)
