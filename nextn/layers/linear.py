"""nn.Linear computed row-invariantly (nextn.ops.linear), under the checkpoint's parameter names;
and its quantized form (FP8, or GGUF's Q8_0), whose weight the forward dequantizes (nextn.ops.fp8)."""

from __future__ import annotations

import torch
from torch import nn

from nextn.ops.fp8 import FP8, Format, QuantWeight, dequantize, scale_shape
from nextn.ops.linear import row_invariant_linear


class Linear(nn.Linear):
    """nn.Linear (same parameter names) computed row-invariantly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(x, self.weight, self.bias)


class QuantLinear(nn.Module):
    """A Linear whose `weight` is e4m3 [out, in] with `weight_scale` [ceil(in / 128), out] float32 in
    nextn's layout (nextn.ops.fp8), or in another format (fmt: Q8_0's int8 with float16 scales [in /
    32, out]); the bias, if any, stays in the model's dtype. The forward (the reference path)
    dequantizes the weight to the input's dtype; the step kernels read the quantized bytes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, fmt: Format = FP8):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=fmt.values), requires_grad=False)
        shape = scale_shape(out_features, in_features, fmt.block)
        self.weight_scale = nn.Parameter(torch.empty(shape, dtype=fmt.scale), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def fp8(self) -> QuantWeight:
        return QuantWeight(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)
