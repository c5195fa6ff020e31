"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block (softmax top-k router,
fused 3-D expert weights, in the model's dtype or FP8, sigmoid-gated shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextn.config.model import ModelConfig
from nextn.layers.linear import Linear
from nextn.ops import OPS, Ops
from nextn.ops.fp8 import FP8, Format, QuantWeight, scale_shape
from nextn.ops.linear import row_invariant_linear

REFERENCE_OPS = OPS["torch"]()


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops | None = None) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Expert weights fused as checkpoints of transformers 5 store them (per-expert checkpoints are
    packed by the loader), computed by the Ops table's `routed_experts`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x, top_idx, top_w, ops: Ops):
        """x [N, H]; top_idx, top_w [N, k] -> [N, H]."""
        return ops.routed_experts(x, top_idx, top_w, self.gate_up_proj, self.down_proj)


class QuantExperts(nn.Module):
    """Experts whose fused weights are e4m3, each with `*_scale` [E, ceil(in / 128), out] in nextn's
    layout (nextn.ops.fp8), or in another format (fmt: Q8_0's int8 with float16 scales [E, in / 32,
    out]). The forward hands them to the Ops table's `routed_experts` as QuantWeight pairs: the
    reference dequantizes the routed experts one at a time, the grouped GEMM
    (nextn.ops.triton_moe_grouped) tile by tile; neither copies the stack into the input's dtype."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, fmt: Format = FP8):
        super().__init__()
        shapes = {"gate_up_proj": (2 * intermediate_size, hidden_size), "down_proj": (hidden_size, intermediate_size)}
        for name, (n, k) in shapes.items():
            weight = torch.empty(num_experts, n, k, dtype=fmt.values)
            scale = torch.empty(num_experts, *scale_shape(n, k, fmt.block), dtype=fmt.scale)
            self.register_parameter(name, nn.Parameter(weight, requires_grad=False))
            self.register_parameter(f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def forward(self, x, top_idx, top_w, ops: Ops):
        """x [N, H]; top_idx, top_w [N, k] -> [N, H]."""
        gate_up = QuantWeight(self.gate_up_proj, self.gate_up_proj_scale)
        down = QuantWeight(self.down_proj, self.down_proj_scale)
        return ops.routed_experts(x, top_idx, top_w, gate_up, down)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, x):
        probs = torch.softmax(row_invariant_linear(x, self.weight).float(), dim=-1)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_idx, top_w.to(x.dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops | None = None) -> torch.Tensor:
        """x [B, T, H]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_idx, top_w = self.gate(x)
        routed = self.experts(x, top_idx, top_w, ops or REFERENCE_OPS)
        out = routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)
