"""What every Triton kernel of nextn shares: whether Triton runs at all here, and the interpreter flag.

Under `TRITON_INTERPRET=1` (CPU tests) Triton's interpreter multiplies bf16 `tl.dot` operands as
raw 16-bit patterns (triton <= 3.9), so kernels upcast dot operands to float32 there (`DOT_F32`).
On a GPU the operands stay bf16 and the dot runs on the tensor cores.
"""
from __future__ import annotations

import importlib.util
import os

# probe without importing: triton decides at import whether it interprets (TRITON_INTERPRET),
# and the kernel modules import it only when a fast path is built
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (read when asked: tests set it late)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the Triton kernels need the `triton` package (pip install triton)")
