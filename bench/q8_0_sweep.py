"""Time the Q8_0 skinny GEMM's block configs at one row on the GPU, every candidate and shape printed
(nextn.ops.linear_tune keeps only the best): which tiles, stages and splits stream int8 weights
fastest, against bf16's best at the same shape (run 163: the 9B's Q8_0 GEMMs ran at 1,469-2,264 GB/s
where bf16's reach 2,462-2,959).

    python bench/q8_0_sweep.py [--shapes 9b|35b] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from nextn.ops.linear_tune import graph_plan, graph_us
from nextn.ops.q8_0 import q8_0_quantize
from nextn.ops.triton_linear import skinny_linear

# (N, K, gate|up pair): the Qwen3.5-9B's Q8_0 projections and its lm_head; the 35B-A3B's dense ones
SHAPES = {
    "9b": [(12288, 4096, True), (10240, 4096, False), (4096, 4096, False), (4096, 12288, False), (248320, 4096, False)],
    "35b": [(8192, 2048, False), (2048, 4096, False), (12288, 2048, False), (248320, 2048, False)],
}


def candidates() -> list[tuple[int, ...]]:
    """(BLOCK_N, BLOCK_K, warps, stages, SPLIT): k-tiles of one to sixteen 32-column groups."""
    out = []
    for bn, bk, warps in itertools.product((32, 64, 128), (64, 128, 256, 512), (4, 8)):
        if bn * bk > 64 * 512 or (warps == 8 and bn * bk < 64 * 256):
            continue
        out += [(bn, bk, warps, 3 if bn * bk >= 64 * 256 else 5, split) for split in (1, 4)]
    return out + [(16, 256, 4, 4, 4), (16, 512, 4, 3, 4), (64, 128, 4, 3, 8), (32, 256, 4, 4, 8), (64, 32, 4, 6, 4)]


def _time(x, ws, w2s, copies: int, reps: int, cfg=None) -> float:
    """Microseconds a launch over weight copies ws (w2s: the gate|up pair's second), in a graph."""
    return graph_us(lambda i: skinny_linear(x, ws[i], up_weight=w2s[i] if w2s else None, config=cfg), copies, reps)


def _weights(N: int, K: int, copies: int, quant: bool) -> list:
    draw = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    return [q8_0_quantize(w) for w in draw] if quant else draw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="9b", choices=sorted(SHAPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    report = {"device": torch.cuda.get_device_name(0), "command": f"python bench/q8_0_sweep.py --shapes {args.shapes}"}
    for N, K, dual in SHAPES[args.shapes]:
        nbytes = N * K * 34 // 32 * (2 if dual else 1)
        copies, reps = graph_plan(nbytes, l2)
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        rows = {}
        bf, bf2 = _weights(N, K, copies, False), _weights(N, K, copies, False) if dual else None
        us = _time(x, bf, bf2, copies, reps)
        rows["bf16 (its table)"] = (us, 2 * N * K * (2 if dual else 1) / us / 1e3)
        bf = bf2 = None
        ws, w2s = _weights(N, K, copies, True), _weights(N, K, copies, True) if dual else None
        for cfg in candidates():
            bn, bk, _, _, split = cfg
            if (split > 1 and K % (split * bk)) or bk > K:
                continue
            try:
                us = _time(x, ws, w2s, copies, reps, cfg)
            except Exception as e:  # noqa: BLE001  (more shared memory than the chip has: not a candidate)
                torch.cuda.synchronize()
                print(f"{N}x{K} {cfg}: {type(e).__name__}")
                continue
            rows[str(cfg)] = (us, nbytes / us / 1e3)
        best = sorted(rows.items(), key=lambda kv: kv[1][0])
        print(f"{N}x{K}{' x2' if dual else ''}: " + ", ".join(f"{k} {u:.1f} us {g:.0f} GB/s" for k, (u, g) in best[:8]))
        report[f"{N}x{K}"] = {k: {"us": round(u, 2), "GBps": round(g)} for k, (u, g) in best}
        ws = w2s = None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
