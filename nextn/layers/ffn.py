"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block (softmax top-k router,
fused 3-D expert weights, sigmoid-gated shared expert)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextn.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Expert weights fused as checkpoints of transformers 5 store them (per-expert checkpoints are packed by the loader)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x, top_idx, top_w):
        """x [N, H]; top_idx, top_w [N, k] -> [N, H]."""
        out = torch.zeros_like(x)
        for e in top_idx.unique().tolist():
            rows, slot = torch.where(top_idx == e)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, (y * top_w[rows, slot, None]).to(out.dtype))
        return out


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, x):
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
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
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_idx, top_w = self.gate(x)
        out = self.experts(x, top_idx, top_w)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)
