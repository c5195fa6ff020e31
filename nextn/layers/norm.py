"""RMS norms of the Qwen3.5 family: zero-centred `x_hat * (1 + w)` and the GDN output's gated norm."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from nextn.ops.norm import rms_norm


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: weights are stored around 0 and applied as (1 + w)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def using(self, ops):
        """This norm through an Ops table's kernel (nextn.ops: a prefill's)."""
        return functools.partial(ops.rms_norm, weight=self.weight, eps=self.eps)


class RMSNormGated(nn.Module):
    """GDN output norm: plain RMSNorm(o) * w * silu(z) (weights are stored around 1)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float().contiguous()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(z.float())).to(dtype)
