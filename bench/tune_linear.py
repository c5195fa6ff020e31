"""Time skinny_linear block configs on the GPU at 1 row (decode) and 9 rows (verify K=8); print
the best per weight shape as a CONFIGS table for nextn/ops/linear_configs.py.

python bench/tune_linear.py [--out tune.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from nextn.ops import linear_configs
from nextn.ops.triton_linear import skinny_linear

SHAPES = [(12352, 4096), (4096, 12288), (24576, 4096), (4096, 4096), (248320, 4096), (8192, 2048)]
CANDIDATES = [
    (16, 256, 4, 3),
    (16, 512, 4, 3),
    (32, 256, 4, 3),
    (32, 256, 4, 4),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (64, 256, 8, 3),
    (128, 128, 4, 4),
    (128, 256, 8, 3),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    for N, K in SHAPES:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(9, K, device="cuda", dtype=torch.bfloat16)
        rows = []
        for cfg in CANDIDATES:
            linear_configs.CONFIGS[(N, K)] = cfg
            try:
                t1 = do_bench(lambda x=x, w=w: skinny_linear(x[:1], w), warmup=5, rep=30, return_mode="median")
                t9 = do_bench(lambda x=x, w=w: skinny_linear(x, w), warmup=5, rep=30, return_mode="median")
            except Exception as e:  # a config the compiler rejects (shared memory): skip it
                print(f"{N}x{K} {cfg}: {type(e).__name__}")
                continue
            gbps = N * K * 2 / (t1 * 1e-3) / 1e9
            rows.append((t1, t9, cfg, gbps))
            print(f"{N}x{K} {cfg}: 1 row {t1 * 1e3:.1f} us ({gbps:.0f} GB/s), 9 rows {t9 * 1e3:.1f} us", flush=True)
        del linear_configs.CONFIGS[(N, K)]
        best = min(rows, key=lambda r: r[0] + 0.25 * r[1])
        results[f"{N}x{K}"] = {
            "config": best[2],
            "us_1row": best[0] * 1e3,
            "us_9rows": best[1] * 1e3,
            "GBps_1row": best[3],
        }
        print(f"BEST {N}x{K}: {best[2]} {best[3]:.0f} GB/s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
