"""Conditional (IF) nodes in a CUDA graph capture, through the driver API (CUDA >= 12.4): torch
2.11's CUDAGraph has none, and a cut draft chain should cost a round nothing for the head steps it
skips (nextn.engine.runner.ModelRunner.when).

`GraphIf.capture_if(pred, fn)`, called while a stream is capturing:
1. a conditional handle is made on the graph being captured (reset to 0 at each launch);
2. a one-thread kernel, captured on the stream, reads pred (a bool device scalar) and sets the
   handle from it (the device call cudaGraphSetConditional, resolved by the driver when it loads
   the PTX below: no CUDA toolkit needed);
3. an IF node is added after it, and the stream's capture continues after the node;
4. fn's work is captured into the node's body graph, on a side stream of this nesting depth
   (a capturing stream cannot be redirected), its allocations from a private memory pool of the
   runner's (torch's graph pool takes allocations from the main capture stream only). At replay
   the body runs only where pred was true when its setter ran.
Bodies nest (an IF node inside a body), one side stream per depth.

Where the driver lacks any of this, `GraphIf.load` raises and the runner says so once and keeps
the fused step's other way to skip (kernels that read the flag and return).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

_API = 12040  # the CUDA version whose signatures are asked for (edge-data variants, conditional nodes)
_NODE_CONDITIONAL, _COND_IF, _ASSIGN_DEFAULT = 13, 0, 1
_SET_DEPENDENCIES, _CAPTURE_THREAD_LOCAL, _CAPTURING = 1, 1, 1

_SETTER_PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.extern .func cudaGraphSetConditional(.param .b64 handle, .param .b32 value);
.visible .entry nextn_set_if(.param .u64 pred, .param .u64 handle)
{
    .reg .pred %p<2>;
    .reg .b16 %rs<2>;
    .reg .b32 %r<2>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [pred];
    ld.param.u64 %rd2, [handle];
    cvta.to.global.u64 %rd3, %rd1;
    ld.global.u8 %rs1, [%rd3];
    setp.ne.s16 %p1, %rs1, 0;
    selp.u32 %r1, 1, 0, %p1;
    {
        .param .b64 param0;
        st.param.b64 [param0], %rd2;
        .param .b32 param1;
        st.param.b32 [param1], %r1;
        call.uni cudaGraphSetConditional, (param0, param1);
    }
    ret;
}
"""


class _Conditional(ctypes.Structure):  # CUDA_CONDITIONAL_NODE_PARAMS
    _fields_ = [
        ("handle", ctypes.c_uint64),
        ("type", ctypes.c_int),
        ("size", ctypes.c_uint),
        ("graphs", ctypes.POINTER(ctypes.c_void_p)),  # out: the body graphs (driver-owned)
        ("ctx", ctypes.c_void_p),
    ]


class _NodeParams(ctypes.Structure):  # CUgraphNodeParams: 256 bytes, the union at offset 16
    _fields_ = [
        ("type", ctypes.c_int),
        ("reserved0", ctypes.c_int * 3),
        ("conditional", _Conditional),
        ("union_rest", ctypes.c_byte * (29 * 8 - ctypes.sizeof(_Conditional))),
        ("reserved2", ctypes.c_longlong),
    ]


class GraphIf:
    """IF nodes for captures on one device (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.streams: list[torch.cuda.Stream] = []  # side stream per nesting depth
        self.pool = torch.cuda.MemPool()  # the bodies' allocations
        self.depth = 0
        lib = ctypes.CDLL("libcuda.so.1")
        get = lib.cuGetProcAddress_v2
        get.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_void_p,
        ]

        def api(name: str, *argtypes):
            pfn, status = ctypes.c_void_p(), ctypes.c_int()
            _check(get(name.encode(), ctypes.byref(pfn), _API, 0, ctypes.byref(status)), f"cuGetProcAddress({name})")
            if not pfn.value:
                raise RuntimeError(f"the CUDA driver has no {name}")
            return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(pfn.value)

        vp, u64, sz = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        P = ctypes.POINTER
        self._info = api("cuStreamGetCaptureInfo", vp, P(ctypes.c_int), P(u64), P(vp), P(vp), P(vp), P(sz))
        self._add_node = api("cuGraphAddNode", P(vp), vp, vp, vp, sz, P(_NodeParams))
        self._set_deps = api("cuStreamUpdateCaptureDependencies", vp, P(vp), vp, sz, ctypes.c_uint)
        self._handle = api("cuGraphConditionalHandleCreate", P(u64), vp, vp, ctypes.c_uint, ctypes.c_uint)
        self._begin = api("cuStreamBeginCaptureToGraph", vp, vp, vp, vp, sz, ctypes.c_int)
        self._end = api("cuStreamEndCapture", vp, P(vp))
        self._launch = api(
            "cuLaunchKernel", vp, *[ctypes.c_uint] * 7, vp, P(vp), P(vp)
        )  # f, grid xyz, block xyz, smem, stream, params, extra
        ctx_get = api("cuCtxGetCurrent", P(vp))
        load = api("cuModuleLoadData", P(vp), ctypes.c_char_p)
        function = api("cuModuleGetFunction", P(vp), vp, ctypes.c_char_p)
        with torch.cuda.device(self.device):
            torch.empty(1, device=self.device)  # the device's primary context, current on this thread
            self.ctx, module, self.setter = vp(), vp(), vp()
            _check(ctx_get(ctypes.byref(self.ctx)), "cuCtxGetCurrent")
            if not self.ctx.value:
                raise RuntimeError("no current CUDA context")
            _check(load(ctypes.byref(module), _SETTER_PTX), "cuModuleLoadData (the IF setter's PTX)")
            _check(function(ctypes.byref(self.setter), module, b"nextn_set_if"), "cuModuleGetFunction")
        self.module = module

    def capture_if(self, pred: torch.Tensor, fn: Callable[[], None]) -> None:
        """Capture fn as the body of an IF node on pred (a bool device scalar), on the current
        (capturing) stream."""
        if pred.dtype != torch.bool or pred.numel() != 1 or pred.device != self.device:
            raise ValueError(f"an IF node's predicate is a bool device scalar, not {pred.dtype} {tuple(pred.shape)}")
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        graph, _, _ = self._capture_state(stream)
        handle = ctypes.c_uint64()
        _check(
            self._handle(ctypes.byref(handle), graph, self.ctx, 0, _ASSIGN_DEFAULT), "cuGraphConditionalHandleCreate"
        )
        pred_arg = ctypes.c_void_p(pred.data_ptr())
        args = (ctypes.c_void_p * 2)(ctypes.addressof(pred_arg), ctypes.addressof(handle))
        _check(self._launch(self.setter, 1, 1, 1, 1, 1, 1, 0, stream, args, None), "cuLaunchKernel (the IF setter)")
        graph, deps, (edges, n) = self._capture_state(stream)  # the setter is now the dependency
        params = _NodeParams(type=_NODE_CONDITIONAL)
        params.conditional = _Conditional(handle=handle.value, type=_COND_IF, size=1, ctx=self.ctx)
        node = ctypes.c_void_p()
        _check(self._add_node(ctypes.byref(node), graph, deps, edges, n, ctypes.byref(params)), "cuGraphAddNode (IF)")
        _check(
            self._set_deps(stream, ctypes.byref(node), None, 1, _SET_DEPENDENCIES), "cuStreamUpdateCaptureDependencies"
        )
        body = params.conditional.graphs[0]
        if len(self.streams) <= self.depth:
            self.streams.append(torch.cuda.Stream(self.device))
        side = self.streams[self.depth]
        side_handle = ctypes.c_void_p(side.cuda_stream)
        _check(self._begin(side_handle, body, None, None, 0, _CAPTURE_THREAD_LOCAL), "cuStreamBeginCaptureToGraph")
        self.depth += 1
        try:
            with torch.cuda.stream(side):
                if self.depth == 1:  # the thread's allocations go to the pool until the outermost body ends
                    with torch.cuda.use_mem_pool(self.pool, self.device):
                        fn()
                else:
                    fn()
        finally:
            self.depth -= 1
            captured = ctypes.c_void_p()
            _check(self._end(side_handle, ctypes.byref(captured)), "cuStreamEndCapture (an IF body)")

    def _capture_state(self, stream: ctypes.c_void_p):
        """(graph being captured, its current dependencies, (their edge data, count))."""
        status, ident, graph = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
        deps, edges, n = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
        _check(
            self._info(
                stream,
                ctypes.byref(status),
                ctypes.byref(ident),
                ctypes.byref(graph),
                ctypes.byref(deps),
                ctypes.byref(edges),
                ctypes.byref(n),
            ),
            "cuStreamGetCaptureInfo",
        )
        if status.value != _CAPTURING:
            raise RuntimeError("an IF node is captured inside a CUDA graph capture only")
        return graph, deps, (edges, n)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: CUDA driver error {result}")
