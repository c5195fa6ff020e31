"""Could CUDA-core GEMVs stream the decode's skinny shapes faster than the tensor-core skinny GEMM?
y = x @ w.T for x [M, K] bf16 and w [N, K] bf16 or e4m3 (one scale per 128x128 block), on the 9B's
and the 35B-A3B's projection shapes, against the production `skinny_linear` at its tuned config
(`linear_tune.tune`, same process, same timing: CUDA graphs of back-to-back launches over weight
copies that overflow L2).

Two CUDA-core kernels, float32 products and sums (weights widened in registers; FP8: x's element
times its block's scale), each row's result in an order that does not depend on M:
  tile   a program loads one [BLOCK_N, BLOCK_K] weight tile once, then for each row stores its
         partial sum; the program that arrives last at its N block's counter adds the K / BLOCK_K
         partials in order (no k-loop, no second launch);
  loop   a program walks K for its BLOCK_N outputs (num_stages pipelined loads), one row
         (the M = 1 speed bound of a k-loop; rows > 1 not run).
Reports microseconds at M = 1, 4 and 9, GB/s of weight bytes, the fraction of the copy
bandwidth, and the largest error relative to the float32 product of the (dequantized) weights.

  python bench/gemv_variants.py --out gemv_variants.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from nextn.bench.measure import copy_bandwidth
from nextn.ops.fp8 import compact_scales, dequantize, quantize
from nextn.ops.linear_tune import graph_us, tune

SHAPES = {
    "qwen3.5-9b": [(4096, 4096), (12352, 4096), (4096, 12288), (24576, 4096)],
    "qwen3.5-35b-a3b": [(2048, 4096), (9216, 2048), (12352, 2048)],
}
# (BLOCK_N, BLOCK_K, warps, stages); "loop" uses stages, "tile" ignores it
TILE_CONFIGS = [(8, 512, 4, 1), (16, 512, 4, 1), (16, 256, 4, 1), (32, 256, 4, 1), (16, 1024, 8, 1),
                (32, 512, 8, 1), (8, 1024, 4, 1), (64, 256, 8, 1), (4, 1024, 4, 1), (32, 1024, 8, 1)]  # fmt: skip
LOOP_CONFIGS = [(16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (8, 512, 4, 4), (32, 512, 8, 3),
                (64, 256, 8, 3), (16, 1024, 8, 2), (8, 1024, 4, 3)]  # fmt: skip


@triton.jit
def _tile_kernel(x_ptr, w_ptr, s_ptr, part_ptr, count_ptr, y_ptr, M, N, K, stride_s, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :]).to(tl.float32)
    if FP8:
        s = tl.load(s_ptr + (offs_k // 128) * stride_s + (nb * BLOCK_N) // 128)
    for m in range(M):
        x = tl.load(x_ptr + m * K + offs_k).to(tl.float32)
        if FP8:
            x = x * s
        tl.store(part_ptr + (kb * M + m) * N + offs_n, tl.sum(w * x[None, :], axis=1))
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + nb, 1, sem="acq_rel")
    if arrived == SPLIT - 1:
        for m in range(M):
            acc = tl.load(part_ptr + m * N + offs_n, cache_modifier=".cg")
            for j in tl.static_range(1, SPLIT):
                acc += tl.load(part_ptr + (j * M + m) * N + offs_n, cache_modifier=".cg")
            tl.store(y_ptr + m * N + offs_n, acc.to(y_ptr.dtype.element_ty))
        tl.store(count_ptr + nb, 0)


@triton.jit
def _loop_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FP8: tl.constexpr):  # fmt: skip
    nb = tl.program_id(0)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :]).to(tl.float32)
        x = tl.load(x_ptr + offs_k).to(tl.float32)
        if FP8:
            x = x * tl.load(s_ptr + (offs_k // 128) * stride_s + (nb * BLOCK_N) // 128)
        acc += w * x[None, :]
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


def run(kind: str, x, w, s, cfg, scratch):
    block_n, block_k, warps, stages = cfg
    N, K = w.shape
    M = x.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    fp8 = w.dtype == torch.float8_e4m3fn
    s_arg = s if fp8 else w
    if kind == "tile":
        part, count = scratch
        split = K // block_k
        _tile_kernel[(N // block_n, split)](
            x, w, s_arg, part, count, y, M, N, K, s.stride(0) if fp8 else 0, SPLIT=split, BLOCK_N=block_n,
            BLOCK_K=block_k, FP8=fp8, num_warps=warps, num_stages=1,
        )  # fmt: skip
    else:
        _loop_kernel[(N // block_n,)](
            x, w, s_arg, y, N, K, s.stride(0) if fp8 else 0, BLOCK_N=block_n, BLOCK_K=block_k, FP8=fp8,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 9])
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy = copy_bandwidth(device) / 1e9  # GB/s
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    report = {"device": torch.cuda.get_device_name(), "copy_GBps": copy, "shapes": {}}
    print(f"copy bandwidth {copy:.0f} GB/s")
    for model, shapes in SHAPES.items():
        for N, K in shapes:
            for fp8 in (False, True) if N % 128 == 0 else (False,):  # (FP8 here: whole 128-row scale blocks)
                key = f"{model} {N}x{K}" + (" fp8" if fp8 else "")
                entry = report["shapes"][key] = {}
                nbytes = N * K * (1 if fp8 else 2)
                prod = tune([(N, K, False, fp8)], device)
                for v in prod.values():
                    entry["production"] = v
                    us = v["us_1row"]
                    print(f"{key} production M=1 {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                          f"({nbytes / us / 1e3 / copy:.2f}) M=9 {v['us_9rows']:.1f} us {v['config']}")  # fmt: skip
                copies = max(2, -(-4 * l2 // nbytes))
                ws, ss = [], []
                for _ in range(copies):
                    w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
                    if fp8:
                        q = compact_scales(quantize(w))
                        ws.append(q.weight)
                        ss.append(q.scale)
                    else:
                        ws.append(w)
                        ss.append(None)
                wref = dequantize(ws[0], ss[0].repeat_interleave(128, 1), torch.float32) if fp8 else ws[0].float()
                for kind, configs in (("tile", TILE_CONFIGS), ("loop", LOOP_CONFIGS)):
                    for M in args.rows if kind == "tile" else [1]:
                        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
                        ref = x.float() @ wref.T
                        best = None
                        for cfg in configs:
                            if K % cfg[1] or N % cfg[0] or (fp8 and 128 % cfg[0] and cfg[0] % 128):
                                continue
                            scratch = (
                                torch.empty(K // cfg[1] * M * N, device=device, dtype=torch.float32),
                                torch.zeros(N // cfg[0], device=device, dtype=torch.int32),
                            )

                            def call(i, kind=kind, x=x, cfg=cfg, scratch=scratch, ws=ws, ss=ss):
                                run(kind, x, ws[i], ss[i], cfg, scratch)

                            try:
                                us = graph_us(call, copies, max(copies, min(200, int(2e11 // nbytes))))
                            except Exception as e:  # a config that cannot compile or launch
                                torch.cuda.synchronize()
                                print(f"{key} {kind} M={M} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                                continue
                            if best is None or us < best[0]:
                                best = (us, cfg, scratch)
                        if best is None:
                            continue
                        us, cfg, scratch = best
                        out = run(kind, x, ws[0], ss[0], cfg, scratch).float()
                        err = ((out - ref).abs().max() / ref.abs().max()).item()
                        gbps = nbytes / us / 1e3
                        entry[f"{kind} M={M}"] = {"us": us, "config": cfg, "GBps": gbps, "of_copy": gbps / copy,
                                                  "max_rel_err": err}  # fmt: skip
                        print(f"{key} {kind} M={M} {us:7.1f} us {gbps:6.0f} GB/s ({gbps / copy:.2f}) {cfg} "
                              f"err {err:.1e}")  # fmt: skip
                ws = ss = None
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
