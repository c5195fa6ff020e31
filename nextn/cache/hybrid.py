"""Caches of the hybrid trunk, allocated up front: attention K/V per full-attention layer,
conv window and recurrent state per Gated DeltaNet layer, plus the per-token states a
multi-token step keeps until `commit` says how many of its tokens stay (speculative rollback).

Owns: tensors and their bookkeeping. Does not know about models, tokens or sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nextn.config import FULL, ModelConfig


KV_BLOCK = 64  # K/V storage is allocated in whole blocks (the step attention reads whole blocks)


class LayerKV:
    """K/V of one attention layer over positions [0, max_len): append-only, position-addressed."""

    def __init__(self, batch: int, max_len: int, num_kv_heads: int, head_dim: int, device, dtype):
        capacity = -(-max_len // KV_BLOCK) * KV_BLOCK
        self.max_len = max_len
        self.key = torch.zeros(batch, capacity, num_kv_heads, head_dim, device=device, dtype=dtype)
        self.value = torch.zeros_like(self.key)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"cache overflow: {end} positions > capacity {self.max_len}")
        self.key[:, start:end] = k
        self.value[:, start:end] = v


@dataclass
class StepStash:
    """What a keep-states step leaves per GDN layer until commit."""

    window: torch.Tensor  # [B, D, W-1+T]: carried conv columns then the step's inputs
    states: torch.Tensor  # [B, T, HV, K, V] float32: recurrent state after each step token


@dataclass
class CacheSnapshot:
    seq_len: int
    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.conv, self.recurrent) for t in d.values())


class HybridCache:
    def __init__(self, cfg: ModelConfig, max_len: int, device, dtype, batch: int = 1):
        self.cfg = cfg
        self.max_len = max_len
        self.seq_len = 0  # committed positions
        self.kv: dict[int, LayerKV] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.stash: dict[int, StepStash] = {}
        self.step_tokens = 0  # tokens of the last keep-states step, awaiting commit
        for i, kind in enumerate(cfg.layer_types):
            if kind == FULL:
                self.kv[i] = LayerKV(batch, max_len, cfg.num_key_value_heads, cfg.head_dim, device, dtype)
            else:
                W = cfg.linear_conv_kernel_dim
                self.conv[i] = torch.zeros(batch, cfg.conv_dim, W - 1, device=device, dtype=dtype)
                self.recurrent[i] = torch.zeros(
                    batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                    device=device, dtype=torch.float32,
                )

    def commit(self, num_kept: int) -> None:
        """Keep the first `num_kept` tokens of the last keep-states step; drop the rest.

        Attention K/V past the kept tokens are simply outside seq_len. GDN layers take the conv
        window and recurrent state as they were after the last kept token.
        """
        if not 1 <= num_kept <= self.step_tokens:
            raise ValueError(f"commit({num_kept}) after a step of {self.step_tokens} tokens")
        W = self.cfg.linear_conv_kernel_dim
        for i, s in self.stash.items():
            self.conv[i].copy_(s.window[:, :, num_kept : num_kept + W - 1])
            self.recurrent[i].copy_(s.states[:, num_kept - 1])
        self.stash.clear()
        self.seq_len += num_kept
        self.step_tokens = 0

    def discard_step(self) -> None:
        """Keep none of the last keep-states step (one queued ahead whose input turned out to
        follow a stop). Its K/V writes lie beyond seq_len; the committed GDN state was never
        touched."""
        self.stash.clear()
        self.step_tokens = 0

    def snapshot(self) -> CacheSnapshot:
        """A copy of the in-place state; attention K/V need none (truncation restores them)."""
        return CacheSnapshot(
            self.seq_len,
            {i: t.clone() for i, t in self.conv.items()},
            {i: t.clone() for i, t in self.recurrent.items()},
        )

    def restore(self, snap: CacheSnapshot) -> None:
        if snap.seq_len > self.seq_len:
            raise ValueError("cannot restore a snapshot from beyond the cache's committed length")
        for i, t in snap.conv.items():
            self.conv[i].copy_(t)
        for i, t in snap.recurrent.items():
            self.recurrent[i].copy_(t)
        self.seq_len = snap.seq_len
        self.stash.clear()
        self.step_tokens = 0

    @property
    def nbytes(self) -> int:
        n = sum(kv.key.numel() * kv.key.element_size() * 2 for kv in self.kv.values())
        return n + sum(t.numel() * t.element_size() for d in (self.conv, self.recurrent) for t in d.values())
