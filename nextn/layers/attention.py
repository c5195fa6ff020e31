"""Gated full attention (Qwen3.5 / Qwen3-Next): q_proj emits [query | gate] per head, per-head
q/k RMSNorm, partial NEOX RoPE, attention over the layer's K/V cache, output * sigmoid(gate).

A layer's cache is one sequence's KV (key, value), each [capacity, Hkv, D], position-addressed;
in an fp8 cache each row is written quantized with its scale (nextn.ops.fp8.quantize_rows) and
read dequantized in float32, so every attention (prefill or step) reads what the cache holds. A
step (decode / verify) runs a batch of sequences with their rows packed (nextn.cache.StepBatch):
projections over all rows, attention per sequence over its own cache.
"""

from __future__ import annotations

import torch
from torch import nn

from nextn.cache import KV, StepBatch
from nextn.config import STEP_ROWS
from nextn.config.model import ModelConfig
from nextn.layers.linear import Linear
from nextn.layers.norm import RMSNorm
from nextn.layers.rotary import apply_rotary
from nextn.ops.attention import attend, prefill_attention
from nextn.ops.fp8 import dequantize_rows, quantize_rows
from nextn.ops.linear import pad_dim1

ATTN_BLOCK = 64  # keys per block of the step attention


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [T, rotary_dim]
        sin: torch.Tensor,
        kv: KV | list[KV] | None,  # one sequence's cache (then B = 1), or a step's: one per sequence
        start: int | list[int],  # position of x's first token (a step: of each sequence's first row)
        step: StepBatch | None = None,  # a step: x [1, M, H] holds its sequences' rows
        ops=None,  # the Ops table (nextn.ops) of a prefill: its norm and attention kernels
    ) -> torch.Tensor:
        B, T, _ = x.shape
        qg = self.q_proj(x).view(B, T, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        q_norm, k_norm = (self.q_norm, self.k_norm) if ops is None else (self.q_norm.using(ops), self.k_norm.using(ops))
        q = apply_rotary(q_norm(q), cos, sin)  # (the ops' kernels: a prefill's fast norms)
        k = apply_rotary(k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if kv is None:  # whole-sequence forward (training): plain causal attention
            o = attend(q, k, v, None, True)
        elif step is not None:
            parts = []
            for b, (layer_kv, first) in enumerate(zip(kv, start, strict=True)):
                rows = slice(step.offsets[b], step.offsets[b + 1])
                write_kv(layer_kv, first, k[0, rows], v[0, rows])
                parts.append(attend_step(q[:, rows], layer_kv, first))
            o = pad_dim1(torch.cat(parts, dim=1), T)  # the batch's pad rows stay zero
        else:
            write_kv(kv, start, k[0], v[0])
            keys, values = (t.to(q.dtype)[None] for t in read_kv(kv, 0, start + T))
            o = (prefill_attention if ops is None else ops.attention)(q, keys, values, start)
        o = o.reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(o)


def write_kv(kv: KV, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [T, Hkv, D] at positions start.. (quantized row by row in an fp8 cache)."""
    end = start + k.shape[0]
    if end > kv.key.shape[0]:
        raise ValueError(f"cache overflow: {end} positions > capacity {kv.key.shape[0]}")
    if kv.key_scale is None:
        kv.key[start:end], kv.value[start:end] = k, v
    else:
        kv.key[start:end], kv.key_scale[start:end] = quantize_rows(k)
        kv.value[start:end], kv.value_scale[start:end] = quantize_rows(v)


def read_kv(kv: KV, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions start..end-1 [n, Hkv, D]: as stored, or dequantized to float32."""
    at = slice(start, end)
    if kv.key_scale is None:
        return kv.key[at], kv.value[at]
    return dequantize_rows(kv.key[at], kv.key_scale[at]), dequantize_rows(kv.value[at], kv.value_scale[at])


def attend_step(q: torch.Tensor, kv: KV, start: int) -> torch.Tensor:
    """Attention of one sequence's step rows q [B, n, Hq, D] at positions start.. over the cache:
    in tiles of STEP_ROWS rows (a prefill step's many rows are its tiles one after another)."""
    n = q.shape[1]
    tiles = [_attend_tile(q[:, t : t + STEP_ROWS], kv, start + t) for t in range(0, n, STEP_ROWS)]
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)


def _attend_tile(q: torch.Tensor, kv: KV, start: int) -> torch.Tensor:
    """Attention of q [B, n <= STEP_ROWS, Hq, D] at positions start.. over the cache.

    The rows are padded to STEP_ROWS and keys visited in fixed blocks of ATTN_BLOCK with an
    online softmax, always at the same shapes, so a row's result does not depend on how many rows
    (or later blocks) the step has: a block a row may not see contributes exact zeros. Pad rows
    see what the last real row sees.
    """
    num_real, R, dtype = q.shape[1], STEP_ROWS, q.dtype
    q = torch.cat([q, q.new_zeros(q.shape[0], R - num_real, *q.shape[2:])], dim=1)
    B, R, Hq, D = q.shape
    groups = Hq // kv.key.shape[1]
    row_pos = start + torch.arange(R, device=q.device).clamp(max=num_real - 1)  # [R]
    q = q.transpose(1, 2).float() * D**-0.5  # [B, Hq, R, D]
    m = q.new_full((B, Hq, R, 1), float("-inf"))
    denom = q.new_zeros(B, Hq, R, 1)
    acc = q.new_zeros(B, Hq, R, D)
    for b0 in range(0, start + num_real, ATTN_BLOCK):
        k, v = (t[None].transpose(1, 2).float() for t in read_kv(kv, b0, b0 + ATTN_BLOCK))  # [1, Hkv, BLOCK, D]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        visible = (b0 + torch.arange(k.shape[2], device=q.device))[None, :] <= row_pos[:, None]  # [R, BLOCK]
        scores = (q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))  # [B, Hq, R, BLOCK]
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        p = (scores - m_new).exp()
        scale = (m - m_new).exp()
        denom = denom * scale + p.sum(-1, keepdim=True)
        acc = acc * scale + p @ v
        m = m_new
    return (acc / denom).to(dtype).transpose(1, 2)[:, :num_real]
