"""Causal depthwise conv1d + SiLU over a step's T tokens, with the carried window written out for
rollback. Reference: `nextn.ops.conv.causal_conv1d` (taps summed in order, each product and sum
rounded to the input dtype, so this kernel matches it bitwise). Per token and per channel, so a
token's output does not depend on T.
"""
from __future__ import annotations

import torch

from nextn.ops.triton_utils import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])  # one compiled kernel for decode and verify
    def _conv_step_kernel(
        x_ptr, stride_x,  # [T, D] step inputs (the first D columns of each row)
        w_ptr,  # [D, W] taps
        state_ptr,  # [D, W-1] carried input columns before the step
        window_ptr, stride_win,  # [D, >= W-1+T] out: the state's columns, then the inputs
        y_ptr, stride_y,  # [T, D] out: silu(conv)
        T, D,
        W: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        dtype = x_ptr.dtype.element_ty
        for j in tl.static_range(W - 1):
            col = tl.load(state_ptr + offs * (W - 1) + j, mask=mask, other=0.0).to(dtype)
            tl.store(window_ptr + offs * stride_win + j, col, mask=mask)
        for t in range(T):
            col = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
            tl.store(window_ptr + offs * stride_win + (W - 1 + t), col, mask=mask)
        for t in range(T):
            y = tl.zeros((BLOCK_D,), tl.float32)
            for j in tl.static_range(W):
                # window column of tap j: a carried column (c < W-1) or input c-(W-1)
                c = tl.zeros((BLOCK_D,), tl.int32) + t + j
                carried = c < W - 1
                from_state = tl.load(state_ptr + offs * (W - 1) + c, mask=mask & carried, other=0.0)
                from_x = tl.load(x_ptr + (c - (W - 1)) * stride_x + offs, mask=mask & (c >= W - 1), other=0.0)
                v = tl.where(carried, from_state.to(dtype), from_x).to(tl.float32)
                tap = tl.load(w_ptr + offs * W + j, mask=mask, other=0.0).to(dtype).to(tl.float32)
                prod = (v * tap).to(dtype).to(tl.float32)
                if j == 0:
                    y = prod
                else:
                    y = (y + prod).to(dtype).to(tl.float32)
            y = (y / (1.0 + tl.exp(-y))).to(dtype)
            tl.store(y_ptr + t * stride_y + offs, y, mask=mask)


def conv_step(
    x: torch.Tensor,  # [T, D] (last dim contiguous; may be a column slice of a wider row)
    weight: torch.Tensor,  # [D, W]
    state: torch.Tensor,  # [D, W-1] contiguous
    window: torch.Tensor,  # [D, >= W-1+T] out, last dim contiguous
    out: torch.Tensor | None = None,  # [T, D]
) -> torch.Tensor:
    T, D = x.shape
    W = weight.shape[1]
    if out is None:
        out = torch.empty(T, D, device=x.device, dtype=x.dtype)
    block_d = 256
    _conv_step_kernel[(triton.cdiv(D, block_d),)](
        x, x.stride(0), weight, state, window, window.stride(0), out, out.stride(0), T, D,
        W=W, BLOCK_D=block_d, num_warps=2,
    )
    return out
