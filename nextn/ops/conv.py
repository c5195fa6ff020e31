"""Causal depthwise conv1d with a carried window: plain PyTorch reference (prefill and per-token update).

One function serves prefill, 1-token decode and (K+1)-token verify: the input columns are appended
to the carried state and convolved. It returns the whole window so a caller can take the state
after any token (speculative rollback: the state after token t is window[..., t+1 : t+W]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,  # [B, T, D]
    weight: torch.Tensor,  # [D, W]
    state: torch.Tensor | None,  # [B, D, W-1]: the W-1 input columns before x (None = zeros)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (silu(conv(x)) [B, T, D], window [B, D, W-1+T] = cat(state, x^T))."""
    B, T, D = x.shape
    W = weight.shape[1]
    xt = x.transpose(1, 2)
    if state is None:
        state = xt.new_zeros(B, D, W - 1)
    window = torch.cat([state.to(xt.dtype), xt], dim=-1)
    # taps summed in a fixed order, elementwise: an output column does not depend on T
    w = weight.to(xt.dtype)
    y = window[:, :, 0:T] * w[None, :, 0, None]
    for tap in range(1, W):
        y = y + window[:, :, tap : tap + T] * w[None, :, tap, None]
    return F.silu(y).transpose(1, 2), window
