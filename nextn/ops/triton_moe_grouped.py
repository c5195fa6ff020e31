"""The routed experts over many rows (prefill): grouped GEMMs over (token, slot) pairs sorted by
expert. Reference: `nextn.ops.moe.routed_experts` (per expert: silu(x W_gate^T) * (x W_up^T),
then W_down, times the routing weight, each rounded to the model dtype; slots summed in slot order).

Pairs are sorted by expert and each expert's group padded to a multiple of BLOCK_M rows, on the
device with no host synchronisation (`_align`); a block of BLOCK_M sorted rows belongs to one
expert, so each program multiplies a [BLOCK_M, K] tile of gathered rows by one expert's weights on
the tensor cores, and an expert's weights are read once per output tile however many of the
prompt's tokens chose it (the per-row decode kernels of `triton_moe` read them once per row).
FP8 experts (nextn.ops.fp8.QuantWeight: e4m3 with a float32 scale per row and 128 columns) are read as
e4m3 and each [BLOCK_K, BLOCK_N] tile dequantized to the activations' dtype as the reference's
`dequantize` does (the float32 product, rounded), so the tile the dot takes is the dequantized
copy's, value for value, and no copy of a layer's experts is made. Q8_0 experts (nextn.ops.q8_0:
int8 with a float16 scale per row and 32 columns, GROUP) the same way, a k tile over two scale
groups taking each value's own scale.
"""

from __future__ import annotations

import torch

from nextn.ops.fp8 import BLOCK, FP8, QuantWeight
from nextn.ops.triton_utils import HAVE_TRITON, interpreting, require_triton

BLOCK_M = 64
# the kernels' tiles (constexprs) and launch options (num_stages: the backend's default), as
# `grouped_experts` launches them; bench/sm90_compile.py compiles the kernels with them for sm90
# on the CPU and checks their shared memory fits an H200 block
GATE_UP_BLOCKS = dict(BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=64)
GATE_UP_OPTIONS = dict(num_warps=4)
DOWN_BLOCKS = dict(BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=64)
DOWN_OPTIONS = dict(num_warps=4)
assert BLOCK % GATE_UP_BLOCKS["BLOCK_K"] == 0 and BLOCK % DOWN_BLOCKS["BLOCK_K"] == 0  # an FP8 k tile: one scale column

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from nextn.ops.triton_linear import scaled

    @triton.jit
    def _dequant_tile(w, s_ptr, s_stride, k0, offs_n, mask_n, dtype: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_K: tl.constexpr, K):  # fmt: skip
        """A quantized tile w [BLOCK_K, BLOCK_N] (columns offs_n of a weight, its rows k0..) times its
        scales (s_ptr[(k // GROUP) * s_stride + n]: one row of them where the tile is within a
        GROUP-column block, FP8's; each value's own where it spans several, Q8_0's), rounded to dtype."""
        if BLOCK_K <= GROUP:
            s = tl.load(s_ptr + (k0 // GROUP) * s_stride + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            smask = (offs_k < K)[:, None] & mask_n[None, :]
            s = tl.load(s_ptr + (offs_k // GROUP)[:, None] * s_stride + offs_n[None, :], mask=smask, other=0.0)
            s = s.to(tl.float32)
        return scaled(w, s).to(dtype)

    @triton.jit
    def _grouped_gate_up_kernel(
        x_ptr,
        pairs_ptr,
        block_expert_ptr,
        w_ptr,
        s_ptr,  # FP8: [E, ceil(H / GROUP), 2I] scales (float32; Q8_0 float16)
        act_ptr,
        NK,
        H,
        I,
        TOP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_F32: tl.constexpr,
        FP8: tl.constexpr,
        GROUP: tl.constexpr,  # columns per scale: 128 (FP8) or 32 (Q8_0)
    ):
        """act[row] = silu(x[token] W_gate[e]^T) * (x[token] W_up[e]^T) for the block's sorted rows."""
        pid_m = tl.program_id(0)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= 0:
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(pairs_ptr + rows)
            valid = pair < NK
            tok = (pair // TOP_K).to(tl.int64)
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            mn = offs_n < I
            base = w_ptr + e.to(tl.int64) * (2 * I * H)
            s_base = s_ptr + e.to(tl.int64) * ((H + GROUP - 1) // GROUP * 2 * I)
            dtype = act_ptr.dtype.element_ty
            gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, H, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mk = offs_k < H
                xa = tl.load(x_ptr + tok[:, None] * H + offs_k[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
                wmask = mk[:, None] & mn[None, :]
                wg = tl.load(base + offs_n[None, :] * H + offs_k[:, None], mask=wmask, other=0.0)
                wu = tl.load(base + (I + offs_n[None, :]) * H + offs_k[:, None], mask=wmask, other=0.0)
                if FP8:
                    wg = _dequant_tile(wg, s_base, 2 * I, k0, offs_n, mn, dtype, GROUP, BLOCK_K, H)
                    wu = _dequant_tile(wu, s_base + I, 2 * I, k0, offs_n, mn, dtype, GROUP, BLOCK_K, H)
                if DOT_F32:  # float32 products in full precision (Triton's default there is TF32)
                    xa, wg, wu = xa.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
                    gate = tl.dot(xa, wg, gate, input_precision="ieee")
                    up = tl.dot(xa, wu, up, input_precision="ieee")
                else:
                    gate = tl.dot(xa, wg, gate)
                    up = tl.dot(xa, wu, up)
            g = gate.to(dtype).to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
            tl.store(act_ptr + rows[:, None].to(tl.int64) * I + offs_n[None, :], act, mask=mn[None, :])

    @triton.jit
    def _grouped_down_kernel(
        act_ptr,
        pairs_ptr,
        block_expert_ptr,
        w_ptr,
        s_ptr,  # FP8: [E, ceil(I / GROUP), H] scales (float32; Q8_0 float16)
        rw_ptr,
        y_ptr,
        NK,
        H,
        I,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_F32: tl.constexpr,
        FP8: tl.constexpr,
        GROUP: tl.constexpr,  # columns per scale: 128 (FP8) or 32 (Q8_0)
    ):
        """y[pair] = (act[row] W_down[e]^T) * the pair's routing weight, each rounded to the dtype."""
        pid_m = tl.program_id(0)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= 0:
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(pairs_ptr + rows)
            valid = pair < NK
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            mn = offs_n < H
            base = w_ptr + e.to(tl.int64) * (H * I)
            s_base = s_ptr + e.to(tl.int64) * ((I + GROUP - 1) // GROUP * H)
            dtype = y_ptr.dtype.element_ty
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, I, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mk = offs_k < I
                a = tl.load(act_ptr + rows[:, None].to(tl.int64) * I + offs_k[None, :], mask=mk[None, :], other=0.0)
                w = tl.load(base + offs_n[None, :] * I + offs_k[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
                if FP8:
                    w = _dequant_tile(w, s_base, H, k0, offs_n, mn, dtype, GROUP, BLOCK_K, I)
                if DOT_F32:
                    acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w, acc)
            rw = tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
            y = (acc.to(dtype).to(tl.float32) * rw[:, None]).to(dtype)
            tl.store(y_ptr + pair[:, None].to(tl.int64) * H + offs_n[None, :], y, mask=valid[:, None] & mn[None, :])


def _align(top_idx: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs int32 [P]: pair ids (token * k + slot) grouped by expert, each group padded
    to a multiple of block_m with NK; block_expert int32 [P // block_m]: each block's expert, -1
    past the last group). P = NK + E * (block_m - 1) rounded up: enough for any routing, so no
    count is read back to the host."""
    flat = top_idx.reshape(-1).long()
    nk, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, device=dev, dtype=torch.long).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(nk, device=dev) - (counts.cumsum(0) - counts)[expert]
    P = -(-(nk + num_experts * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((P,), nk, device=dev, dtype=torch.int32)
    pairs[(pad_end - padded)[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, P, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pairs, block_expert


def grouped_experts(
    x: torch.Tensor,
    top_idx: torch.Tensor,
    top_w: torch.Tensor,
    gate_up: torch.Tensor | QuantWeight,
    down: torch.Tensor | QuantWeight,
) -> torch.Tensor:
    """x [N, H]; top_idx, top_w [N, k]; gate_up [E, 2I, H]; down [E, H, I] (both tensors, or both
    QuantWeight of one format with scales [E, ceil(K / block), N]) -> [N, H] (x's dtype)."""
    require_triton()
    N, H = x.shape
    k = top_idx.shape[1]
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    if gate_up.shape[2] != H or down.shape != (E, H, I):
        raise ValueError(f"grouped_experts: weights {tuple(gate_up.shape)}, {tuple(down.shape)} do not fit H={H}")
    fp8 = isinstance(gate_up, QuantWeight)
    if fp8 != isinstance(down, QuantWeight) or (
        fp8 and ((gate_up.rows, down.rows) != (1, 1) or gate_up.format != down.format)
    ):
        raise ValueError("grouped_experts: gate_up and down must both be FP8 (a scale per row, one format) or neither")
    group = gate_up.format.block if fp8 else FP8.block
    if N == 0:
        return x.new_zeros(0, H)
    (gate_up, gate_up_s), (down, down_s) = (
        (w.weight.contiguous(), w.scale.contiguous()) if fp8 else (w.contiguous(), x) for w in (gate_up, down)
    )
    x = x.contiguous()
    pairs, block_expert = _align(top_idx, E, BLOCK_M)
    n_blocks = block_expert.numel()
    dot_f32 = interpreting() or x.dtype == torch.float32
    act = torch.empty(pairs.numel(), I, device=x.device, dtype=x.dtype)
    _grouped_gate_up_kernel[(n_blocks, triton.cdiv(I, GATE_UP_BLOCKS["BLOCK_N"]))](
        x, pairs, block_expert, gate_up, gate_up_s, act, N * k, H, I, TOP_K=k, DOT_F32=dot_f32, FP8=fp8, GROUP=group,
        **GATE_UP_BLOCKS, **GATE_UP_OPTIONS,
    )  # fmt: skip
    y = torch.empty(N * k, H, device=x.device, dtype=x.dtype)
    _grouped_down_kernel[(n_blocks, triton.cdiv(H, DOWN_BLOCKS["BLOCK_N"]))](
        act,
        pairs,
        block_expert,
        down,
        down_s,
        top_w.reshape(-1).contiguous(),
        y,
        N * k,
        H,
        I,
        DOT_F32=dot_f32,
        FP8=fp8,
        GROUP=group,
        **DOWN_BLOCKS,
        **DOWN_OPTIONS,
    )
    y = y.view(N, k, H)
    out = y[:, 0]
    for s in range(1, k):  # slot order, rounded per add like the reference
        out = out + y[:, s]
    return out
