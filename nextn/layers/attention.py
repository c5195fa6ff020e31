"""Gated full attention (Qwen3.5 / Qwen3-Next): q_proj emits [query | gate] per head, per-head
q/k RMSNorm, partial NEOX RoPE, attention over the layer's K/V cache, output * sigmoid(gate).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextn.cache import LayerKV
from nextn.config import ModelConfig
from nextn.layers.norm import RMSNorm
from nextn.layers.rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [T, rotary_dim]
        sin: torch.Tensor,
        kv: LayerKV | None,
        start: int,  # position of x's first token
    ) -> torch.Tensor:
        B, T, _ = x.shape
        qg = self.q_proj(x).view(B, T, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if kv is None:  # whole-sequence forward (training): plain causal attention
            keys, values, is_causal, mask = k, v, True, None
        else:
            kv.write(start, k, v)
            keys, values = kv.key[:, : start + T], kv.value[:, : start + T]
            # query t (position start+t) sees positions <= start+t
            rows = torch.arange(T, device=x.device)[:, None] + start
            mask = torch.arange(start + T, device=x.device)[None, :] <= rows
            is_causal = False
        o = attend(q, keys, values, mask, is_causal)
        o = o.reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(o)


def attend(q, k, v, mask, is_causal):
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D] (GQA by repeating kv heads)."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, Hq, T, S]
    if is_causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return (probs @ v).transpose(1, 2)
