"""Batch-invariant skinny matmul for the step path: y = x @ w.T for x [M, K], w [N, K], M small.

The reference is `F.linear`. Decode (1 row) and verify (K+1 rows) must compute each row with the
same arithmetic, or greedy speculative output drifts from plain output in bf16. Here each program
owns BLOCK_N output columns for every row: it streams its weight rows once (so a 1-row GEMV reads
each weight byte exactly once) and multiplies each [BLOCK_N, BLOCK_K] weight tile with all rows
padded to 16 in one tensor-core dot (weights as the 16+-row operand: "swap AB"). Block sizes are
chosen from (N, K) alone and M is never specialised, so the reduction order of a row does not depend
on M. More than 16 rows (a verify's B x (K + 1), a batch's decode, a prompt's tail) run as tiles of
16, each computed exactly as a 16-row call (a weight block's tiles are neighbouring programs,
sharing its L2 reads), or, over bf16 / fp16 weights of a wgmma config, in mid tiles
(linear_configs.mid_tile): the 16-row config with 32-128 rows a program, the splits programs of
their own, so a program streams its weight slice once for all its rows. From WIDE_ROWS rows (a
prefill step's; bf16 / fp16 or Q8_0 weights, FP8's chained dots keep 16-row tiles) a program owns 64
or 128 rows, and a split-K shape's splits are summed in the program, in the split order the 16-row
tiles' last arrival adds them; its tiles of x, as well as the weights', load through tensor
descriptors (TMA, config way 3: linear_configs.WIDE_WAY), and with TMA loads its splits run in one
pipelined k-loop (a split's sum joins the others at its last k-tile), with pointer loads (Q8_0's, an
mma.sync config's) a loop a split, which drains the pipeline at each. Run 210 at 512 rows: one loop
ran the 9B's split-4 shapes 1.19-1.24x as fast with the weights through TMA, its split-2 ones
1.03-1.07x slower, and its split-2 ones 1.17-1.18x slower with pointer loads alone (split-4 ones
0.96-0.99x); with both operands through TMA it ran every shape faster than any way before. Either
way the dot is wide enough for the tensor cores, and each row's products are summed in the same k
order by the same MMA, so its bits do not change (checked on the GPU per shape and row count:
bench/wide_tile_probe.py, bf16; a prompt row must be what a decode row of it would be). The same
MMA: a 16-row config of 64 weight rows or more is a wgmma, as the wide tile's 64-128 are; a narrower
one an mma.sync, which sums otherwise, so its wide tiles keep its BLOCK_N and warps (an mma.sync
again): linear_configs.wide_tile. A residual GEMM that writes the next norm's input keeps its
BLOCK_N there, since the norm's sums of squares are partials per BLOCK_N columns, and every such sum
is added in index order (triton_norm.ordered_sum), not in a tree that follows the tile's layout.

Fused after the dot, so a decoder layer needs fewer launches:
- epilogue `residual`: y = residual + x @ w.T (each rounded to x's dtype first, like `x + f(x)`);
- epilogue `silu_mul`: y = silu(x @ w.T) * (x @ w2.T) (the SwiGLU of an MLP, gate and up weights).
Roundings follow the PyTorch modules they replace, op by op, except around a norm. The zero-centred
RMSNorm before a projection is no launch of its own: the residual GEMM before it also stores its
output times (1 + w) and the output's sums of squares per N block (`norm_out`; a wide tile of twice
the 16-row tiles' BLOCK_N stores one per half, `norm_block`, so the grouping stays), and the projection
reads those (`rms`, a nextn.ops.triton_norm.NormInput), adds a row's sums in a fixed order and
scales its products by rstd after the loop (FP8 chained dots: x's tiles with the block scale).
x = y * (1 + w) is rounded to the model dtype where the module rounds y * rstd * (1 + w), so the
step is the norm then the GEMM up to that rounding (not bitwise); a row's arithmetic still depends
on that row alone. (Normalising x inside the k-loop made every tile's dot wait: bench/NOTES.md, run 69.)

FP8 weights (nextn.ops.fp8.QuantWeight: e4m3 with float32 scales, per row or per 128 rows, per 128
columns; k-tiles of at most 128 columns, so one scale per row covers a tile), two ways:
- one scale per 128x128 block (the block layouts after `compact_scales`) and BLOCK_N dividing 128
  (what decode runs): a program's rows share each k-tile's scale, so x's tile is scaled instead
  (float32, times 2^exponent so the largest scale is in [1, 2), then rounded to fp16) and every
  tile's fp16 dot (e4m3 widens to fp16 exactly, one packed convert per two values) accumulates into
  the last, no product scaled on its own (the compiled dot still waits each tile: its weight operand
  comes from registers; bench/NOTES.md, runs 64-68). A row whose scaled values pass fp16's range (|x| above
  ~32k on the largest-scale block) comes out inf / NaN; such rows are computed again the second way.
  A config's sixth field 2 (`XMAJOR`) turns these dots around, x's 16 rows times w's tile transposed:
  with the rows as the dot's M, Triton compiles sm80's warp MMA (mma.sync), whose e4m3 operand goes
  from shared memory straight into registers, widened there while the next tiles' copies are in
  flight, where the weights-as-M dot is a wgmma that waits each tile (bench/fp8_dot_variants.py, run
  126: 1.1-1.2x at the 9B's large shapes). The arithmetic is the chain's, products summed in the
  MMA's order; a config computes every row the same way, so rows stay invariant.
- otherwise (per-channel scales, fused rows not aligned to 128): the tile widened to x's dtype
  (exact: every e4m3 value is a bf16 / fp16 value), a dot of its own, the product scaled by the
  tile's row scales, then added.
The scales depend on the weight alone and the second pass on the row alone, so rows stay invariant.

Q8_0 weights (nextn.ops.q8_0: int8 with a float16 scale per row and 32 columns, GGUF's 34 bytes per
32 weights; a QuantWeight whose values are int8, GROUP 32) take the second way's kernel, one of two
ways by the config's BLOCK_K: a k-tile over several 32-column groups (the default, BLOCK_K 128 or
256) is dequantized in the k-loop, each int8 times its scale in float32 (exact) then rounded to x's
dtype, what nextn.ops.fp8.dequantize gives, value for value, and one dot takes it; a tile within one
group (BLOCK_K 32 or 16) is widened to x's dtype exactly, dotted, and its product scaled. Either
way a row's arithmetic depends on the weight and that row alone. The dequantized tile's k-loop is
issue-bound on sm90 (in the SASS of a 64x128 tile, 491 instructions a thread an iteration, ~7.7 a
weight); a dot per scale group, its sums scaled, was tried and lost (never the tuner's pick: run
165). There is no chain (the scales differ row by row) and no tensor descriptor (TMA loads bf16
weights only).

On Hopper a call is a programmatic dependent launch (`pdl`, the default): its programs may start
while the kernel ahead of it still runs (the step's GDN, attention and MoE kernels release theirs at
once), wait for that kernel to complete (`gdc_wait`) before they read or write anything, and release
the launch after them once their k-loop has streamed the weights. The arithmetic is the plain
launch's (run 98, bench/pdl_sweep.py: 21.1 against 22.2 us a GDN layer's two GEMMs; releasing at the
start or prefetching weight tiles into L2 before the wait were slower).
"""

from __future__ import annotations

import torch

from nextn.ops.fp8 import Q8_0, QuantWeight
from nextn.ops.linear_configs import (
    TILE_ROWS,
    WAY_TMA,
    WAY_TMA_X,
    WAY_XMAJOR,
    WIDE_ROWS,
    mid_tile,
    pick_config,
    takes_block_k,
    takes_way,
    triton_cdiv,
    wide_tile,
)
from nextn.ops.triton_norm import NormInput, ordered_sum, rms_rstd
from nextn.ops.triton_utils import HAVE_TRITON, arrival_counters, interpreting, next_pow2, pdl_supported

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _epilogue(acc, acc2, r, x_dtype: tl.constexpr, EPILOGUE: tl.constexpr):
        """acc (, acc2, residual r) [BLOCK_N, BLOCK_M] float32 -> the output values, rounded like the modules."""
        if EPILOGUE == 1:
            out = acc.to(x_dtype).to(tl.float32) + r.to(tl.float32)
        elif EPILOGUE == 2:
            g = acc.to(x_dtype).to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(x_dtype).to(tl.float32)
            out = silu * acc2.to(x_dtype).to(tl.float32)
        else:
            out = acc
        return out

    @triton.jit
    def _fp8_tile(w, x, s_ptrs, mask_n, x_dtype: tl.constexpr, DOT_F32: tl.constexpr):
        """A quantized weight tile w [BLOCK_N, BLOCK_K] (e4m3 or int8: either widens to x's dtype
        exactly) times the rows x [BLOCK_M, BLOCK_K], scaled by the tile's per-row scales (at s_ptrs
        [BLOCK_N], repeated where rows share one): [BLOCK_N, BLOCK_M] float32."""
        scale = tl.load(s_ptrs, mask=mask_n, other=0.0).to(tl.float32)
        if DOT_F32:
            part = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(w.to(x_dtype), tl.trans(x))
        return part * scale[:, None]

    @triton.jit
    def _dequantized_tile(w, s_ptr, stride_s, k0, K, offs_n, mask_n, x_dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
        """A tile w [BLOCK_N, BLOCK_K] of GROUP-column scale groups (Q8_0: 32 int8 per fp16 scale)
        dequantized: each value times its scale in float32 (exact for Q8_0), rounded to x's dtype,
        what nextn.ops.fp8.dequantize gives."""
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s_mask = mask_n[:, None] & (offs_g[None, :] * GROUP < K)
        scale = tl.load(s_ptr + offs_g[None, :] * stride_s + offs_n[:, None], mask=s_mask, other=0.0)
        w = scaled(tl.reshape(w, (BLOCK_N, BLOCK_K // GROUP, GROUP)), scale.to(tl.float32)[:, :, None])
        return tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x_dtype)

    @triton.jit
    def scaled(w, scale):
        """A quantized tile's values (e4m3 or int8) times their scales (float32, broadcastable), exactly:
        every kernel's dequantization (the skinny GEMM's, the MoE decode block's, the grouped GEMMs').
        int8 by integer ops and one FFMA a value: the bits of 1.5 * 2^23 plus v are the float 1.5 * 2^23
        + v (its ulp is 1), and fma(1.5 * 2^23 + v, s, -1.5 * 2^23 * s) rounds once the exact v * s,
        which float32 holds (8 by 11 significant bits), as it holds -1.5 * 2^23 * s (2 by 11 bits: one
        FMUL a scale value, a group's where it is broadcast). No I2F: sm90 converts int to float at 16 a
        clock an SM, a quarter of its integer adds (the I2F bounded the Q8_0 GEMV, run 162), and an
        FADD and an FMUL a value were the rest (8164f1f: the same bits, 1,664 -> 1,544 instructions)."""
        if w.dtype == tl.int8:
            biased = (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True)
            return tl.fma(biased, scale, scale * -12582912.0)
        return w.to(tl.float32) * scale

    @triton.jit
    def _k_loop(x_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr, offs_m, offs_n, n_block, mask_m, mask_n,
                k_start, K_SPLIT, K, stride_x, stride_s, stride_s2, shift, shift2, rstd, m_start,
                EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
                SCALE_ROWS: tl.constexpr, SCALE_ROWS2: tl.constexpr, TMA: tl.constexpr,
                CHAIN: tl.constexpr, GROUP: tl.constexpr, SERIAL: tl.constexpr = 1,
                TMA_X: tl.constexpr = False):  # fmt: skip
        """A program's reduction over its K columns: (x @ w.T, x @ w2.T) as [BLOCK_N, BLOCK_M] float32
        (CHAIN: times its shifts and the rows' rstd [BLOCK_M, 1], which scale x's tiles). SERIAL > 1:
        SERIAL splits of K_SPLIT columns from k_start in one pipelined loop, each split's products
        summed from zero and added to the splits before it at its last k-tile, in split order (the
        16-row tiles' split-K sums; a loop a split drained and refilled the pipeline at every split)."""
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        # the splits' sum starts at -0.0, which adds to any value as that value (-0.0 + +0.0 = +0.0,
        # -0.0 + -0.0 = -0.0): the first split's sum is taken as it is, as the split-K path takes it
        total = tl.full((BLOCK_N, BLOCK_M), -0.0, tl.float32)
        total2 = tl.full((BLOCK_N, BLOCK_M), -0.0, tl.float32)
        s_col = (n_block * BLOCK_N) // SCALE_ROWS  # CHAIN: the program's rows share one scale per block
        tl.static_assert(SERIAL == 1 or not CHAIN, "a chain's splits are rescaled one by one")
        for k0 in range(k_start, k_start + SERIAL * K_SPLIT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x_mask = mask_m[:, None]
                w_mask = mask_n[:, None]
            else:
                x_mask = mask_m[:, None] & (offs_k[None, :] < K)
                w_mask = mask_n[:, None] & (offs_k[None, :] < K)
            if TMA_X:  # (rows past M read as 0, as the masked load's)
                x = x_ptr.load([m_start, k0])
            else:
                x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=x_mask, other=0.0)
            if TMA:  # out-of-bounds columns and rows read as 0, as the masked load's
                w = w_ptr.load([n_block * BLOCK_N, k0])
            else:
                w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)
            acc = _tile_dot(w, x, acc, s_ptr, stride_s, k0, K, s_col, shift, rstd, offs_n, mask_n, SCALE_ROWS, FP8,
                            CHAIN, DOT_F32, BLOCK_N, BLOCK_K, GROUP)  # fmt: skip
            if EPILOGUE == 2:
                if TMA:
                    w2 = w2_ptr.load([n_block * BLOCK_N, k0])
                else:
                    w2 = tl.load(w2_ptr + offs_n[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)
                acc2 = _tile_dot(w2, x, acc2, s2_ptr, stride_s2, k0, K, s_col, shift2, rstd, offs_n, mask_n,
                                 SCALE_ROWS2, FP8, CHAIN, DOT_F32, BLOCK_N, BLOCK_K, GROUP)  # fmt: skip
            if SERIAL > 1:
                if (k0 + BLOCK_K - k_start) % K_SPLIT == 0:  # a split's last k-tile
                    total += acc
                    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                    if EPILOGUE == 2:
                        total2 += acc2
                        acc2 = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        if SERIAL > 1:
            return total, total2
        return acc, acc2

    @triton.jit
    def _k_loop_xmajor(x_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr, offs_m, offs_n, n_block, mask_m, mask_n, k_start,
                       K_SPLIT, K, stride_x, stride_s, stride_s2, shift, shift2, rstd, EPILOGUE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       DOT_F32: tl.constexpr, SCALE_ROWS: tl.constexpr):  # fmt: skip
        """_k_loop's chained dots with x's rows as the dot's M (module docstring): the same
        [BLOCK_N, BLOCK_M] float32 results."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        s_col = (n_block * BLOCK_N) // SCALE_ROWS
        for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x_mask = mask_m[:, None]
                w_mask = mask_n[None, :]
            else:
                x_mask = mask_m[:, None] & (offs_k[None, :] < K)
                w_mask = mask_n[None, :] & (offs_k[:, None] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=x_mask, other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            s = tl.load(s_ptr + (k0 // 128) * stride_s + s_col)
            acc = _chain_dot_xmajor(w, x, s * shift * rstd, acc, DOT_F32)
            if EPILOGUE == 2:
                w2 = tl.load(w2_ptr + offs_n[None, :] * K + offs_k[:, None], mask=w_mask, other=0.0)
                s2 = tl.load(s2_ptr + (k0 // 128) * stride_s2 + s_col)
                acc2 = _chain_dot_xmajor(w2, x, s2 * shift2 * rstd, acc2, DOT_F32)
        return tl.trans(acc), tl.trans(acc2)

    @triton.jit
    def _chain_dot_xmajor(wt, x, scale, acc, DOT_F32: tl.constexpr):
        """acc + (x * scale) @ wt for an e4m3 tile wt [BLOCK_K, BLOCK_N] (w's tile transposed): the
        chain's fp16 operands, acc [BLOCK_M, BLOCK_N]."""
        xs = x.to(tl.float32) * scale
        if DOT_F32:
            if x.dtype != tl.float32:  # the interpreter: fp16 operands as the GPU's, products in float32
                xs = xs.to(tl.float16).to(tl.float32)
            return tl.dot(xs, wt.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(xs.to(tl.float16), wt.to(tl.float16), acc)

    @triton.jit
    def _tile_dot(w, x, acc, s_ptr, stride_s, k0, K, s_col, shift, rstd, offs_n, mask_n, SCALE_ROWS: tl.constexpr,
                  FP8: tl.constexpr, CHAIN: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
        """acc + w @ x.T for a weight tile w [BLOCK_N, BLOCK_K] at columns k0.. and rows x [BLOCK_M, BLOCK_K]."""
        if CHAIN:  # the block's one scale times x's tile: the dots chain into one accumulator
            out = _chain_dot(w, x, tl.load(s_ptr + (k0 // 128) * stride_s + s_col) * shift * rstd, acc, DOT_F32)
        elif FP8 and BLOCK_K > GROUP:  # Q8_0 tiles over several scale groups: dequantized, then one dot
            wd = _dequantized_tile(w, s_ptr, stride_s, k0, K, offs_n, mask_n, x.dtype, BLOCK_N, BLOCK_K, GROUP)
            if DOT_F32:
                out = tl.dot(wd.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                out = tl.dot(wd, tl.trans(x), acc)
        elif FP8:  # the scales of this tile's GROUP-column block (nextn.ops.fp8.Format.block)
            s_ptrs = s_ptr + (k0 // GROUP) * stride_s + offs_n // SCALE_ROWS
            out = acc + _fp8_tile(w, x, s_ptrs, mask_n, x.dtype, DOT_F32)
        elif DOT_F32:
            out = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            out = tl.dot(w, tl.trans(x), acc)
        return out

    @triton.jit
    def _chain_dot(w, x, scale, acc, DOT_F32: tl.constexpr):
        """acc + w @ (x * scale).T for an e4m3 tile w [BLOCK_N, BLOCK_K], rows x [BLOCK_M, BLOCK_K] and
        scale [BLOCK_M, 1]: both in fp16 (e4m3 widens to it exactly, one packed convert per two values)."""
        xs = x.to(tl.float32) * scale
        if DOT_F32:
            if x.dtype != tl.float32:  # the interpreter: fp16 operands as the GPU's, products in float32
                xs = xs.to(tl.float16).to(tl.float32)
            return tl.dot(w.to(tl.float32), tl.trans(xs), acc, input_precision="ieee")
        return tl.dot(w.to(tl.float16), tl.trans(xs.to(tl.float16)), acc)

    @triton.jit
    def _nonfinite_rows(acc):
        """[BLOCK_N, BLOCK_M] -> [BLOCK_M] int32: 1 where a column (a row of x) holds an inf or a NaN."""
        return tl.max(((acc != acc) | (tl.abs(acc) == float("inf"))).to(tl.int32), axis=0)

    @triton.jit
    def _reduce(x_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr, offs_m, offs_n, n_block, mask_m, mask_n, k_start, K_SPLIT, K,
                stride_x, stride_s, stride_s2, shift, shift2, rstd, EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                FP8: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_ROWS2: tl.constexpr, TMA: tl.constexpr,
                CHAIN: tl.constexpr, XMAJOR: tl.constexpr, GROUP: tl.constexpr, SERIAL: tl.constexpr,
                m_start, TMA_X: tl.constexpr):  # fmt: skip
        """One split's sums over columns [k_start, k_start + K_SPLIT) (SERIAL > 1: the sum of SERIAL splits
        from k_start, in split order): [BLOCK_N, BLOCK_M] float32 (x @ w.T, x @ w2.T), times the rows'
        rstd [BLOCK_M] where the chain scaled x's tiles by it."""
        if XMAJOR:
            acc, acc2 = _k_loop_xmajor(x_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr, offs_m, offs_n, n_block, mask_m, mask_n,
                                       k_start, K_SPLIT, K, stride_x, stride_s, stride_s2, shift, shift2,
                                       rstd[:, None], EPILOGUE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32,
                                       SCALE_ROWS)  # fmt: skip
        else:
            acc, acc2 = _k_loop(x_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr, offs_m, offs_n, n_block, mask_m, mask_n,
                                k_start, K_SPLIT, K, stride_x, stride_s, stride_s2, shift, shift2, rstd[:, None],
                                m_start, EPILOGUE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32, FP8, SCALE_ROWS,
                                SCALE_ROWS2, TMA, CHAIN, GROUP, SERIAL, TMA_X)  # fmt: skip
        if CHAIN:
            acc = acc * (1.0 / shift)  # (powers of two: exact)
            acc2 = acc2 * (1.0 / shift2)
            # x * scale past fp16's range (65504 after the shift) gives inf: such rows (a row's own
            # values decide, so rows stay invariant) are computed again tile by tile, scaled products
            bad = _nonfinite_rows(acc)
            if EPILOGUE == 2:
                bad = tl.maximum(bad, _nonfinite_rows(acc2))
            if tl.max(bad, axis=0) > 0:
                again, again2 = _k_loop(x_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr, offs_m, offs_n, n_block, mask_m,
                                        mask_n, k_start, K_SPLIT, K, stride_x, stride_s, stride_s2, shift, shift2,
                                        rstd[:, None], 0, EPILOGUE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32, FP8,
                                        SCALE_ROWS, SCALE_ROWS2, TMA, False, GROUP)  # fmt: skip
                acc = tl.where(bad[None, :] > 0, again * rstd[None, :], acc)
                acc2 = tl.where(bad[None, :] > 0, again2 * rstd[None, :], acc2)
        return acc, acc2

    @triton.jit(do_not_specialize=["M"])
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        w2_ptr,
        s_ptr,
        s2_ptr,
        y_ptr,
        res_ptr,
        part_ptr,
        count_ptr,
        flag_ptr,
        ss_in_ptr,  # RMS: [P, M] float32, the partial sums of squares of x's rows before its norm
        nw_ptr,  # NORM_OUT: [N] the next norm's weight (zero-centred)
        xn_ptr,  # NORM_OUT: [M, N] y * (1 + nw), in y's dtype
        ss_out_ptr,  # NORM_OUT: [cdiv(N, BLOCK_N) * NORM_PARTS, M] float32, y's sums of squares per N block part
        M,
        N,
        K,
        K_SPLIT,
        stride_x,
        stride_y,
        stride_res,
        stride_s,
        stride_s2,
        shift,  # CHAIN: 2^exponent of w's scales (QuantWeight.exponent)
        shift2,
        P,  # RMS: partial sums per row
        eps,  # RMS
        EPILOGUE: tl.constexpr,  # 0 none, 1 residual add, 2 silu(x w^T) * (x w2^T)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_F32: tl.constexpr,
        SPLIT: tl.constexpr,  # programs a row tile's K is split over (float32 partials summed by the last)
        SERIAL: tl.constexpr,  # splits one program sums itself, in split order (a wide tile's; SPLIT is then 1)
        FP8: tl.constexpr,  # w (and w2) quantized: scales [K / GROUP, N / SCALE_ROWS] (row stride stride_s)
        GROUP: tl.constexpr,  # FP8: columns per scale (128: e4m3, float32 scales; 32: Q8_0's int8, fp16 scales)
        SCALE_ROWS: tl.constexpr,  # weight rows per scale: 1 or 128
        SCALE_ROWS2: tl.constexpr,
        HAS_FLAG: tl.constexpr,  # flag_ptr: run_if (nextn.engine.runner.ModelRunner.when), 0 skips the call
        TMA: tl.constexpr,  # w_ptr (and w2_ptr) are [BLOCK_N, BLOCK_K] tensor descriptors (bf16 weights)
        TMA_X: tl.constexpr,  # x_ptr is a [BLOCK_M, BLOCK_K] tensor descriptor (config way 3)
        CHAIN: tl.constexpr,  # FP8 whose BLOCK_N rows share each scale (SCALE_ROWS % BLOCK_N == 0)
        XMAJOR: tl.constexpr,  # CHAIN with x's rows as the dot's M (config way 2)
        RMS: tl.constexpr,  # x is a norm's input times its weight: scale each row's products by its rstd
        P_BLOCK: tl.constexpr,  # RMS: next_pow2(P), at least 16 (ordered_sum's dot)
        NORM_OUT: tl.constexpr,  # EPILOGUE 1: also store the next norm's input (xn_ptr, ss_out_ptr)
        NORM_PARTS: tl.constexpr,  # NORM_OUT: sums of squares a program stores, over BLOCK_N / NORM_PARTS columns each
        PDL: tl.constexpr,  # wait for the kernel ahead, release the next launch after the k-loop
    ):
        """Program (n * M_TILES + m, s) reduces K columns [s*K_SPLIT, (s+1)*K_SPLIT) of BLOCK_N outputs
        for rows [m*BLOCK_M, (m+1)*BLOCK_M) (SERIAL > 1: all SERIAL splits of them). SPLIT > 1: float32
        partials [SPLIT, M, N] in part_ptr, arrivals per (N block, row tile) in count_ptr."""
        pid = tl.program_id(0)
        m_tiles = tl.cdiv(M, BLOCK_M)
        k_start = tl.program_id(1) * K_SPLIT
        n_block = pid // m_tiles
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        if PDL:  # nothing is touched before the kernel ahead has completed
            tl.extra.cuda.gdc_wait()
        if HAS_FLAG:  # before any store or arrival: a skipped call leaves the counters zero
            if tl.load(flag_ptr).to(tl.int32) == 0:
                return
        offs_m = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_dtype = x_ptr.dtype if TMA_X else x_ptr.dtype.element_ty
        rstd = tl.full((BLOCK_M,), 1.0, tl.float32)
        if RMS:  # the norm's rstd from its partial sums, added in a fixed order (loaded before the loop)
            offs_p = tl.arange(0, P_BLOCK)
            ss = tl.load(ss_in_ptr + offs_p[:, None] * M + offs_m[None, :],
                         mask=(offs_p[:, None] < P) & mask_m[None, :], other=0.0)  # fmt: skip
            rstd = rms_rstd(ordered_sum(ss), K, eps)
        m_start = (pid % m_tiles) * BLOCK_M
        LOOP_SPLITS: tl.constexpr = SERIAL if TMA else 1  # splits a k-loop sums (TMA: all; pointer loads: a loop each)
        acc, acc2 = _reduce(x_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr, offs_m, offs_n, n_block, mask_m, mask_n, k_start,
                            K_SPLIT, K, stride_x, stride_s, stride_s2, shift, shift2, rstd, EPILOGUE, BLOCK_M, BLOCK_N,
                            BLOCK_K, EVEN_K, DOT_F32, FP8, SCALE_ROWS, SCALE_ROWS2, TMA, CHAIN, XMAJOR,
                            GROUP, LOOP_SPLITS, m_start, TMA_X)  # fmt: skip
        for s in range(1, SERIAL // LOOP_SPLITS):  # the next splits' sums added in split order, as split-K adds them
            more, more2 = _reduce(x_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr, offs_m, offs_n, n_block, mask_m, mask_n,
                                  s * K_SPLIT, K_SPLIT, K, stride_x, stride_s, stride_s2, shift, shift2, rstd,
                                  EPILOGUE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32, FP8, SCALE_ROWS, SCALE_ROWS2,
                                  TMA, CHAIN, XMAJOR, GROUP, 1, m_start, TMA_X)  # fmt: skip
            acc += more
            if EPILOGUE == 2:
                acc2 += more2
        if PDL:  # the next launch may start once every program has streamed its weights
            tl.extra.cuda.gdc_launch_dependents()
        out_mask = mask_n[:, None] & mask_m[None, :]
        store_mask = out_mask
        last = mask_m  # the rows this program stores (split-K: only the last split to arrive)
        if SPLIT > 1:
            # Each split stores its float32 partial; the split that arrives last at the N block's
            # counter sums all of them in split order (a fixed order, so rows stay invariant),
            # resets the counter for the next launch and runs the epilogue: no second launch.
            at = offs_m[None, :] * N + offs_n[:, None]
            part = part_ptr + tl.program_id(1) * M * N + at
            tl.store(part, acc, mask=out_mask)
            if EPILOGUE == 2:
                tl.store(part + SPLIT * M * N, acc2, mask=out_mask)
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
            store_mask = out_mask & ((tl.zeros((BLOCK_N, BLOCK_M), tl.int32) + arrived) == SPLIT - 1)
            acc = tl.load(part_ptr + at, mask=store_mask, other=0.0, cache_modifier=".cg")
            if EPILOGUE == 2:
                acc2 = tl.load(part_ptr + SPLIT * M * N + at, mask=store_mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                acc += tl.load(part_ptr + s * M * N + at, mask=store_mask, other=0.0, cache_modifier=".cg")
                if EPILOGUE == 2:
                    acc2 += tl.load(
                        part_ptr + (SPLIT + s) * M * N + at, mask=store_mask, other=0.0, cache_modifier=".cg"
                    )
            tl.store(count_ptr + pid, 0, mask=arrived == SPLIT - 1)
            last = mask_m & ((tl.zeros((BLOCK_M,), tl.int32) + arrived) == SPLIT - 1)
        if RMS and not CHAIN:  # (the chain scaled x's tiles by it)
            acc = acc * rstd[None, :]
            if EPILOGUE == 2:
                acc2 = acc2 * rstd[None, :]
        r = acc
        if EPILOGUE == 1:
            r = tl.load(res_ptr + offs_m[None, :] * stride_res + offs_n[:, None], mask=store_mask, other=0.0)
        out = _epilogue(acc, acc2, r, x_dtype, EPILOGUE)
        y = out.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs_m[None, :] * stride_y + offs_n[:, None], y, mask=store_mask)
        if NORM_OUT:  # the next norm's input: y * (1 + w) and y's sums of squares over this N block
            nw = tl.load(nw_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            yf = tl.where(store_mask, y.to(tl.float32), 0.0)
            xn = yf * (1.0 + nw[:, None])
            tl.store(xn_ptr + offs_m[None, :] * N + offs_n[:, None], xn.to(xn_ptr.dtype.element_ty), mask=store_mask)
            if NORM_PARTS == 1:
                tl.store(ss_out_ptr + n_block * M + offs_m, ordered_sum(yf * yf), mask=last)
            else:  # 2: a sum over each half of the block, as two programs of BLOCK_N / 2 columns store them
                halves = tl.permute(tl.reshape(yf * yf, (2, BLOCK_N // 2, BLOCK_M)), (1, 2, 0))
                lo, hi = tl.split(halves)
                tl.store(ss_out_ptr + 2 * n_block * M + offs_m, ordered_sum(lo), mask=last)
                tl.store(ss_out_ptr + (2 * n_block + 1) * M + offs_m, ordered_sum(hi), mask=last)


def skinny_linear(
    x: torch.Tensor | None,  # [M, K], last dim contiguous (None with rms)
    weight: torch.Tensor | QuantWeight,  # [N, K] contiguous
    *,
    out: torch.Tensor | None = None,  # [M, N]
    out_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,  # [M, N]: epilogue residual + y
    up_weight: torch.Tensor | QuantWeight | None = None,  # [N, K]: epilogue silu(y) * (x @ up_weight.T)
    config: tuple[int, ...] | None = None,  # override (tuning)
    run_if: torch.Tensor | None = None,  # [] device flag: 0 skips the call (out is left as it was)
    rms: NormInput | None = None,  # in place of x: y = rms_norm(x) @ w.T (x before the norm)
    eps: float = 0.0,  # rms: the norm's
    norm_out: torch.Tensor | None = None,  # [N] with residual: also return the next norm's NormInput
    pdl: bool = True,  # a programmatic dependent launch where the GPU has them (the same bits)
    block_m: int | None = None,  # rows a program owns (with config; default: wide_tile's choice for M rows)
    norm_block: int | None = None,  # norm_out: columns a sum of squares covers (default: the config's BLOCK_N)
) -> torch.Tensor | tuple[torch.Tensor, NormInput]:
    """y = x @ weight.T [M, N] with the epilogues above; rms: of the norm whose input (times its
    weight, with its rows' sums of squares) it is, scaling each row's products by its rstd;
    norm_out (the zero-centred weight of the norm after a residual GEMM): returns (y, its NormInput)
    as well, from this launch's output, its sums of squares one per norm_block columns (BLOCK_N or
    half of it: a wide tile keeps the 16-row tiles' grouping at twice their BLOCK_N)."""
    if (x is None) == (rms is None):
        raise ValueError("skinny_linear takes x or rms (a norm's input), not both")
    if rms is not None:
        x = rms.x
    fp8 = isinstance(weight, QuantWeight)  # block-quantized: FP8 or Q8_0 (nextn.ops.fp8.Format)
    fmt = weight.format if fp8 else None
    if up_weight is not None and (up_weight.format if isinstance(up_weight, QuantWeight) else None) != fmt:
        raise ValueError("skinny_linear: weight and up_weight must both be FP8 (or Q8_0) or neither")
    scale = scale2 = None
    rows = rows2 = 1
    exponent = exponent2 = 0
    if fp8:
        weight, scale, rows, exponent = weight
        if up_weight is not None:
            up_weight, scale2, rows2, exponent2 = up_weight
    M, K = x.shape
    N = weight.shape[0]
    if M < 1:
        raise ValueError("skinny_linear takes at least one row")
    if weight.shape[1] != K or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} / weight {tuple(weight.shape)} layout")
    for s, r in ((scale, rows), (scale2, rows2)):
        if s is not None and (
            s.shape != (-(-K // fmt.block), -(-N // r)) or (s.stride(1) != 1 and s.shape[1] > 1) or s.dtype != fmt.scale
        ):
            raise ValueError(
                f"skinny_linear: {fmt.name} scales {s.dtype} {tuple(s.shape)} ({r} rows each) for weight {(N, K)}"
            )
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=out_dtype or x.dtype)
    epilogue = 1 if residual is not None else (2 if up_weight is not None else 0)
    if norm_out is not None and (epilogue != 1 or norm_out.shape != (N,)):
        raise ValueError("skinny_linear: norm_out takes a residual GEMM and the norm's [N] weight")
    if rms is not None and (rms.ss.dim() != 2 or rms.ss.shape[1] != M or not rms.ss.is_contiguous()):
        raise ValueError(f"skinny_linear: rms sums {tuple(rms.ss.shape)} for {M} rows")
    quant = fmt.name if fp8 else ""
    chosen = config is None
    if block_m is None:
        block_m = TILE_ROWS
        if config is None and (not fp8 or fmt == Q8_0) and M >= WIDE_ROWS:  # (FP8's chained dots: 16-row tiles)
            block_m, config = wide_tile(
                N, K, up_weight is not None, x.element_size(), norm_out is not None, quant, weight.element_size()
            )
            norm_block = pick_config(N, K, quant)[0]  # the 16-row tiles' BLOCK_N: their sums' grouping
        elif config is None and M > TILE_ROWS:  # (the 16-row config's BLOCK_N; quantized weights: 16-row tiles)
            block_m, config = mid_tile(N, K, M, up_weight is not None, x.element_size(), quant)
    block_n, block_k, warps, stages, split, *way = config or pick_config(N, K, quant)
    way = way[0] if way else 0
    if not takes_way(way, fmt):
        raise ValueError(
            f"skinny_linear: config way {way}: 1 and 3 (TMA loads) take bf16 / fp16 weights, 2 (x-major) FP8"
        )
    if way == WAY_TMA_X and chosen and not _tma_rows(x):  # (the same bits either way)
        way = WAY_TMA  # x's rows do not start on 16-byte boundaries (a view): its tiles by pointer loads
    tma, tma_x = way in (WAY_TMA, WAY_TMA_X), way == WAY_TMA_X
    chain = fp8 and rows % block_n == 0 and (up_weight is None or rows2 % block_n == 0)
    if split > 1 and K % (split * block_k):
        raise ValueError(f"split {split} does not fit K={K}, BLOCK_K={block_k}")
    if fp8 and not takes_block_k(fmt, block_k):
        raise ValueError(f"{fmt.name} weights take BLOCK_K dividing {fmt.block}" + (
            " or a multiple of it" if fmt == Q8_0 else "") + f", got {block_k}")  # fmt: skip
    norm_parts = block_n // (norm_block or block_n)
    if norm_out is not None and (norm_parts not in (1, 2) or norm_parts * (norm_block or block_n) != block_n or (
            norm_parts == 2 and N % block_n)):  # fmt: skip
        raise ValueError(
            f"skinny_linear: norm_block {norm_block} is not BLOCK_N {block_n} or its half (N % BLOCK_N = 0)"
        )
    if block_m % TILE_ROWS or not TILE_ROWS <= block_m <= 256:
        raise ValueError(f"skinny_linear: block_m {block_m} is not a multiple of {TILE_ROWS} up to 256")
    # a wide tile's program sums its splits itself; a tile of more rows than 16 in a call of fewer than WIDE_ROWS
    # (a mid tile) leaves them to programs of their own, as the 16-row tiles (the same order of adds either way)
    serial = split if block_m > TILE_ROWS and M >= WIDE_ROWS else 1
    split = split // serial
    dummy = weight
    part = count = dummy
    if split > 1:
        part = torch.empty((2 if epilogue == 2 else 1) * split * M * N, device=x.device, dtype=torch.float32)
        count = arrival_counters(x.device, triton_cdiv(N, block_n) * triton_cdiv(M, TILE_ROWS))
    xn = ss_out = dummy
    if norm_out is not None:
        xn = torch.empty(M, N, device=x.device, dtype=out.dtype)
        ss_out = torch.empty(triton_cdiv(N, block_n) * norm_parts, M, device=x.device, dtype=torch.float32)
    w, w2 = weight, up_weight if up_weight is not None else dummy
    pdl = pdl and pdl_supported(x)
    if tma:
        w = _descriptor(weight, block_n, block_k)
        w2 = _descriptor(up_weight, block_n, block_k) if up_weight is not None else dummy
    xd = x
    if tma_x:
        if split > 1 or fp8 or not _tma_rows(x):
            raise ValueError(
                "skinny_linear: config way 3 (x through TMA) takes bf16 / fp16 weights in wide tiles, x's rows on"
                " 16-byte boundaries"
            )
        xd = TensorDescriptor.from_tensor(x, [block_m, block_k])
    _skinny_kernel[(triton_cdiv(N, block_n) * triton_cdiv(M, block_m), split)](
        xd,
        w,
        w2,
        scale if scale is not None else dummy,
        scale2 if scale2 is not None else dummy,
        out,
        residual if residual is not None else dummy,
        part,
        count,
        run_if if run_if is not None else dummy,
        rms.ss if rms is not None else dummy,
        norm_out if norm_out is not None else dummy,
        xn,
        ss_out,
        M,
        N,
        K,
        K // (split * serial),
        x.stride(0),
        out.stride(0),
        residual.stride(0) if residual is not None else 0,
        scale.stride(0) if scale is not None else 0,
        scale2.stride(0) if scale2 is not None else 0,
        2.0**exponent,
        2.0**exponent2,
        rms.ss.shape[0] if rms is not None else 1,
        eps,
        EPILOGUE=epilogue,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=K % block_k == 0,
        DOT_F32=interpreting() or x.dtype == torch.float32,
        SPLIT=split,
        SERIAL=serial,
        FP8=fp8,
        GROUP=fmt.block if fp8 else 1,
        SCALE_ROWS=rows,
        SCALE_ROWS2=rows2,
        HAS_FLAG=run_if is not None,
        TMA=tma,
        TMA_X=tma_x,
        CHAIN=chain,
        XMAJOR=chain and way == WAY_XMAJOR,  # (per-channel scales: the tile-by-tile way, weights as M)
        RMS=rms is not None,
        P_BLOCK=max(16, next_pow2(rms.ss.shape[0])) if rms is not None else 16,
        NORM_OUT=norm_out is not None,
        NORM_PARTS=norm_parts,
        PDL=pdl,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=pdl,
    )
    return out if norm_out is None else (out, NormInput(xn, ss_out))


def _tma_rows(x: torch.Tensor) -> bool:
    """Whether a tensor descriptor can load x's tiles: its rows start on 16-byte boundaries."""
    return x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0


_DESCRIPTORS: dict = {}


def _descriptor(weight: torch.Tensor, block_n: int, block_k: int):
    """A [block_n, block_k] tensor descriptor of a weight (made once per address, shape and block:
    a descriptor holds no more than those, so a reused address gets the right one)."""
    key = (weight.data_ptr(), tuple(weight.shape), weight.dtype, block_n, block_k)
    if key not in _DESCRIPTORS:
        if len(_DESCRIPTORS) > 4096:
            _DESCRIPTORS.clear()
        _DESCRIPTORS[key] = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    return _DESCRIPTORS[key]
