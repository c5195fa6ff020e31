"""Gated DeltaNet mixer (the glue around the ops): projections, causal conv, gates, the delta
rule, gated RMSNorm, output projection.

Two projection layouts, one mixer: Qwen3.5 stores `in_proj_qkv` ([q all | k all | v all]),
`in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next fuses them into `in_proj_qkvz` / `in_proj_ba`
grouped per key head, which the loader regroups at load time into [q all | k all | v all | z all]
and [b all | a all] (nextn.models.loader), so both split the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextn.cache import SlotCache, StepBatch
from nextn.config import STEP_ROWS
from nextn.config.model import ModelConfig
from nextn.layers.linear import Linear
from nextn.layers.norm import RMSNormGated
from nextn.ops import Ops
from nextn.ops import conv as conv_ops
from nextn.ops import gdn as gdn_ops
from nextn.ops.linear import pad_dim1


class _ConvWeight(nn.Module):
    """Holds `conv1d.weight` [D, 1, W] under the checkpoint's name."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.contiguous()  # a reduction's order can depend on strides: fix them
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.conv1d = _ConvWeight(cfg.conv_dim, cfg.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)
        self._init_projections(cfg)

    def _init_projections(self, cfg: ModelConfig) -> None:
        H = cfg.hidden_size
        self.in_proj_qkv = Linear(H, cfg.conv_dim, bias=False)
        self.in_proj_z = Linear(H, self.value_dim, bias=False)
        self.in_proj_b = Linear(H, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(H, self.num_v_heads, bias=False)

    def project(self, x: torch.Tensor):
        """x [B, T, H] -> mixed_qkv [B, T, conv_dim], z [B, T, value_dim], b, a [B, T, HV]."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(
        self, x: torch.Tensor, cache: SlotCache | StepBatch | None, ops: Ops, store_all: bool | tuple[bool, ...] = True
    ) -> torch.Tensor:
        """x [B, T, H]. A SlotCache or None: prefill or training (the Ops table's chunked rule; with
        a cache the final states go to the write halves). A StepBatch: a step, x [1, M, H] holding its sequences'
        rows; each runs the recurrent rule from its slot's committed states, and its window and
        the state after each token (or the last only if not store_all: one flag, or one a sequence) go
        to its step buffers; with StepBatch.chunked, a sequence not keeping every state runs the
        chunked rule (the Ops table's) instead, as a prefill with its SlotCache does."""
        B, T, _ = x.shape
        mixed_qkv, z, b, a = self.project(x)
        if isinstance(cache, StepBatch):  # each sequence's rows padded to whole STEP_ROWS tiles, like a step alone
            parts = []
            for s, slot in enumerate(cache.caches):
                rows, n = slice(cache.offsets[s], cache.offsets[s + 1]), cache.rows[s]
                mixed = [pad_dim1(t[:, rows], -(-n // STEP_ROWS) * STEP_ROWS) for t in (mixed_qkv, b, a)]
                keep = store_all[s] if isinstance(store_all, tuple) else store_all
                if not keep and cache.chunked:  # a prompt piece by the chunked rule, from its committed state
                    parts.append(self._mix(*(t[:, rows] for t in (mixed_qkv, b, a)), slot, ops, False))
                    continue
                parts.append(self._mix(*mixed, slot, None, keep, n)[:, :n])
            o = pad_dim1(torch.cat(parts, dim=1), T)  # the batch's pad rows stay zero
        else:
            o = self._mix(mixed_qkv, b, a, cache, ops, store_all)
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(B, T, self.value_dim).to(x.dtype))

    def _mix(
        self, mixed_qkv, b, a, cache: SlotCache | None, ops: Ops | None, store_all: bool, n: int = 0
    ) -> torch.Tensor:
        """Conv, gates and the delta rule of one sequence (or a training batch) -> o [B, T, HV, V].
        ops None: a step whose first n rows are real (the recurrent rule, states to the step
        buffers); else the chunked rule."""
        i = self.layer_idx
        conv_state, initial = self.committed(cache) if cache is not None else (None, None)
        q, k, v, g, beta, window = self._inputs(mixed_qkv, b, a, conv_state)
        initial = None if initial is None else initial[None]
        W = self.conv1d.weight.shape[-1]
        if ops is None:
            o, states = gdn_ops.recurrent_gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], initial)
            if store_all:  # a verify: its whole window, its base state (the fold) and its rows' gates
                cache.write_step(i, window[0, :, : W - 1 + n], initial[0], torch.cat([b[0, :n], a[0, :n]], -1))
            else:  # a prefill step (any number of rows): the window's last W-1 columns, the last state
                cache.write_step(i, window[0, :, n : n + W - 1], states[0, -1])
        else:
            o, final = ops.chunk_rule(q, k, v, g, beta, initial)
            if cache is not None:  # the last state and conv columns (the caller commits the chunk)
                cache.write_step(i, window[0, :, window.shape[-1] - (W - 1) :], final[0])
        return o

    def _inputs(self, mixed_qkv, b, a, conv_state):
        """The delta rule's inputs (q, k, v, g, beta) and the conv window of rows mixed_qkv [B, T,
        conv_dim], b, a [B, T, HV] after the carried conv columns conv_state [D, W-1] (None: zeros)."""
        B, T, _ = mixed_qkv.shape
        mixed_qkv, window = conv_ops.causal_conv1d(
            mixed_qkv, self.conv1d.weight.squeeze(1), None if conv_state is None else conv_state[None]
        )
        q, k, v = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(B, T, self.num_k_heads, self.head_k_dim).float())
        k = l2norm(k.reshape(B, T, self.num_k_heads, self.head_k_dim).float())
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        beta, g = self.gates(b, a)
        return q, k, v, g, beta, window

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(beta, g) of gate inputs b, a [..., HV]: sigmoid(b) in their dtype, the log decay
        -exp(A_log) * softplus(a + dt_bias) in float32."""
        # contiguous: a CPU elementwise op's bits can depend on strides (vectorised or not), and b, a
        # come as views of a projection or of the stored gates
        beta = b.contiguous().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.contiguous().float() + self.dt_bias.float())
        return beta, g

    def committed(self, cache: SlotCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv columns [D, W-1], recurrent state [HV, K, V]) after the slot's committed tokens:
        the base state advanced by the pending rows (nextn.cache.hybrid), each row as a step runs
        it (the same bits as the state the step held after that row)."""
        parts = cache.gdn_parts(self.layer_idx)
        if parts.rows is None:
            return parts.conv, parts.base
        W, HV, P = self.conv1d.weight.shape[-1], self.num_v_heads, parts.gates.shape[0]
        # padded to whole STEP_ROWS tiles like the step that ran them (a reduction's order can depend on shape)
        inputs = pad_dim1(parts.rows[:, W - 1 :].T[None], STEP_ROWS)  # [1, STEP_ROWS, D]
        gates = pad_dim1(parts.gates[None], STEP_ROWS)
        q, k, v, g, beta, _ = self._inputs(inputs, gates[..., :HV], gates[..., HV:], parts.rows[:, : W - 1])
        rows = (t[:, :P] for t in (q, k, v, g, beta))
        _, states = gdn_ops.recurrent_gated_delta_rule(*rows, parts.base[None])
        return parts.conv, states[0, -1]


class GatedDeltaNetNext(GatedDeltaNet):
    """Qwen3-Next: in_proj_qkvz and in_proj_ba (stored per key head in the checkpoint)."""

    def _init_projections(self, cfg: ModelConfig) -> None:
        H = cfg.hidden_size
        self.in_proj_qkvz = Linear(H, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = Linear(H, 2 * self.num_v_heads, bias=False)

    def project(self, x: torch.Tensor):
        """The loader stored the rows regrouped: [q all | k all | v all | z all] and [b all | a all]."""
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        return qkvz[..., : -self.value_dim], qkvz[..., -self.value_dim :], *ba.chunk(2, dim=-1)
