"""Run Triton kernels on the CPU the way a GPU computes them.

Imported by the kernel tests before triton is: on a machine without CUDA it turns on Triton's
interpreter (TRITON_INTERPRET=1) and fixes two of its roundings: the interpreter truncates float32
-> bf16 casts, where the GPU rounds to nearest even (what PyTorch does too), so without the fix a
kernel that rounds intermediates like its reference drifts from it by a few ulps on CPU only; and
its float32 -> e4m3 cast rounds ties away from zero and can carry a mantissa overflow into the
wrong exponent, where the GPU (cvt.rn.satfinite) and PyTorch round to nearest even.

It also spares the interpreter work that changes nothing: every call of a @triton.jit helper from
inside a kernel (each tap of a conv, each tl.sigmoid) patches triton.language for the interpreter
again, walking the modules' members (about a sixth of the kernel tests' time), though the launch
already patched them and the patches stay until it ends. Here a helper call inside a launch skips
that when the modules it sees are already patched; outside a launch, or for a module not yet
patched, the interpreter patches as before. The numpy dtype of a Triton type, which the
interpreter looks up for nearly every op by building an 18-entry dict, is kept once found (the
interpreter's own function finds it: the same answer, about a tenth less time). And each int32
+, - and * builds its overflow check (both operands cast to int64, the op again, two compares)
only to hand it to device_assert, which drops it: the interpreter's options are frozen with
debug=False. That work, about a quarter of the time, is skipped while device_assert drops its
conditions (checked here with a false one); with debug on, the check runs as before.
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


def _patch_once_per_launch() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: list[set[int]] = []  # per running launch: the language modules patched since it began

    class _Unchanged:
        def restore(self) -> None:
            pass

    def _patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if not patched:  # not inside a launch
            return patch_lang(fn)
        if langs and langs <= patched[-1]:  # a helper call: its modules are patched until the launch ends
            return _Unchanged()
        scope = patch_lang(fn)
        patched[-1] |= langs
        return scope

    def __call__(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = __call__


def _keep_np_dtypes() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    get_np_dtype, found = interpreter._get_np_dtype, {}

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):  # a block's is its element type's
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):  # (unhashable; answered at once)
            return get_np_dtype(tt_dtype)
        np_dtype = found.get(tt_dtype)
        if np_dtype is None:
            np_dtype = found[tt_dtype] = get_np_dtype(tt_dtype)
        return np_dtype

    interpreter._get_np_dtype = _get_np_dtype


def _skip_dropped_overflow_checks() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    semantic = interpreter.interpreter_semantic
    false = semantic.make_tensor(interpreter.TensorHandle(np.array([False]), tl.int1), tl.int1)
    try:
        semantic.device_assert(false, "probe", None)
    except AssertionError:  # this interpreter asserts: keep its overflow checks
        return
    check = semantic.binary_op_sanitize_overflow_impl

    def binary_op_sanitize_overflow_impl(lhs, rhs, binary_op):
        if semantic.builder.options.debug:  # (device_assert asserts with debug on)
            check(lhs, rhs, binary_op)

    semantic.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl


if not CUDA and os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _patch_bf16_rounding()
        _patch_once_per_launch()
        _keep_np_dtypes()
        _skip_dropped_overflow_checks()
    except ImportError:  # no triton: the tests that need it skip themselves
        pass
