"""Zero-centred RMSNorm, `x_hat * (1 + w)`: the plain PyTorch reference (the modules' math; the
fast path is nextn.ops.triton_norm.rms_norm)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] stored around 0."""
    xf = x.float().contiguous()  # a reduction's order can depend on strides: fix them
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)
