"""The sparse MoE block for decode / verify steps, batch-invariant: each program serves one row.

Reference: `nextn.layers.ffn.SparseMoeBlock` (softmax router, top-k, renormalised weights in the
model dtype; experts' silu(gate) * up then down, each expert's weighted output added in ascending
expert order with the model dtype's rounding; plus the sigmoid-gated shared expert). A decode step
is latency-bound (each launch costs a few microseconds in a CUDA graph, more than its bytes), so
the block runs in three launches:
- `_norm_router_kernel` per (row, block of logits): the post_attention_layernorm of
  the row (each program normalises it, in the weight tile's layout; the first stores it for the
  experts) and its logits over the router and shared_expert_gate rows concatenated at load
  ([E + 1, H]); the row's last program to arrive routes it (softmax, top-k, renormalise) and
  stores the experts and the slots' weights (the shared slot's: sigmoid(shared gate logit)). A
  launch of its own for the norm and a GEMM launch for 1 MB of router weights were two dependent
  round trips more per layer;
- `_gate_up_kernel` per (row, slot, block of I): silu(x W_gate^T) * (x W_up^T) of the slot's
  expert; slot TOP_K is the shared expert;
- `_down_combine_kernel` per (row, slot, block of H): the slot's down projection times its
  weight, stored to a scratch row; the last of the row's TOP_K + 1 slot programs to arrive at the
  block's counter sums them: the routed slots in ascending expert order, plus the shared slot, plus
  the residual (none under tensor parallelism: the block's output is a partial sum, all-reduced
  before the residual is added). Every slot's weights stream at once (a program per row walked
  the slots one after another), and the order of arrival changes no bit (the sum is in slot order).
  On Hopper it is a programmatic dependent launch: its programs start once every gate/up program
  has, load their weight tiles while the gate/up kernel runs, and wait for it to complete before
  they read the activations.
Every product, weight and partial sum is rounded to the model dtype where the reference rounds it.
FP8 experts and shared expert (e4m3, nextn.ops.fp8's layout; or Q8_0's int8 with an fp16 scale per
32 columns, GROUP) are dequantized tile by tile to the model dtype as the reference's `dequantize`
does, bit for bit, and their products summed like the
dequantized copies' up to the order of the in-tile sums: on a GPU Triton lays a loaded tile out by
its element size, so an e4m3 tile reduces in another order than a bf16 or float32 one (the
interpreter: bit for bit).
"""

from __future__ import annotations

import torch

from nextn.ops.fp8 import FP8, QuantWeight
from nextn.ops.triton_norm import NormInput, norm_input_values
from nextn.ops.triton_utils import HAVE_TRITON, arrival_counters, interpreting, next_pow2, pdl_supported, row_launch

# (columns per program, num_warps) of the gate/up kernel (BLOCK_I intermediate columns of a slot)
# and of the down kernel (BLOCK_H hidden columns of a slot). Both are latency-bound GEMVs: their
# speed is the bytes in flight per SM, the programs resident times each thread's outstanding loads
# (ptxas keeps a tile or two of them). bench/moe_step_sweep.py times other sizes: smaller programs
# (one row per warp, or one warp) put more bytes in flight by the sm90 SASS, and cost the
# interpreter, which runs the programs one by one, several times as long. With BLOCK >= 2 *
# num_warps a [BLOCK, BLOCK_K] tile's row keeps its register layout at any size (bf16: 8 a thread
# over one warp's 32 lanes; e4m3: 16 a thread over 16 lanes), so the in-tile sums, and the
# results, keep their bits. (A float32 row spreads over two warps when there are two: one-warp
# programs sum a float32 model's tiles in another order.)
# Run 72 (bench/results/moe_step_sweep_run72.json, 35B-A3B, bf16, 1 row): gate/up at (2, 1) 27.4 us
# a block against 34.9 at (16, 4), down fastest at (16, 4). Gate/up at (1, 1), one row a program, is
# faster still: 1.5 us a block at 1 row, 1.6-1.8 at 4 (runs 96, 109), 413.1 against 408.7 tok/s in
# the 35B-A3B step (run 110). There a bf16 row keeps its layout; an e4m3 row is 8 a thread over 32
# lanes, not 16 over 16, so FP8 experts sum their tiles in another order than at the interpreter's
# (16, 4) (a quarter of the CPU tests' time of the GPU's sizes); rows stay invariant either way.
GATE_UP_BLOCKS = (1, 1)
INTERPRETED_GATE_UP_BLOCKS = (16, 4)
DOWN_BLOCKS = (16, 4)
BLOCK_K = 256  # reduction tile of both matmuls (it orders the float32 sums: results depend on it)
# (logits per program, num_warps) of the norm / router kernel (257 rows: 129 programs a row). Run 77
# (moe_step_sweep_run77.json, before the kernel routed): the norm and router launch 2.06 us at 2
# rows, 2.46 at 4, 2.79 at 8, where the norm kernel and the router's skinny GEMM took 4.97.
ROUTER_BLOCKS = (2, 4)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from nextn.ops.triton_linear import scaled

    @triton.jit
    def bf16_rounded(w):
        """float32 values rounded to bf16 (to nearest, ties even), held in float32: `w.to(bf16).to(float32)`
        with one packed convert a pair (cvt.rn.bf16x2.f32) and a shift or a mask each, where Triton
        emits a scalar convert a value (F2F, quarter rate on sm90) and a shift. GPU only (PTX)."""
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; and.b32 $1, t, 0xffff0000; }",
            "=r,=r,r,r",
            [w],
            dtype=tl.float32,
            is_pure=True,
            pack=2,
        )

    @triton.jit
    def _route_row(logits_ptr, idx_ptr, rw_ptr, E: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                   BLOCK_E: tl.constexpr, WARPS: tl.constexpr):  # fmt: skip
        """A row's routing from its E router logits and the shared gate's (logits_ptr[E], read from L2:
        other programs wrote them): the top-k of softmax(logits) (ties: the lowest id), renormalised,
        in ascending id order into idx_ptr[:TOP_K], their weights and sigmoid(shared gate logit) into
        rw_ptr[:TOP_K + 1], in the model dtype. Every one of the program's WARPS warps routes the row
        alone, in a [WARPS, BLOCK_E] tile whose lines are the row (loaded 8 to a thread, so a line is
        one warp's): the reductions stay within a warp (shuffles, no barrier), and the first line stores."""
        offs = tl.arange(0, BLOCK_E)[None, :] + tl.zeros((WARPS, 1), tl.int32)
        valid = offs < E
        x = tl.load(logits_ptr + offs, mask=valid, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        # one int64 key a logit, unique: p's bits (p >= 0, so they order as p does) over the id's
        # complement (a tie goes to the lowest id); the invalid ones' -1 below any
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 16) | (BLOCK_E - 1 - offs)
        remaining = tl.where(valid, key, -1)
        for _ in tl.static_range(TOP_K):  # k times: the largest left, taken out (-2)
            remaining = tl.where(remaining == tl.max(remaining, axis=1)[:, None], -2, remaining)
        chosen = (remaining == -2).to(tl.int32)
        weight = p
        if RENORM:
            weight = p / tl.sum(tl.where(chosen == 1, p, 0.0), axis=1)[:, None]
        dtype = rw_ptr.dtype.element_ty
        slot = tl.cumsum(chosen, axis=1) - 1  # ascending id order
        mine = (chosen == 1) & (tl.arange(0, WARPS) == 0)[:, None]
        tl.store(idx_ptr + slot, offs, mask=mine)
        tl.store(rw_ptr + slot, weight.to(dtype), mask=mine)
        sg = tl.load(logits_ptr + E, cache_modifier=".cg").to(tl.float32)
        tl.store(rw_ptr + TOP_K, (1.0 / (1.0 + tl.exp(-sg))).to(dtype))

    @triton.jit
    def _dequant(w, s_ptr, s_stride, k0, offs_n, mask_n, K: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr,
                 GROUP: tl.constexpr, ASM_ROUND: tl.constexpr):  # fmt: skip
        """A quantized tile w [BLOCK_N, BLOCK_K] at columns k0.. times its scales (nextn.ops.fp8's
        layout: s_ptr[kb * s_stride + n], a scale per GROUP columns), rounded to dtype: the
        reference's `dequantize`, value for value (held in float32; ASM_ROUND: bf16 rounded by the
        packed convert, `bf16_rounded`)."""
        n: tl.constexpr = w.shape[0]
        offs_b = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        smask = mask_n[:, None] & (offs_b[None, :] < (K + GROUP - 1) // GROUP)
        s = tl.load(s_ptr + offs_b[None, :] * s_stride + offs_n[:, None], mask=smask, other=0.0).to(tl.float32)
        w3 = scaled(tl.reshape(w, (n, BLOCK_K // GROUP, GROUP)), s[:, :, None])
        if ASM_ROUND:
            return bf16_rounded(tl.reshape(w3, (n, BLOCK_K)))
        return tl.reshape(w3, (n, BLOCK_K)).to(dtype).to(tl.float32)

    @triton.jit
    def _row_tile(ptr, offs_k, mask):
        """The vector ptr[offs_k] (float32) broadcast over the rows of a weight tile, loaded as the
        tile is: a 1-D load would take another layout, and converting it to the tile's goes through
        shared memory behind a barrier, which keeps the next tile's weight loads from issuing
        before this tile is summed (one tile of a program in flight at a time)."""
        return tl.load(tl.broadcast_to(ptr + offs_k[None, :], mask.shape), mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _norm_router_kernel(
        x_ptr,  # [T, H] residual stream
        norm_ptr,  # [H] post_attention_layernorm's weight (zero-centred)
        gates_ptr,  # [E + 1, H]: the router's rows, then shared_expert_gate's
        h_ptr,  # [T, H] out: the normalised rows, in the model dtype
        logits_ptr,  # [T, LOGIT_STRIDE] out: E + 1 logits in the model dtype
        count_ptr,  # [T] int32 arrival counters, zero (and left zero)
        idx_ptr,  # [T, TOP_K] out: the routed experts, ascending
        rw_ptr,  # [T, TOP_K + 1] out: the slots' weights in the model dtype (the shared expert's last)
        eps,
        H: tl.constexpr,
        E: tl.constexpr,
        LOGIT_STRIDE: tl.constexpr,
        TOP_K: tl.constexpr,
        RENORM: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_E: tl.constexpr,
        WARPS: tl.constexpr,  # the launch's num_warps (the routing's tile: a line per warp)
        PDL: tl.constexpr,  # a programmatic dependent launch: the weights loaded, wait for the kernel ahead
        RELEASE: tl.constexpr,  # 2: release the launch after it once past the wait (nextn.ops.triton_utils)
    ):
        """h = rms_norm(x) * (1 + norm) rounded to the model dtype (as `nextn.ops.norm.rms_norm`), the
        logits h @ gates[rows].T, and (the row's last program to arrive) its routing. Every program
        of a row normalises it the same way (the same layout, so the same bits) from loads issued
        beside its weight tile's. PDL: a program issues its gate rows' and the norm weight's loads,
        then waits for the kernel ahead (which writes x) to complete before it touches anything else
        (RELEASE 2: and then releases the launch after it)."""
        t = tl.program_id(0)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_h = tl.arange(0, BLOCK_H)
        mask_r = offs_r < E + 1
        row_mask = tl.broadcast_to((offs_h < H)[None, :], (BLOCK_R, BLOCK_H))
        w = tl.load(gates_ptr + offs_r[:, None] * H + offs_h[None, :], mask=mask_r[:, None] & row_mask, other=0.0)
        g = _row_tile(norm_ptr, offs_h, row_mask)
        if PDL:
            tl.extra.cuda.gdc_wait()
            if RELEASE == 2:
                tl.extra.cuda.gdc_launch_dependents()
        x = _row_tile(x_ptr + t * H, offs_h, row_mask)  # the row in every line of the tile
        dtype = h_ptr.dtype.element_ty
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps)
        h = (x * rstd[:, None] * (1.0 + g)).to(dtype)
        logits = tl.sum(w.to(tl.float32) * h.to(tl.float32), axis=1)
        tl.store(logits_ptr + t * LOGIT_STRIDE + offs_r, logits.to(dtype), mask=mask_r)
        if tl.program_id(1) == 0:  # one writer of the row's h (the tile's first line)
            first = row_mask & (tl.arange(0, BLOCK_R) == 0)[:, None]
            tl.store(tl.broadcast_to(h_ptr + t * H + offs_h[None, :], (BLOCK_R, BLOCK_H)), h, mask=first)
        tl.debug_barrier()  # every thread's logits are written before the counter moves
        if tl.atomic_add(count_ptr + t, 1, sem="acq_rel") == tl.num_programs(1) - 1:  # the row's last
            tl.store(count_ptr + t, 0)  # re-armed for the next launch
            _route_row(logits_ptr + t * LOGIT_STRIDE, idx_ptr + t * TOP_K, rw_ptr + t * (TOP_K + 1), E, TOP_K,
                       RENORM, BLOCK_E, WARPS)  # fmt: skip

    @triton.jit
    def _swiglu(x_ptr, wg_ptr, wu_ptr, act_ptr, offs_n, mask_n, H: tl.constexpr, BLOCK_K: tl.constexpr,
                sg_ptr, su_ptr, s_stride, FP8: tl.constexpr, GROUP: tl.constexpr, ASM_ROUND: tl.constexpr):  # fmt: skip
        """act[offs_n] = silu(x W_gate^T) * (x W_up^T), the products rounded like the reference's. FP8:
        the weights e4m3 with scales at sg_ptr / su_ptr (row stride s_stride), dequantized per tile.
        Each thread adds its columns' products over the tiles, and the row's sum is taken once, after
        the last tile (a sum a tile was a shuffle tree a tile: 1.6 instructions a weight)."""
        gate = tl.zeros((offs_n.shape[0], BLOCK_K), tl.float32)
        up = tl.zeros((offs_n.shape[0], BLOCK_K), tl.float32)
        dtype = act_ptr.dtype.element_ty
        for k0 in tl.static_range(0, H, BLOCK_K):  # unrolled: the tiles' loads can be in flight together
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < H
            wmask = mask_n[:, None] & mk[None, :]
            x = _row_tile(x_ptr, offs_k, wmask)
            wg = tl.load(wg_ptr + offs_n[:, None] * H + offs_k[None, :], mask=wmask, other=0.0)
            wu = tl.load(wu_ptr + offs_n[:, None] * H + offs_k[None, :], mask=wmask, other=0.0)
            if FP8:
                wg = _dequant(wg, sg_ptr, s_stride, k0, offs_n, mask_n, H, BLOCK_K, dtype, GROUP, ASM_ROUND)
                wu = _dequant(wu, su_ptr, s_stride, k0, offs_n, mask_n, H, BLOCK_K, dtype, GROUP, ASM_ROUND)
            gate += wg.to(tl.float32) * x
            up += wu.to(tl.float32) * x
        g = tl.sum(gate, axis=1).to(dtype).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(act_ptr + offs_n, (silu * tl.sum(up, axis=1).to(dtype).to(tl.float32)).to(dtype), mask=mask_n)

    @triton.jit
    def _gate_up_kernel(
        x_ptr,  # [T, H] the normalised rows
        idx_ptr,  # [T, TOP_K] the routed experts
        gate_up_ptr,  # [E, 2I, H]
        shared_gate_ptr,  # [Is, H]
        shared_up_ptr,  # [Is, H]
        gate_up_s_ptr,  # FP8_EXPERTS: [E, ceil(H / GROUP), 2I] scales (float32; Q8_0 float16)
        shared_gate_s_ptr,  # FP8_SHARED: [ceil(H / 128), Is]
        shared_up_s_ptr,
        act_ptr,  # [T, TOP_K + 1, stride_act] out
        stride_act,
        H: tl.constexpr,
        I: tl.constexpr,
        Is: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        FP8_EXPERTS: tl.constexpr,
        FP8_SHARED: tl.constexpr,
        GROUP: tl.constexpr,  # columns per scale: 128 (FP8) or 32 (Q8_0)
        PDL: tl.constexpr,  # a programmatic dependent launch (of the router)
        RELEASE: tl.constexpr,  # release the launch after it: 1 at the start, 2 once past the wait
        ASM_ROUND: tl.constexpr = False,  # quantized weights rounded to bf16 by `bf16_rounded` (compiled, bf16)
    ):
        """act = silu(x W_gate^T) * (x W_up^T) of each slot's expert, a program per (row, slot, block
        of I); slot TOP_K is the shared expert. PDL: a program waits for the router to complete. The
        release lets the down kernel start and stream its weights while this kernel runs."""
        if RELEASE == 1:
            tl.extra.cuda.gdc_launch_dependents()
        if PDL:
            tl.extra.cuda.gdc_wait()
            if RELEASE == 2:
                tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)  # t * (TOP_K + 1) + slot
        t = row // (TOP_K + 1)
        slot = row % (TOP_K + 1)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        act = act_ptr + row * stride_act
        if slot == TOP_K:  # the shared expert
            _swiglu(x_ptr + t * H, shared_gate_ptr, shared_up_ptr, act, offs_n, offs_n < Is, H, BLOCK_K,
                    shared_gate_s_ptr, shared_up_s_ptr, Is, FP8_SHARED, GROUP, ASM_ROUND)  # fmt: skip
        else:
            e = tl.load(idx_ptr + t * TOP_K + slot).to(tl.int64)
            base = gate_up_ptr + e * (2 * I * H)
            s_base = gate_up_s_ptr + e * ((H + GROUP - 1) // GROUP * 2 * I)
            _swiglu(x_ptr + t * H, base, base + I * H, act, offs_n, offs_n < I, H, BLOCK_K, s_base, s_base + I, 2 * I,
                    FP8_EXPERTS, GROUP, ASM_ROUND)  # fmt: skip

    @triton.jit
    def _down_tile(w_ptr, offs_n, mask_n, I: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_K: tl.constexpr):
        """Weight rows offs_n of a [*, I] down projection as [BLOCK_N, CHUNKS, BLOCK_K] (the CHUNKS
        reduction tiles loaded at once, before the wait for the activations), with its mask and
        column offsets."""
        offs_k = tl.arange(0, CHUNKS)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        mask = mask_n[:, None, None] & (offs_k < I)[None, :, :]
        return tl.load(w_ptr + offs_n[:, None, None] * I + offs_k[None, :, :], mask=mask, other=0.0), mask, offs_k

    @triton.jit
    def _down(w, mask, offs_k, act_ptr, rw_ptr, offs_n, s_ptr, s_stride, dtype: tl.constexpr, FP8: tl.constexpr,
              GROUP: tl.constexpr, I: tl.constexpr, ASM_ROUND: tl.constexpr):  # fmt: skip
        """(act @ W_down^T)[offs_n] * routing weight, each rounded to the model dtype (float32 values),
        from the slot's weight tile (_down_tile, over I columns): each BLOCK_K tile summed, then the
        tiles' sums in order. FP8: the weight e4m3 (or int8) with scales at s_ptr (row stride
        s_stride), dequantized by `_dequant` (a scale loaded per GROUP columns, not per value)."""
        if FP8:  # the tile's CHUNKS x BLOCK_K columns as one row of I (s_stride is H: the rows' bound)
            n: tl.constexpr = w.shape[0]
            chunks: tl.constexpr = w.shape[1]
            cols: tl.constexpr = w.shape[1] * w.shape[2]
            mask_n = offs_n < s_stride
            wd = _dequant(tl.reshape(w, (n, cols)), s_ptr, s_stride, 0, offs_n, mask_n, I, cols, dtype, GROUP,
                          ASM_ROUND)  # fmt: skip
            wf = tl.reshape(wd, (n, chunks, w.shape[2]))
        else:
            wf = w.to(tl.float32)
        a = tl.load(tl.broadcast_to(act_ptr + offs_k[None, :, :], mask.shape), mask=mask, other=0.0).to(tl.float32)
        acc = tl.sum(tl.sum(wf * a, axis=2), axis=1)
        rw = tl.load(rw_ptr).to(tl.float32)
        return (acc.to(dtype).to(tl.float32) * rw).to(dtype).to(tl.float32)

    @triton.jit
    def _down_combine_kernel(
        act_ptr,  # [T, TOP_K + 1, stride_act]
        idx_ptr,  # [T, TOP_K]
        rw_ptr,  # [T, TOP_K + 1]
        down_ptr,  # [E, H, I]
        shared_down_ptr,  # [H, Is]
        down_s_ptr,  # FP8_EXPERTS: [E, ceil(I / GROUP), H] scales (float32; Q8_0 float16)
        shared_down_s_ptr,  # FP8_SHARED: [ceil(Is / GROUP), H]
        res_ptr,  # [T, H]
        y_ptr,  # [T, TOP_K + 1, H] scratch: the slots' weighted outputs in the model dtype
        count_ptr,  # [T * cdiv(H, BLOCK_N)] int32 arrival counters, zero (and left zero)
        out_ptr,  # [T, H]
        nw_ptr,  # NORM_OUT: [H] the next norm's weight (zero-centred)
        xn_ptr,  # NORM_OUT: [T, H] out * (1 + nw)
        ss_ptr,  # NORM_OUT: [cdiv(H, BLOCK_N), T] float32, out's sums of squares per block of H
        stride_act,
        H: tl.constexpr,
        I: tl.constexpr,
        Is: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        CHUNKS: tl.constexpr,  # BLOCK_K tiles over I
        CHUNKS_S: tl.constexpr,  # over Is
        RESIDUAL: tl.constexpr,
        FP8_EXPERTS: tl.constexpr,
        FP8_SHARED: tl.constexpr,
        GROUP: tl.constexpr,  # columns per scale: 128 (FP8) or 32 (Q8_0)
        PDL: tl.constexpr,
        NORM_OUT: tl.constexpr,  # also the next norm's input (nextn.ops.triton_norm.NormInput)
        RELEASE: tl.constexpr,  # release the launch after it: 1 at the start, 2 once past the wait
        ASM_ROUND: tl.constexpr = False,  # quantized weights rounded to bf16 by `bf16_rounded` (compiled, bf16)
    ):
        """out = x + (the routed slots' outputs summed in slot order + the shared slot's); without
        RESIDUAL the sum alone (NORM_OUT: and the next norm's input, as the skinny GEMM's norm_out).
        A program per (row, slot, block of H) streams its slot's weights (the slots' loads in
        flight together, not one slot after another), stores its output and counts in; the row's
        last program of the block to arrive sums the TOP_K + 1 outputs. PDL
        (launched as a programmatic dependent of the gate/up kernel): a program loads its weight
        tile (and its expert id, which the router kernel before the gate/up kernel wrote), then
        waits for the gate/up kernel to complete before it reads anything that kernel writes or
        writes anything at all."""
        if RELEASE == 1:  # (what follows reads nothing before its own wait: the rule in triton_utils)
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)  # t * (TOP_K + 1) + slot
        t = row // (TOP_K + 1)
        slot = row % (TOP_K + 1)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        dtype = out_ptr.dtype.element_ty
        act = act_ptr + row * stride_act
        # (each branch names its own tiles: a variable set in both branches of a runtime `if` must
        # keep one type and shape, and the shared expert's may differ from the routed experts')
        if slot == TOP_K:
            ws, mask_s, offs_s = _down_tile(shared_down_ptr, offs_n, mask_n, Is, CHUNKS_S, BLOCK_K)
            if PDL:
                tl.extra.cuda.gdc_wait()
                if RELEASE == 2:
                    tl.extra.cuda.gdc_launch_dependents()
            y = _down(ws, mask_s, offs_s, act, rw_ptr + row, offs_n, shared_down_s_ptr, H, dtype, FP8_SHARED, GROUP, Is,
                      ASM_ROUND)  # fmt: skip
        else:
            e = tl.load(idx_ptr + t * TOP_K + slot).to(tl.int64)
            we, mask_e, offs_e = _down_tile(down_ptr + e * (H * I), offs_n, mask_n, I, CHUNKS, BLOCK_K)
            if PDL:
                tl.extra.cuda.gdc_wait()
                if RELEASE == 2:
                    tl.extra.cuda.gdc_launch_dependents()
            y = _down(we, mask_e, offs_e, act, rw_ptr + row, offs_n, down_s_ptr + e * ((I + GROUP - 1) // GROUP * H),
                      H, dtype, FP8_EXPERTS, GROUP, I, ASM_ROUND)  # fmt: skip
        tl.store(y_ptr + row * H + offs_n, y.to(dtype), mask=mask_n)  # exact: y is rounded to dtype
        tl.debug_barrier()  # every thread's output is written before the counter moves
        count = count_ptr + t * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(count, 1, sem="acq_rel") == TOP_K:  # the last of the row's slots here
            tl.store(count, 0)  # re-armed for the next launch
            # .cg: from L2, where the other programs' outputs are (not a stale L1 line)
            y_row = y_ptr + t * (TOP_K + 1) * H + offs_n
            total = tl.zeros((BLOCK_N,), tl.float32)
            for j in tl.static_range(TOP_K):
                y = tl.load(y_row + j * H, mask=mask_n, other=0.0, cache_modifier=".cg").to(tl.float32)
                total = (total + y).to(dtype).to(tl.float32)
            y = tl.load(y_row + TOP_K * H, mask=mask_n, other=0.0, cache_modifier=".cg").to(tl.float32)
            mlp = (total + y).to(dtype).to(tl.float32)
            if RESIDUAL:
                r = tl.load(res_ptr + t * H + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                mlp = r + mlp
            out = mlp.to(dtype)
            tl.store(out_ptr + t * H + offs_n, out, mask=mask_n)
            if NORM_OUT:
                nw = tl.load(nw_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                xn, sumsq = norm_input_values(tl.where(mask_n, out.to(tl.float32), 0.0), nw, 0)
                tl.store(xn_ptr + t * H + offs_n, xn.to(dtype), mask=mask_n)
                T = tl.num_programs(0) // (TOP_K + 1)
                tl.store(ss_ptr + tl.program_id(1) * T + t, sumsq)


def moe_step(
    x: torch.Tensor,  # [T, H] residual stream (the block's input, before its norm)
    norm: torch.Tensor,  # [H] post_attention_layernorm's weight (zero-centred)
    eps: float,
    gates: torch.Tensor,  # [E + 1, H]: the router's rows, then shared_expert_gate's
    gate_up: torch.Tensor | QuantWeight,  # [E, 2I, H] (FP8: scales [E, ceil(H / 128), 2I])
    down: torch.Tensor | QuantWeight,  # [E, H, I] (FP8: scales [E, ceil(I / 128), H])
    shared_gate: torch.Tensor | QuantWeight,  # [Is, H] shared expert gate_proj
    shared_up: torch.Tensor | QuantWeight,  # [Is, H]
    shared_down: torch.Tensor | QuantWeight,  # [H, Is]
    top_k: int,
    renorm: bool,
    *,
    residual: bool = True,  # False: the block's output alone (tensor parallelism's partial sum)
    router_blocks: tuple[int, int] = ROUTER_BLOCKS,  # the norm / router kernel's (rows, num_warps)
    pdl: bool = True,  # the three kernels as programmatic dependent launches where the GPU has them
    gate_up_blocks: tuple[int, int] | None = None,  # default GATE_UP_BLOCKS; bench/moe_step_sweep.py compares others
    down_blocks: tuple[int, int] = DOWN_BLOCKS,
    norm_out: torch.Tensor | None = None,  # [H] with residual: also return the next norm's NormInput
    asm_round: bool = True,  # bf16 on a GPU: quantized weights rounded by the packed convert (the same bits)
) -> torch.Tensor | tuple[torch.Tensor, NormInput]:
    """Returns x + SparseMoeBlock(rms_norm(x, norm, eps)) [T, H] (without x when not residual);
    norm_out (the next norm's weight): (that, the next norm's NormInput, as skinny_linear's). FP8
    weights (nextn.ops.fp8's layout, one scale per row and 128 columns) are dequantized tile by tile
    to the model dtype as the reference's `dequantize` does, bit for bit; their products sum like the
    dequantized copies' up to the order of the in-tile sums on a GPU (bitwise on the interpreter:
    see the module docstring). The experts' pair and the shared expert's three are each FP8 or not;
    Q8_0 weights (nextn.ops.q8_0) take the FP8 path with a scale per 32 columns, every quantized
    weight of a call in one format.
    gate_up_blocks / down_blocks: the kernels' (BLOCK, num_warps), GATE_UP_BLOCKS / DOWN_BLOCKS;
    router_blocks: ROUTER_BLOCKS; pdl=False: the three kernels wait for the kernels ahead as plain
    launches (bench/moe_step_sweep.py compares)."""
    fp8_experts, fp8_shared = _fp8_kind(gate_up, down), _fp8_kind(shared_gate, shared_up, shared_down)
    group = _group(gate_up, down, shared_gate, shared_up, shared_down)
    scales = [
        w.scale if isinstance(w, QuantWeight) else x for w in (gate_up, down, shared_gate, shared_up, shared_down)
    ]
    gate_up, down, shared_gate, shared_up, shared_down = (
        w.weight if isinstance(w, QuantWeight) else w for w in (gate_up, down, shared_gate, shared_up, shared_down)
    )
    if not all(t.is_contiguous() for t in (gate_up, down, shared_gate, shared_up, shared_down, *scales)):
        raise ValueError("moe_step: the weights and scales must be contiguous (the kernels index them as such)")
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    I, Is = two_i // 2, shared_gate.shape[0]
    if isinstance(gates, QuantWeight) or gates.shape != (E + 1, H):
        raise ValueError(f"moe_step: gates must be the router's {E} rows and the shared gate's [{E + 1}, {H}], not FP8")
    if not (x.is_contiguous() and gates.is_contiguous()):
        raise ValueError("moe_step: x and gates must be contiguous (the kernels index them as such)")
    # [T, E + 1] in the model dtype, like the reference's two linears; rows 16-aligned, so the route
    # loads (and reduces) the logits with the layout of a power-of-two row
    stride = -(-(E + 1) // 16) * 16
    logits = torch.empty(T, stride, device=x.device, dtype=x.dtype)
    h = torch.empty_like(x)
    idx = torch.empty(T, top_k, device=x.device, dtype=torch.int32)
    weights = torch.empty(T, top_k + 1, device=x.device, dtype=x.dtype)
    router_rows, router_warps = router_blocks
    # the router loads its gate rows while the kernel ahead finishes, the down kernel streams its
    # weights while the gate/up kernel runs (Hopper and later; the rule: nextn.ops.triton_utils)
    pdl = pdl and pdl_supported(x)
    # the router and the down kernel are dependents at every row count; the gate/up kernel and the
    # releases follow `row_launch` (a decode's row: the router releases once past its wait)
    dependent, release = row_launch(pdl, T)
    _norm_router_kernel[(T, triton.cdiv(E + 1, router_rows))](
        x,
        norm,
        gates,
        h,
        logits,
        arrival_counters(x.device, T),
        idx,
        weights,
        eps,
        H=H,
        E=E,
        LOGIT_STRIDE=stride,
        TOP_K=top_k,
        RENORM=renorm,
        BLOCK_R=router_rows,
        BLOCK_H=next_pow2(H),
        BLOCK_E=next_pow2(E),
        WARPS=router_warps,
        PDL=pdl,
        RELEASE=2 if dependent else 0,
        num_warps=router_warps,
        launch_pdl=pdl,
    )
    act = torch.empty(T, top_k + 1, max(I, Is), device=x.device, dtype=x.dtype)
    asm_round = asm_round and x.dtype == torch.bfloat16 and x.is_cuda and not interpreting()
    if gate_up_blocks is None:
        gate_up_blocks = INTERPRETED_GATE_UP_BLOCKS if interpreting() else GATE_UP_BLOCKS
    (block_i, gate_up_warps), (block_h, down_warps) = gate_up_blocks, down_blocks
    _gate_up_kernel[(T * (top_k + 1), triton.cdiv(max(I, Is), block_i))](
        h,
        idx,
        gate_up,
        shared_gate,
        shared_up,
        scales[0],
        scales[2],
        scales[3],
        act,
        act.stride(1),
        H=H,
        I=I,
        Is=Is,
        TOP_K=top_k,
        BLOCK_N=block_i,
        BLOCK_K=BLOCK_K,
        FP8_EXPERTS=fp8_experts,
        FP8_SHARED=fp8_shared,
        GROUP=group,
        PDL=dependent,
        RELEASE=release,
        ASM_ROUND=asm_round,
        num_warps=gate_up_warps,
        launch_pdl=dependent,
    )
    out = torch.empty_like(x)
    n_blocks = triton.cdiv(H, block_h)
    if norm_out is not None and (not residual or norm_out.shape != (H,)):
        raise ValueError("moe_step: norm_out takes the residual block and the norm's [H] weight")
    xn = ss = x
    if norm_out is not None:
        xn, ss = torch.empty_like(x), torch.empty(n_blocks, T, device=x.device, dtype=torch.float32)
    _down_combine_kernel[(T * (top_k + 1), n_blocks)](
        act,
        idx,
        weights,
        down,
        shared_down,
        scales[1],
        scales[4],
        x,
        torch.empty(T, top_k + 1, H, device=x.device, dtype=x.dtype),
        arrival_counters(x.device, T * n_blocks),
        out,
        norm_out if norm_out is not None else x,
        xn,
        ss,
        act.stride(1),
        H=H,
        I=I,
        Is=Is,
        TOP_K=top_k,
        BLOCK_N=block_h,
        BLOCK_K=BLOCK_K,
        CHUNKS=next_pow2(triton.cdiv(I, BLOCK_K)),
        CHUNKS_S=next_pow2(triton.cdiv(Is, BLOCK_K)),
        RESIDUAL=residual,
        FP8_EXPERTS=fp8_experts,
        FP8_SHARED=fp8_shared,
        GROUP=group,
        PDL=pdl,
        RELEASE=release,
        NORM_OUT=norm_out is not None,
        ASM_ROUND=asm_round,
        num_warps=down_warps,
        launch_pdl=pdl,
    )
    return out if norm_out is None else (out, NormInput(xn, ss))


def _group(*weights) -> int:
    """The columns per scale of the quantized weights among `weights` (one format a call; 128 if none)."""
    formats = {w.format for w in weights if isinstance(w, QuantWeight)}
    if len(formats) > 1:
        raise ValueError(
            f"moe_step: the quantized weights must share one format, got {sorted(f.name for f in formats)}"
        )
    return formats.pop().block if formats else FP8.block


def _fp8_kind(*weights) -> bool:
    """Whether weights that one kernel branch reads are FP8 (all of them, per row scales), or none."""
    kinds = {isinstance(w, QuantWeight) for w in weights}
    if len(kinds) > 1:
        raise ValueError("moe_step: the experts' weights (and the shared expert's) must all be FP8 or none")
    for w in weights:
        if isinstance(w, QuantWeight) and w.rows != 1:
            raise ValueError(f"moe_step: FP8 weights take one scale per row (got {w.rows} rows per scale)")
    return kinds == {True}
