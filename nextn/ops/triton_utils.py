"""What every Triton kernel of nextn shares: whether Triton runs at all here, and the interpreter flag.

Under `TRITON_INTERPRET=1` (CPU tests) Triton's interpreter multiplies bf16 `tl.dot` operands as
raw 16-bit patterns (triton <= 3.9), so kernels upcast dot operands to float32 there (`DOT_F32`).
On a GPU the operands stay bf16 and the dot runs on the tensor cores.
"""
from __future__ import annotations

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # CPU installs without triton: the reference path only
    HAVE_TRITON = False


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the Triton kernels need the `triton` package (pip install triton)")
