"""Row-wise zero-centred RMSNorm, `x_hat * (1 + w)`, one program per row: a row's result does not
depend on how many rows the call has. Reference: `nextn.layers.norm.RMSNorm`.
"""

from __future__ import annotations

import torch

from nextn.ops.triton_utils import HAVE_TRITON, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, w_ptr, y_ptr, flag_ptr, D, stride_x, stride_y, eps, BLOCK_D: tl.constexpr, HAS_FLAG: tl.constexpr
    ):
        if HAS_FLAG:  # run_if (nextn.engine.runner.ModelRunner.when): 0 skips the call
            if tl.load(flag_ptr).to(tl.int32) == 0:
                return
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = x * rstd * (1.0 + w)
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
    M, D = x.shape
    if out is None:
        out = torch.empty_like(x)
    _rms_norm_kernel[(M,)](
        x,
        weight,
        out,
        x if run_if is None else run_if,
        D,
        x.stride(0),
        out.stride(0),
        eps,
        BLOCK_D=next_pow2(D),
        HAS_FLAG=run_if is not None,
        num_warps=4 if D <= 4096 else 8,
    )
    return out
