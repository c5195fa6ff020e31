"""The compile keys a GPU would use for the kernels the interpreter runs (tests only).

On the CPU, Triton's interpreter runs a kernel without compiling it, so a test cannot see a GPU
compile happen. What decides one is the launch's specialisation key: its constexprs, its options
(warps, stages) and how each non-constexpr argument is specialised (an int equal to 1 or divisible
by 16, a pointer 16-byte aligned), which Triton's own binder computes from the arguments, for a
Hopper target, without a GPU. `CompileKeys` records, per kernel, the keys of every interpreted
launch while it is active: a key not seen before is a compile on a GPU.
"""

from __future__ import annotations

import collections

import triton_interp  # noqa: F401  (before triton: the interpreter on the CPU)
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction, create_function_from_signature

_OPTIONS = ("num_warps", "num_stages", "launch_pdl")


class CompileKeys:
    """with CompileKeys() as keys: launches record (kernel name, key) in keys.seen; keys.recording
    False pauses the record (launches still run)."""

    def __init__(self):
        self.seen: set[tuple] = set()
        self.by_kernel: dict[str, set] = collections.defaultdict(set)
        self.recording = True
        self._binders: dict = {}
        self._backend = make_backend(GPUTarget("cuda", 90, 32))

    def key(self, fn, kwargs_of_jit: dict, args: tuple, kwargs: dict) -> tuple:
        binder = self._binders.get(fn)
        if binder is None:
            jit = JITFunction(fn, **{k: v for k, v in kwargs_of_jit.items() if k.startswith("do_not_specialize")})
            binder = self._binders[fn] = create_function_from_signature(jit.signature, jit.params, self._backend)
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k in _OPTIONS))
        _, spec, _ = binder(*args, **{k: v for k, v in kwargs.items() if k not in _OPTIONS})
        return fn.__name__, tuple(map(str, spec)), options

    def __enter__(self):
        self._run = interpreter.InterpretedFunction.run
        keys = self

        def run(fn, *args, grid, warmup, **kwargs):
            if keys.recording:
                k = keys.key(fn.fn, fn.kwargs, args, kwargs)
                keys.seen.add(k)
                keys.by_kernel[k[0]].add(k)
            return keys._run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        interpreter.InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        interpreter.InterpretedFunction.run = self._run
