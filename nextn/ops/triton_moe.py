"""The sparse MoE block for decode / verify steps, batch-invariant: each program serves one row.

Reference: `nextn.layers.ffn.SparseMoeBlock` (softmax router, top-k, renormalised weights in the
model dtype; experts' silu(gate) * up then down, each expert's weighted output added in ascending
expert order with the model dtype's rounding; plus the sigmoid-gated shared expert). Launches:
- `_route_kernel` per row: softmax over the router logits, top-k, renormalise; the chosen experts
  are written in ascending id order (the reference's summation order);
- `_gate_up_kernel` per (row, slot, block of I): silu(x W_gate^T) * (x W_up^T) of that expert;
- `_down_kernel` per (row, slot, block of H): the slot's down projection times its weight;
- `_combine_kernel` per (row, block of H): the slots summed in slot order, plus sigmoid(shared
  gate) * shared expert, plus the residual (none under tensor parallelism: the block's output is a
  partial sum, all-reduced before the residual is added).
The router and shared expert matmuls go through `skinny_linear`.
"""

from __future__ import annotations

import torch

from nextn.ops.triton_utils import HAVE_TRITON, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _route_kernel(
        logits_ptr, idx_ptr, w_ptr, E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr
    ):
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        x = tl.load(logits_ptr + t * E + offs, mask=valid, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(valid, p, -1.0)
        chosen = tl.zeros((BLOCK_E,), tl.int32)
        remaining = p
        for _ in tl.static_range(TOP_K):  # k times: the largest left (ties: the lowest id)
            best = tl.max(remaining, axis=0)
            first = tl.min(tl.where(remaining == best, offs, BLOCK_E), axis=0)
            chosen = tl.where(offs == first, 1, chosen)
            remaining = tl.where(offs == first, -2.0, remaining)
        total = tl.sum(tl.where(chosen == 1, p, 0.0), axis=0)
        weight = tl.where(chosen == 1, p, 0.0)
        if RENORM:
            weight = weight / total
        slot = tl.cumsum(chosen, axis=0) - 1  # chosen experts in ascending id order
        keep = chosen == 1
        tl.store(idx_ptr + t * TOP_K + slot, offs, mask=keep)
        tl.store(w_ptr + t * TOP_K + slot, weight.to(w_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _gate_up_kernel(
        x_ptr, idx_ptr, w_ptr, act_ptr, H, I, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        row = tl.program_id(0)  # t * TOP_K + slot
        t = row // TOP_K
        e = tl.load(idx_ptr + row).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        gate = tl.zeros((BLOCK_N,), tl.float32)
        up = tl.zeros((BLOCK_N,), tl.float32)
        base = w_ptr + e * (2 * I * H)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < H
            x = tl.load(x_ptr + t * H + offs_k, mask=mk, other=0.0).to(tl.float32)
            wg = tl.load(base + offs_n[:, None] * H + offs_k[None, :], mask=mask_n[:, None] & mk[None, :], other=0.0)
            wu = tl.load(
                base + (I + offs_n[:, None]) * H + offs_k[None, :], mask=mask_n[:, None] & mk[None, :], other=0.0
            )
            gate += tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
            up += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
        dtype = act_ptr.dtype.element_ty
        g = gate.to(dtype).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(act_ptr + row * I + offs_n, (silu * up.to(dtype).to(tl.float32)).to(dtype), mask=mask_n)

    @triton.jit
    def _down_kernel(act_ptr, idx_ptr, rw_ptr, w_ptr, y_ptr, H, I, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[row] = (act[row] @ W_down[e]^T) * routing weight, each rounded to the model dtype."""
        row = tl.program_id(0)  # t * TOP_K + slot
        e = tl.load(idx_ptr + row).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = offs_k < I
            a = tl.load(act_ptr + row * I + offs_k, mask=mk, other=0.0).to(tl.float32)
            w = tl.load(
                w_ptr + e * (H * I) + offs_n[:, None] * I + offs_k[None, :],
                mask=mask_n[:, None] & mk[None, :],
                other=0.0,
            )
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        dtype = y_ptr.dtype.element_ty
        rw = tl.load(rw_ptr + row).to(tl.float32)
        tl.store(y_ptr + row * H + offs_n, (acc.to(dtype).to(tl.float32) * rw).to(dtype), mask=mask_n)

    @triton.jit
    def _combine_kernel(
        y_ptr,
        shared_ptr,
        shared_gate_ptr,
        res_ptr,
        out_ptr,
        H,
        TOP_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        RESIDUAL: tl.constexpr,
    ):
        """x + (sum of the slots' outputs in slot order + sigmoid(shared gate) * shared expert);
        without RESIDUAL the sum alone."""
        t = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        dtype = out_ptr.dtype.element_ty
        total = tl.zeros((BLOCK_N,), tl.float32)
        for j in tl.static_range(TOP_K):
            y = tl.load(y_ptr + (t * TOP_K + j) * H + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            total = (total + y).to(dtype).to(tl.float32)
        sg = tl.load(shared_gate_ptr + t).to(tl.float32)
        sg = (1.0 / (1.0 + tl.exp(-sg))).to(dtype).to(tl.float32)
        shared = tl.load(shared_ptr + t * H + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        mlp = (total + (sg * shared).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if RESIDUAL:
            r = tl.load(res_ptr + t * H + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            mlp = r + mlp
        tl.store(out_ptr + t * H + offs_n, mlp.to(dtype), mask=mask_n)


def moe_step(
    x: torch.Tensor | None,  # [T, H] residual stream (the block's input before its norm); None: no residual
    h: torch.Tensor,  # [T, H] post_attention_layernorm(x)
    router: torch.Tensor,  # [E, H]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    shared_gate: torch.Tensor,  # [Is, H] shared expert gate_proj
    shared_up: torch.Tensor,  # [Is, H]
    shared_down: torch.Tensor,  # [H, Is]
    shared_expert_gate: torch.Tensor,  # [1, H]
    top_k: int,
    renorm: bool,
) -> torch.Tensor:
    """Returns x + SparseMoeBlock(h) [T, H] (SparseMoeBlock(h) alone when x is None)."""
    from nextn.ops.triton_linear import skinny_linear

    T, H = h.shape
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    logits = skinny_linear(h, router)  # [T, E] in the model dtype, like the reference
    idx = torch.empty(T, top_k, device=h.device, dtype=torch.int32)
    weights = torch.empty(T, top_k, device=h.device, dtype=h.dtype)
    _route_kernel[(T,)](logits, idx, weights, E=E, TOP_K=top_k, BLOCK_E=next_pow2(E), RENORM=renorm, num_warps=4)
    act = torch.empty(T * top_k, I, device=h.device, dtype=h.dtype)
    _gate_up_kernel[(T * top_k, triton.cdiv(I, 16))](
        h, idx, gate_up, act, H, I, TOP_K=top_k, BLOCK_N=16, BLOCK_K=256, num_warps=4
    )
    y = torch.empty(T * top_k, H, device=h.device, dtype=h.dtype)
    _down_kernel[(T * top_k, triton.cdiv(H, 32))](
        act, idx, weights, down, y, H, I, BLOCK_N=32, BLOCK_K=256, num_warps=4
    )
    shared = skinny_linear(skinny_linear(h, shared_gate, up_weight=shared_up), shared_down)
    sg = skinny_linear(h, shared_expert_gate)  # [T, 1]
    out = torch.empty_like(h)
    _combine_kernel[(T, triton.cdiv(H, 256))](
        y, shared, sg, h if x is None else x, out, H, TOP_K=top_k, BLOCK_N=256, RESIDUAL=x is not None, num_warps=4
    )
    return out
