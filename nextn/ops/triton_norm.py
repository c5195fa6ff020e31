"""Row-wise zero-centred RMSNorm, `x_hat * (1 + w)`, one program per row: a row's result does not
depend on how many rows the call has. Reference: `nextn.layers.norm.RMSNorm`.

Before a projection the step does not normalise in a launch of its own: the GEMM after the norm
reads `NormInput` (x * (1 + w) and the partial sums of squares of x's rows) and scales each row's
products by its rstd (nextn.ops.triton_linear.skinny_linear's `rms`); the residual GEMM before it
writes one (its `norm_out`), and `norm_input` makes one from a row where no GEMM wrote it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nextn.ops.triton_utils import HAVE_TRITON, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def rms_rstd(sumsq, D, eps):
        """1 / rms of rows of D values from their sums of squares (every kernel that normalises)."""
        return 1.0 / tl.sqrt(sumsq / D + eps)

    @triton.jit
    def ordered_sum(v):
        """The sums over axis 0 of v [N, M] float32 (N, M >= 16), each added in index order whatever
        v's layout: a float32 dot with ones runs as fused multiply-adds along its k axis in order, where
        tl.sum's tree follows how the tile is spread over threads (its shape and warps). So a GEMM's
        rows get the same sums in 16-row tiles and in wide ones (nextn.ops.triton_linear)."""
        ones = tl.full((16, v.shape[0]), 1.0, tl.float32)
        return tl.max(tl.dot(ones, v, input_precision="ieee"), axis=0)  # (its 16 rows are equal)

    @triton.jit
    def norm_input_values(x, w, axis: tl.constexpr):
        """A NormInput's values for float32 rows x along `axis`: (x * (1 + w), the sums of squares),
        w broadcast to x (the norm kernel's and the residual GEMM's epilogue alike)."""
        return x * (1.0 + w), tl.sum(x * x, axis=axis)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        flag_ptr,
        ss_ptr,
        D,
        stride_x,
        stride_y,
        eps,
        BLOCK_D: tl.constexpr,
        HAS_FLAG: tl.constexpr,
        INPUT: tl.constexpr,  # y = x * (1 + w) and the row's sum of squares at ss_ptr (a NormInput)
    ):
        if HAS_FLAG:  # run_if (nextn.engine.runner.ModelRunner.when): 0 skips the call
            if tl.load(flag_ptr).to(tl.int32) == 0:
                return
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if INPUT:
            y, sumsq = norm_input_values(x, w, 0)
            tl.store(ss_ptr + row, sumsq)
        else:
            y = x * rms_rstd(tl.sum(x * x, axis=0), D, eps) * (1.0 + w)
        tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` over the last dim of x [..., D] (any leading shape): a prefill's norms."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return rms_norm(flat, weight, eps).view(x.shape)


def rms_norm(
    x: torch.Tensor,  # [M, D], last dim contiguous
    weight: torch.Tensor,  # [D]
    eps: float,
    out: torch.Tensor | None = None,  # [M, D] (may be a column slice of a wider buffer)
    run_if: torch.Tensor | None = None,  # [] device flag: 0 skips the call (out is left as it was)
) -> torch.Tensor:
    return _launch(x, weight, eps, out, run_if, None)


class NormInput(NamedTuple):
    """A zero-centred RMSNorm's input as the GEMM after it reads it (skinny_linear's `rms`)."""

    x: torch.Tensor  # [M, D]: the rows times (1 + w), in their dtype
    ss: torch.Tensor  # [P, M] float32: partial sums of squares of the rows, added in order give the row's


def norm_input(x: torch.Tensor, weight: torch.Tensor, run_if: torch.Tensor | None = None) -> NormInput:
    """x [M, D] before the norm of weight [D], as a NormInput (P = 1)."""
    ss = torch.empty(1, x.shape[0], device=x.device, dtype=torch.float32)
    return NormInput(_launch(x, weight, 0.0, None, run_if, ss), ss)


def _launch(x, weight, eps, out, run_if, ss) -> torch.Tensor:
    M, D = x.shape
    if out is None:
        out = torch.empty_like(x)
    _rms_norm_kernel[(M,)](
        x,
        weight,
        out,
        x if run_if is None else run_if,
        x if ss is None else ss,
        D,
        x.stride(0),
        out.stride(0),
        eps,
        BLOCK_D=next_pow2(D),
        HAS_FLAG=run_if is not None,
        INPUT=ss is not None,
        num_warps=4 if D <= 4096 else 8,
    )
    return out
