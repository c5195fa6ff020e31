"""Gated delta rule: plain PyTorch references (the CPU path and the oracle for fast kernels).

Vocabulary and shapes follow flash-linear-attention: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta
[B, T, HV]; states [B, HV, K, V] in float32. HV may be a multiple of H (grouped heads): each q/k head
serves HV // H consecutive value heads. q and k arrive L2-normalised; the 1/sqrt(K) query scale is
applied here.

The recurrence, per value head, for t = 0..T-1:
    S_t = exp(g_t) * S_{t-1};  S_t += k_t (beta_t * (v_t - S_t^T k_t))^T;  o_t = S_t^T (q_t * K**-0.5)

Two forms of one function:
- `chunk_gated_delta_rule`: chunked (WY / UT transform) form for prefill; final state only.
- `recurrent_gated_delta_rule`: token-by-token form for decode and verify; returns the state
  after every token, which is what speculative rollback restores from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nextn.config import GDN_CHUNK


def _expand_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int):
    groups = num_v_heads // q.shape[2]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    return q, k


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [B, T, H, K]
    k: torch.Tensor,  # [B, T, H, K]
    v: torch.Tensor,  # [B, T, HV, V]
    g: torch.Tensor,  # [B, T, HV]
    beta: torch.Tensor,  # [B, T, HV]
    initial_state: torch.Tensor | None = None,  # [B, HV, K, V] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [B, T, HV, V] in v's dtype, states [B, T, HV, K, V] float32: state after each token)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    q, k = _expand_heads(q, k, HV)
    q = q.float() * K**-0.5
    k, v, g, beta = k.float(), v.float(), g.float(), beta.float()
    state = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.float()
    outs, states = [], []
    # elementwise products and fixed-axis sums: token t's arithmetic does not depend on T
    for t in range(T):
        k_t, q_t = k[:, t].contiguous(), q[:, t].contiguous()  # [B, HV, K]
        state = state * g[:, t].exp()[..., None, None]
        kv_mem = (state * k_t[..., None]).sum(-2)  # [B, HV, V]
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k_t[..., None] * delta[:, :, None, :]
        outs.append((state * q_t[..., None]).sum(-2))
        states.append(state)
    o = torch.stack(outs, dim=1).to(out_dtype)
    return o, torch.stack(states, dim=1)


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [B, T, H, K]
    k: torch.Tensor,  # [B, T, H, K]
    v: torch.Tensor,  # [B, T, HV, V]
    g: torch.Tensor,  # [B, T, HV]
    beta: torch.Tensor,  # [B, T, HV]
    initial_state: torch.Tensor | None = None,  # [B, HV, K, V] float32
    chunk_size: int = GDN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [B, T, HV, V], final_state [B, HV, K, V] float32). Differentiable (used to train)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    q, k = _expand_heads(q, k, HV)
    # [B, HV, T, *] in float32
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    q = q * K**-0.5
    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n_chunks = (T + pad) // chunk_size
    C = chunk_size

    def chunks(x):  # [B, HV, T', D] -> [B, HV, N, C, D]
        return x.reshape(B, HV, n_chunks, C, x.shape[-1])

    k_beta = chunks(k * beta[..., None])
    v_beta = chunks(v * beta[..., None])
    q, k = chunks(q), chunks(k)
    g_cum = g.reshape(B, HV, n_chunks, C).cumsum(-1)  # log decay from chunk start to t (inclusive)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    # UT transform: (I + A) u = v_beta, (I + A) w = k_beta * exp(g_cum), A strictly lower
    A = (k_beta @ k.transpose(-1, -2) * decay).masked_fill(~strict, 0.0)
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    u = torch.linalg.solve_triangular(eye + A, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(eye + A, k_beta * g_cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2) * decay).masked_fill(~causal, 0.0)
    q_decayed = q * g_cum.exp()[..., None]
    k_to_end = k * (g_cum[..., -1:] - g_cum).exp()[..., None]
    chunk_decay = g_cum[..., -1].exp()[..., None, None]  # [B, HV, N, 1, 1]

    state = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.float()
    outs = []
    for i in range(n_chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    o = torch.cat(outs, dim=2)[:, :, :T]  # [B, HV, T, V]
    return o.transpose(1, 2).contiguous().to(out_dtype), state
