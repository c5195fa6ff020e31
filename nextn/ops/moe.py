"""Routed experts of a sparse MoE block: the plain PyTorch reference (CPU path and the oracle of
the grouped-GEMM kernel, nextn.ops.triton_moe_grouped). FP8 (or Q8_0) experts (nextn.ops.fp8.QuantWeight)
are dequantized one routed expert at a time: a stack of 512 experts is never copied whole into the
activations' dtype (the 80B's 3.2 GB a layer in bf16, more than the headroom one GPU leaves)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextn.ops.fp8 import QuantWeight, dequantize
from nextn.ops.linear import pad_rows, row_invariant_linear


def routed_experts(x, top_idx, top_w, gate_up, down):
    """x [N, H]; top_idx, top_w [N, k]; gate_up [E, 2I, H]; down [E, H, I] (tensors, or QuantWeight
    with scales [E, ceil(K / 128), N]) -> [N, H].

    Each (token, slot) output is computed alone, then slots are summed in slot order, so a
    token's result does not depend on which other tokens share the call.
    """
    per_slot = x.new_zeros(x.shape[0], top_idx.shape[1], x.shape[1])  # [N, k, H]
    for e in top_idx.unique().tolist():
        rows, slot = torch.where(top_idx == e)
        xe = pad_rows(x[rows])  # small groups run at the fixed step shape (elementwise ops too)
        gate, up = row_invariant_linear(xe, _expert(gate_up, e, x.dtype)).chunk(2, dim=-1)
        per_slot[rows, slot] = row_invariant_linear(F.silu(gate) * up, _expert(down, e, x.dtype))[: rows.numel()]
    out = per_slot[:, 0] * top_w[:, 0, None]
    for s in range(1, top_idx.shape[1]):
        out = out + per_slot[:, s] * top_w[:, s, None]
    return out


def _expert(w: torch.Tensor | QuantWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix of a stack, an FP8 one dequantized to dtype (what `dequantize` of the whole
    stack gives for it, bit for bit: the values are elementwise)."""
    return dequantize(w.weight[e], w.scale[e], dtype) if isinstance(w, QuantWeight) else w[e]
