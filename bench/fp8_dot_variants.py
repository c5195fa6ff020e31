"""Why FP8 weights decode slower than bf16 (run 26: 0.84x), and what would make them faster.

A skinny weight-streaming GEMM y = x @ w.T (x: 1 or 16 rows) over Qwen3.5-9B's projection shapes,
in four ways, each at its best of a few block configs:
  bf16     bf16 weights, one tensor-core dot per tile (what bf16 decode runs);
  e4m3>bf16  e4m3 weights widened to bf16 in registers, dot with bf16 x, times the block scales
           (what nextn's FP8 path runs today);
  e4m3>f16   e4m3 weights widened to fp16 (a packed convert on Hopper), x converted to fp16 (exact
           for |x| in fp16's normal range), dot, times the scales;
  e4m3 dot   e4m3 weights straight into an fp8 tensor-core dot with x cast to e4m3 (a lossy activation
           quantisation, here without scales: a speed bound, not a numerics proposal);
  chained ...  the same three with the 128x128 block's one scale applied to x's tile instead of the
           product, so each tile's dot accumulates into the last (no per-tile wait on the product).
Reports microseconds, GB/s of weight bytes and the fraction of the device's copy bandwidth, and the
largest difference of each FP8 way from e4m3>bf16. Weights rotate over copies that overflow L2.

  python bench/fp8_dot_variants.py --out fp8_dot_variants.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from nextn.ops.fp8 import quantize

MODES = {
    "bf16": 3,
    "e4m3>bf16": 0,
    "e4m3>f16": 1,
    "e4m3 dot": 2,
    "chained e4m3>bf16": 4,
    "chained e4m3>f16": 6,
    "chained e4m3 dot": 5,
}


@triton.jit
def _kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_s, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, MODE: tl.constexpr, SCALE_ROWS: tl.constexpr):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :])
        if MODE == 3:
            acc = tl.dot(w, tl.trans(x), acc)
        elif MODE >= 4:  # one scale per 128x128 block: scale x instead, so the dots chain
            s = tl.load(s_ptr + (k0 // 128) * stride_s + (tl.program_id(0) * BLOCK_N) // SCALE_ROWS)
            if MODE == 4:
                acc = tl.dot(w.to(tl.bfloat16), tl.trans((x.to(tl.float32) * s).to(tl.bfloat16)), acc)
            elif MODE == 6:
                acc = tl.dot(w.to(tl.float16), tl.trans((x.to(tl.float32) * s).to(tl.float16)), acc)
            else:
                acc = tl.dot(w, tl.trans((x.to(tl.float32) * s).to(tl.float8e4nv)), acc)
        else:
            scale = tl.load(s_ptr + (k0 // 128) * stride_s + offs_n // SCALE_ROWS)
            if MODE == 0:
                part = tl.dot(w.to(tl.bfloat16), tl.trans(x))
            elif MODE == 1:
                part = tl.dot(w.to(tl.float16), tl.trans(x.to(tl.float16)))
            else:
                part = tl.dot(w, tl.trans(x.to(tl.float8e4nv)))
            acc += part * scale[:, None]
    tl.store(y_ptr + offs_m[None, :] * N + offs_n[:, None], acc, mask=offs_m[None, :] < M)


def run(mode: int, x, w, s, cfg, rows: int = 1) -> torch.Tensor:
    block_n, warps, stages = cfg
    N, K = w.shape
    y = torch.empty(x.shape[0], N, device=x.device, dtype=torch.float32)
    _kernel[(N // block_n,)](
        x, w, s, y, x.shape[0], N, K, s.stride(0) if s is not None else 0,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, MODE=mode, SCALE_ROWS=rows, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def copy_bandwidth(device) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=50)
    return 2 * a.numel() / ms / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy = copy_bandwidth(device)
    shapes = [(4096, 4096), (12288, 4096), (4096, 12288)]
    configs = [(bn, wp, st) for bn in (64, 128) for wp in (4, 8) for st in (3, 4, 5)]
    report = {"device": torch.cuda.get_device_name(), "copy_GBps": copy, "shapes": {}}
    print(f"copy bandwidth {copy:.0f} GB/s")
    for N, K in shapes:
        copies = max(2, int(4 * 50e6 // (N * K)) + 1)  # past L2 even for e4m3
        ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        qs = [quantize(w) for w in ws]
        entry = report["shapes"][f"{N}x{K}"] = {}
        for M in args.rows:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            ref = run(0, x, qs[0].weight, qs[0].scale, (128, 4, 3))
            for name, mode in MODES.items():
                best = None
                for cfg in configs:
                    ops = [(w, None) for w in ws] if mode == 3 else [(q.weight, q.scale) for q in qs]
                    if mode >= 4:
                        ops = [(q.weight, q.scale[:, ::128].contiguous()) for q in qs]
                    it = iter(range(1 << 30))

                    def call(mode=mode, cfg=cfg, ops=ops, it=it, x=x):
                        w, s = ops[next(it) % len(ops)]
                        run(mode, x, w, s, cfg, 128 if mode >= 4 else 1)

                    try:
                        us = triton.testing.do_bench(call, warmup=10, rep=60) * 1e3
                    except Exception as e:  # a config a mode cannot compile
                        print(f"{N}x{K} M={M} {name} {cfg}: {type(e).__name__}")
                        continue
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best is None:
                    continue
                us, cfg = best
                nbytes = N * K * (2 if mode == 3 else 1)
                gbps = nbytes / us / 1e3
                diff = None
                if mode not in (0, 3):
                    compact = mode >= 4
                    s0 = qs[0].scale[:, ::128].contiguous() if compact else qs[0].scale
                    diff = (run(mode, x, qs[0].weight, s0, cfg, 128 if compact else 1) - ref).abs().max().item()
                frac = gbps / copy
                entry[f"{name} M={M}"] = {"us": us, "config": cfg, "GBps": gbps, "of_copy": frac, "max_diff": diff}
                print(f"{N}x{K} M={M} {name:10s} {us:8.1f} us {gbps:7.0f} GB/s ({frac:.2f} of copy) {cfg} diff {diff}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
