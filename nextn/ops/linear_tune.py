"""Block configs for the skinny GEMM (nextn.ops.triton_linear), measured: each candidate timed per
weight shape at 1 and 9 rows inside a CUDA graph with the weights out of L2, the best kept in the
kernel module's CONFIGS / FP8_CONFIGS before any step is captured (TritonStep.tune, `nextn bench`).
GPU only. `graph_us` is the timing the bench scripts share.
"""

from __future__ import annotations

import torch

from nextn.ops.fp8 import BLOCK as FP8_BLOCK
from nextn.ops.fp8 import FP8Weight, compact_scales, quantize
from nextn.ops.triton_linear import CONFIGS, FP8_CONFIGS, WAY_TMA, WAY_XMAJOR, pick_config, skinny_linear


def graph_us(launch, num_copies: int, reps: int) -> float:
    """Microseconds per launch(i) inside a CUDA graph of `reps` launches (how a step runs them:
    no host launch overhead), cycling over weight copies so the L2 cache holds none of them."""
    for i in range(num_copies):  # compile and warm up outside the capture
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            launch(i % num_copies)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


# bf16 weights through plain loads: (BLOCK_N, BLOCK_K, warps, stages, SPLIT)
CANDIDATES = [
    (128, 128, 4, 4, 1),
    (64, 128, 4, 4, 1),
    (32, 256, 4, 4, 1),
    (16, 256, 4, 3, 1),
    (32, 256, 4, 3, 1),
    (64, 128, 4, 4, 2),
    (64, 128, 4, 4, 4),
    (32, 256, 4, 4, 4),
    (64, 128, 4, 4, 8),
    (64, 128, 8, 3, 1),
    (128, 128, 8, 3, 2),
    (64, 128, 4, 3, 4),
    (64, 128, 8, 3, 4),
]
# weight tiles through tensor descriptors (TMA): (BLOCK_N, BLOCK_K, warps, stages, SPLIT, 1)
TMA_CANDIDATES = [
    (64, 128, 4, 4, 1, 1),
    (128, 128, 4, 4, 1, 1),
    (32, 256, 4, 4, 1, 1),
    (64, 256, 4, 3, 1, 1),
    (128, 128, 8, 3, 2, 1),
    (64, 128, 4, 4, 4, 1),
    (128, 256, 8, 3, 1, 1),
]
# more candidates for FP8 weights (BLOCK_N <= 128, so a program's rows share each block scale), the chained
# dots with the weights as the dot's M, then x-major (way 2: the best of bench/fp8_dot_variants.py's, run 126)
FP8_CANDIDATES = [(128, 128, 8, 4, 1), (128, 128, 8, 3, 4), (128, 128, 4, 3, 4), (32, 128, 4, 4, 4), (32, 128, 4, 4, 8)]
FP8_CANDIDATES += [(128, 128, 4, 4, 2, 2), (64, 128, 4, 4, 4, 2), (128, 128, 4, 4, 1, 2), (64, 128, 4, 4, 1, 2),
                   (64, 128, 4, 6, 2, 2), (128, 128, 8, 5, 2, 2), (64, 128, 4, 4, 2, 2)]  # fmt: skip


def config_key(N: int, K: int, fp8: bool = False) -> str:
    """The name of a weight shape (and kind) in tune's report."""
    return f"{N}x{K}" + ("_fp8" if fp8 else "")


def tune(shapes: list[tuple[int, int, bool, bool]], device, candidates=None, log=None) -> dict:
    """Time block configs per weight shape (N, K, second weight?, FP8?) at 1
    and 9 rows, in CUDA graphs with the weights out of L2, and keep the best in CONFIGS (FP8_CONFIGS)
    (the default heuristic's config is always a candidate). Run it before any step is captured: a
    shape's config then stays fixed, so rows stay invariant."""
    candidates = list(candidates or CANDIDATES + TMA_CANDIDATES)
    chosen = {}
    merged: dict[tuple[int, int, bool], bool] = {}
    for N, K, dual, fp8 in shapes:  # one config per (N, K, kind): tune the most demanding use
        merged[(N, K, fp8)] = merged.get((N, K, fp8), False) or dual
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    for (N, K, fp8), dual in sorted(merged.items()):
        table = (FP8_CONFIGS if fp8 else CONFIGS).pop((N, K), None)
        default = pick_config(N, K, fp8)
        if table is not None and table not in candidates:
            candidates.append(table)
        nbytes = N * K * (1 if fp8 else 2) * (2 if dual else 1)
        copies = max(1, min(8, -(-4 * l2_bytes // nbytes)))
        ws = [_tune_weight(N, K, fp8, device) for _ in range(copies)]
        w2s = [_tune_weight(N, K, fp8, device) for _ in range(copies)] if dual else None
        x = torch.randn(9, K, device=device, dtype=torch.bfloat16)
        reps = max(copies, min(200, int(2e11 // nbytes)))
        best = None
        for cfg in [default] + [c for c in candidates + (FP8_CANDIDATES if fp8 else []) if c != default]:
            bn, bk, _, _, split, *way = cfg
            way = way[0] if way else 0
            if (split > 1 and K % (split * bk)) or bk > K or (fp8 and (FP8_BLOCK % bk or way == WAY_TMA)):
                continue
            if way == WAY_XMAJOR and not fp8:
                continue
            times = []
            try:
                for rows in (1, 9):
                    times.append(
                        graph_us(
                            lambda i, rows=rows, x=x, ws=ws, w2s=w2s, dual=dual, cfg=cfg: skinny_linear(
                                x[:rows], ws[i], up_weight=w2s[i] if dual else None, config=cfg
                            ),
                            copies,
                            reps,
                        )
                    )
            except Exception as e:  # e.g. more shared memory than the chip has: not a candidate
                torch.cuda.synchronize()
                if log:
                    log(f"tune {config_key(N, K, fp8)} {cfg}: {type(e).__name__}")
                continue
            score = times[0] + 0.25 * times[1]
            if best is None or score < best[0]:
                best = (score, cfg, times[0], times[1])
        (FP8_CONFIGS if fp8 else CONFIGS)[(N, K)] = best[1]
        key = config_key(N, K, fp8)
        chosen[key] = {
            "config": list(best[1]),
            "default": list(default),
            "us_1row": best[2],
            "us_9rows": best[3],
            "GBps_1row": nbytes / (best[2] * 1e-6) / 1e9,
        }
        if log:
            log(f"tune {key}: {best[1]} {chosen[key]['GBps_1row']:.0f} GB/s at 1 row ({best[2]:.1f} us)")
        ws = w2s = None  # free the copies before the next shape's
    return chosen


def _tune_weight(N: int, K: int, fp8: bool, device) -> torch.Tensor | FP8Weight:
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16)
    return compact_scales(quantize(w)) if fp8 else w  # (the step's layout)
