"""What every Triton kernel of nextn shares: whether Triton runs at all here, and the interpreter flag.

Under `TRITON_INTERPRET=1` (CPU tests) Triton's interpreter multiplies bf16 `tl.dot` operands as
raw 16-bit patterns (triton <= 3.9), so kernels upcast dot operands to float32 there (`DOT_F32`).
On a GPU the operands stay bf16 and the dot runs on the tensor cores.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

# probe without importing: triton decides at import whether it interprets (TRITON_INTERPRET),
# and the kernel modules import it only when a fast path is built
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter: Triton's own setting (its knob, read
    from TRITON_INTERPRET when asked: tests set it late), never one of ours."""
    if not HAVE_TRITON:
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def pdl_supported(tensor) -> bool:
    """Whether a launch beside `tensor` can be a programmatic dependent launch (PDL: the kernel
    starts before the one ahead of it has finished and waits for it in-kernel): a CUDA device of
    compute capability 9 or later (Hopper), not the interpreter.

    nextn's kernels keep one rule. A kernel launched as a dependent (`launch_pdl=True`) calls
    `gdc_wait` before it writes anything or reads what the launch right before it may write. What it
    reads before the wait from launches further back (the MoE down kernel the router's expert ids,
    the GDN step its recurrent state) has completed when it starts if the launch right ahead is a
    plain launch or a dependent that releases the launch after it (`gdc_launch_dependents`) only once
    past its own wait. A dependent that releases before its wait (the MoE down kernel over several
    rows) is followed by a launch that reads nothing before its wait (the skinny GEMM)."""
    return tensor.is_cuda and not interpreting() and _hopper_or_later(tensor.device.index)


def row_launch(hopper: bool, rows: int) -> tuple[bool, int]:
    """(dependent, release) of a step kernel over `rows` rows, `hopper` where PDL is on and the GPU
    has it: the arrangement measured faster at each row count (bench/NOTES.md, runs 99-103). A
    decode's one row is a dependent launch that releases the launch after it once past its own wait
    (release 2); more rows launch plain and release the launch after them at their start (release 1);
    without PDL, (False, 0)."""
    dependent = hopper and rows == 1
    return dependent, 2 if dependent else int(hopper)


@functools.cache
def _hopper_or_later(index: int | None) -> bool:
    """Compute capability 9 or later (a device's, asked once: every eager launch asks)."""
    import torch

    return torch.cuda.get_device_capability(index)[0] >= 9


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the Triton kernels need the `triton` package (pip install triton)")


_COUNTERS: dict = {}  # device -> int32 counters
_OUTGROWN: list = []  # replaced buffers: captured CUDA graphs may still use them


def arrival_counters(device, n: int):
    """Zeroed int32 counters for "the last program to arrive finishes the job" (split-K sums,
    per-head norms); every launch that uses them leaves them zero again. One buffer per device:
    the kernels of a stream run one after another."""
    import torch

    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _COUNTERS[device] = torch.zeros(max(n, 1 << 14), device=device, dtype=torch.int32)
    return buf


class _Compiles:
    count = 0  # kernels compiled in this process since `watch_compiles`
    warming = 0  # engines warming up now (their compiles are expected)
    settled = False  # an engine's warm-up has ended: each compile outside a warm-up is logged
    installed = False


def watch_compiles(warming: bool) -> None:
    """Count the Triton kernels this process compiles (Triton's post-compile hook; chained after one
    already set) from the first call on. warming=True: an engine's warm-up begins; False: it has
    ended. A compile while no engine warms up, after one has, is logged as a warning naming the
    kernel and its specialisation, since the request that met it waited for it (a compile takes a
    second or more). Does nothing without Triton or interpreting."""
    if not HAVE_TRITON or interpreting():
        return
    _Compiles.warming = max(0, _Compiles.warming + (1 if warming else -1))
    _Compiles.settled = _Compiles.settled or not warming
    if _Compiles.installed:
        return
    from triton import knobs

    before = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        _Compiles.count += 1
        if _Compiles.settled and not _Compiles.warming:
            fn, compiled = kwargs.get("fn"), kwargs.get("compile") or {}
            logging.getLogger("nextn.ops").warning(
                "Triton compiled a kernel variant after the warm-up (the step that met it waited): %s, "
                "warps %s, specialisation %s",
                getattr(fn, "name", "?"),
                compiled.get("num_warps"),
                str(compiled.get("key", "?"))[:600],
            )
        return before(*args, **kwargs) if before is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    _Compiles.installed = True


def compile_count() -> int:
    """Triton kernels compiled since `watch_compiles` was first called (0 before)."""
    return _Compiles.count
