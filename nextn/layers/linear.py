"""nn.Linear computed row-invariantly (nextn.ops.linear), under the checkpoint's parameter names;
and its FP8 form, whose e4m3 weight the forward dequantizes (nextn.ops.fp8)."""

from __future__ import annotations

import torch
from torch import nn

from nextn.ops.fp8 import E4M3, FP8Weight, dequantize, scale_shape
from nextn.ops.linear import row_invariant_linear


class Linear(nn.Linear):
    """nn.Linear (same parameter names) computed row-invariantly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(x, self.weight, self.bias)


class FP8Linear(nn.Module):
    """A Linear whose `weight` is e4m3 [out, in] with `weight_scale` [ceil(in / 128), out] in nextn's
    layout (nextn.ops.fp8); the bias, if any, stays in the model's dtype. The forward (the reference
    path) dequantizes the weight to the input's dtype; the step kernels read the e4m3 bytes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=E4M3), requires_grad=False)
        shape = scale_shape(out_features, in_features)
        self.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def fp8(self) -> FP8Weight:
        return FP8Weight(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)
