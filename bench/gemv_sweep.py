"""Sweep skinny_linear block configs for one model's weight uses on the GPU, against cuBLAS at the
same 16 padded rows; each timing is a CUDA graph of many launches with the weights out of L2
(`triton_linear._graph_us`). Kernels are compiled first in parallel worker processes.

python bench/gemv_sweep.py --preset qwen3.5-9b --out sweep.json [--workers 14]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import time

import torch
import torch.nn.functional as F

from nextn.ops import triton_linear
from nextn.ops.triton_linear import MAX_ROWS, _graph_us, skinny_linear

# (name, N, K, prologue, epilogue, out float32): the 9B step's uses
USES = {
    "qwen3.5-9b": [
        ("gdn_in_proj", 12352, 4096, "rms", None, False),
        ("attn_qkv", 10240, 4096, "rms", None, False),
        ("gate_up", 12288, 4096, "rms", "silu_mul", False),
        ("down", 4096, 12288, None, "residual", False),
        ("gdn_out_proj", 4096, 4096, None, "residual", False),
        ("lm_head", 248320, 4096, None, None, True),
    ],
}


def candidates(N: int, K: int, dual: bool, small: bool = False) -> list[tuple]:
    """small: the configs whose stages are small enough for 3+ programs per SM (all resident at once)."""
    out = []
    for bn, bk, warps, stages, split in itertools.product(
        (16, 32, 64, 128), (64, 128, 256, 512), (4, 8), (3, 4, 5), (1, 2, 4, 8)
    ):
        stage_bytes = bn * bk * 2 * (2 if dual else 1) + MAX_ROWS * bk * 2
        programs = -(-N // bn) * split
        if stages * stage_bytes > 200 * 1024 or K % (split * bk):
            continue
        if programs < 132 or programs > 16384 or bn * bk > 32768:
            continue
        if small != (
            stages * stage_bytes <= 72 * 1024 and bn * bk >= 2048 and stages < 5 and split < 8 and bn < 128
        ) or (not small and bn * bk < 8192):
            continue
        out.append((bn, bk, warps, stages, split))
    return out


def make_call(use, copies: int, device):
    name, N, K, prologue, epilogue, out_f32 = use
    g = torch.Generator(device=device).manual_seed(0)
    ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
    w2s = (
        [torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
        if epilogue == "silu_mul"
        else None
    )
    x = torch.randn(MAX_ROWS, K, device=device, dtype=torch.bfloat16)
    nw = torch.zeros(K, device=device, dtype=torch.bfloat16)
    res = torch.randn(MAX_ROWS, N, device=device, dtype=torch.bfloat16)

    def call(i: int, rows: int, cfg):
        return skinny_linear(
            x[:rows],
            ws[i],
            out_dtype=torch.float32 if out_f32 else None,
            norm_weight=nw if prologue else None,
            residual=res[:rows] if epilogue == "residual" else None,
            up_weight=w2s[i] if w2s else None,
            config=cfg,
        )

    def cublas(i: int):
        y = F.linear(x, ws[i])
        if w2s:
            y = F.linear(x, w2s[i])
        return y

    return call, cublas


def _compile_worker(jobs):
    torch.cuda.set_device(0)
    done = 0
    for use, cfg in jobs:
        call, _ = make_call(use, 1, "cuda")
        try:
            call(0, 1, cfg)
            done += 1
        except Exception:
            pass
    torch.cuda.synchronize()
    return done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--only", default=None, help="comma-separated use names")
    ap.add_argument("--top", default=None, help="an earlier sweep's JSON: time only its best configs")
    ap.add_argument("--small", action="store_true", help="only configs small enough for 3+ programs per SM")
    args = ap.parse_args()
    uses = [u for u in USES[args.preset] if not args.only or u[0] in args.only.split(",")]
    if args.top:
        with open(args.top) as f:
            top = json.load(f)
        configs = {u[0]: [tuple(b["config"]) for b in top[u[0]]["best"]] for u in uses if u[0] in top}
    else:
        configs = {u[0]: candidates(u[1], u[2], u[4] == "silu_mul", args.small) for u in uses}
    for u in uses:  # the configs in use now are always timed
        current = triton_linear.pick_config(u[1], u[2])
        configs.setdefault(u[0], [])
        if current not in configs[u[0]]:
            configs[u[0]].append(current)
    jobs = [(u, c) for u in uses for c in configs[u[0]]]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        compiled = sum(pool.map(_compile_worker, [jobs[i :: args.workers] for i in range(args.workers)]))
    print(f"compiled {compiled}/{len(jobs)} configs in {time.perf_counter() - t0:.0f} s", flush=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = {}
    for use in uses:
        name, N, K, _, epilogue, _ = use
        nbytes = N * K * 2 * (2 if epilogue == "silu_mul" else 1)
        copies = max(2, min(8, -(-4 * l2 // nbytes)))
        reps = max(copies, min(200, int(2e11 // nbytes)))
        call, cublas = make_call(use, copies, "cuda")
        rows = []
        for cfg in configs[name]:
            try:
                us = _graph_us(lambda i, cfg=cfg, call=call: call(i, 1, cfg), copies, reps)
            except Exception as e:
                torch.cuda.synchronize()
                print(f"{name} {cfg}: {type(e).__name__}", flush=True)
                continue
            rows.append((us, cfg))
        rows.sort()
        best = []
        for us, cfg in rows[:6]:
            us16 = _graph_us(lambda i, cfg=cfg, call=call: call(i, MAX_ROWS, cfg), copies, reps)
            best.append({"config": list(cfg), "us_1row": us, "us_16rows": us16, "GBps_1row": nbytes / us / 1e3})
        cub = _graph_us(cublas, copies, reps)
        current = triton_linear.pick_config(N, K)
        cur = [r for r in rows if r[1] == current]
        results[name] = {
            "N": N,
            "K": K,
            "bytes": nbytes,
            "best": best,
            "cublas_16rows_us": cub,
            "cublas_GBps": nbytes / cub / 1e3,
            "current_config": list(current),
            "current_us": cur[0][0] if cur else None,
            "num_configs": len(rows),
        }
        print(
            f"{name} {N}x{K}: best {best[0]['config']} {best[0]['us_1row']:.1f} us "
            f"({best[0]['GBps_1row']:.0f} GB/s, 16 rows {best[0]['us_16rows']:.1f} us); "
            f"current {current} {results[name]['current_us']}; cuBLAS 16 rows {cub:.1f} us "
            f"({results[name]['cublas_GBps']:.0f} GB/s)",
            flush=True,
        )
        for b in best[1:]:
            print(f"    {b['config']} {b['us_1row']:.1f} us 16 rows {b['us_16rows']:.1f}", flush=True)
        call = cublas = None
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
