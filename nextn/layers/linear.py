"""nn.Linear computed row-invariantly (nextn.ops.linear), under the checkpoint's parameter names."""

from __future__ import annotations

import torch
from torch import nn

from nextn.ops.linear import row_invariant_linear


class Linear(nn.Linear):
    """nn.Linear (same parameter names) computed row-invariantly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(x, self.weight, self.bias)
