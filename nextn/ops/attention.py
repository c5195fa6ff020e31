"""Attention over many query rows (prefill, training): the plain PyTorch reference. The decode /
verify step's attention is nextn.layers.attention.attend_step; the fast prefill path is
nextn.ops.triton_attention.prefill_attention.
"""

from __future__ import annotations

import torch

from nextn.config import STEP_ROWS


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q [1, T, Hq, D] at positions start..start+T-1 over keys / values [1, start+T, Hkv, D]
    (the cache up to the last query): query t sees positions <= start + t."""
    T = q.shape[1]
    rows = torch.arange(T, device=q.device)[:, None] + start
    mask = torch.arange(start + T, device=q.device)[None, :] <= rows
    return attend(q, keys, values, mask, False)


def attend(q, k, v, mask, is_causal):
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D] (GQA by repeating kv heads).

    Fewer than STEP_ROWS query rows are padded to STEP_ROWS (masked like the last real row) so
    each row's matmuls do not depend on the row count: decode and verify agree bitwise.
    """
    B, T = q.shape[:2]
    groups = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    S = k.shape[2]
    if is_causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if T < STEP_ROWS:
        q = torch.cat([q, q.new_zeros(B, q.shape[1], STEP_ROWS - T, q.shape[3])], dim=2)
        mask = torch.cat([mask, mask[-1:].expand(STEP_ROWS - T, S)])
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, Hq, rows, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return (probs @ v)[:, :, :T].transpose(1, 2)
