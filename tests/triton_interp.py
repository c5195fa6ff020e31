"""Run Triton kernels on the CPU the way a GPU computes them.

Imported by the kernel tests before triton is: on a machine without CUDA it turns on Triton's
interpreter (TRITON_INTERPRET=1) and fixes two of its roundings: the interpreter truncates float32
-> bf16 casts, where the GPU rounds to nearest even (what PyTorch does too), so without the fix a
kernel that rounds intermediates like its reference drifts from it by a few ulps on CPU only; and
its float32 -> e4m3 cast rounds ties away from zero and can carry a mantissa overflow into the
wrong exponent, where the GPU (cvt.rn.satfinite) and PyTorch round to nearest even.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_bf16_rounding() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.float8_e4m3fn)
            return interpreter.TensorHandle(rounded.view(torch.uint8).numpy(), tl.float8e4nv)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp


if not CUDA and os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _patch_bf16_rounding()
    except ImportError:  # no triton: the tests that need it skip themselves
        pass
