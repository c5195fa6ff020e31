"""Block configs for the skinny GEMM (nextn.ops.triton_linear), measured: each candidate timed per
weight shape at 1 and 9 rows inside a CUDA graph with the weights out of L2, the best kept in
nextn.ops.linear_configs' CONFIGS / QUANT_CONFIGS (FP8, Q8_0) before any step is captured
(TritonStep.tune, `nextn bench`).
GPU only. `graph_us` is the timing the bench scripts share.
"""

from __future__ import annotations

import torch

from nextn.ops.fp8 import FORMATS, FP8, Q8_0, QuantWeight, compact_scales, quantize
from nextn.ops.linear_configs import (
    CONFIGS,
    QUANT_CONFIGS,
    pick_config,
    takes_block_k,
    takes_way,
)
from nextn.ops.q8_0 import q8_0_quantize
from nextn.ops.triton_linear import skinny_linear


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


def graph_plan(nbytes: int, l2_bytes: int) -> tuple[int, int]:
    """(copies, reps) for `graph_us` over weights of nbytes: enough copies that the L2 cache holds
    none of them when its turn comes, and enough launches to time (~200 GB read, at most 200)."""
    copies = max(1, min(8, -(-4 * l2_bytes // nbytes)))
    return copies, max(copies, min(200, int(2e11 // nbytes)))


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
# more for Q8_0: tiles of one 32-column group (scaled products), and wide ones (dequantized tiles; run 171's
# q8_0_sweep found (64, 256, 4, 3, 4) and (64, 128, 4, 3, 8) fastest at the 9B's 4096-row shapes)
Q8_0_CANDIDATES = [(64, 32, 4, 6, 1), (128, 32, 4, 8, 1), (64, 64, 4, 4, 2), (64, 256, 4, 3, 1), (128, 256, 8, 3, 1),
                   (64, 256, 4, 3, 4), (64, 128, 4, 3, 8), (128, 128, 4, 3, 1)]  # fmt: skip
QUANT_CANDIDATES = {FP8.name: FP8_CANDIDATES, Q8_0.name: Q8_0_CANDIDATES}


def config_key(N: int, K: int, quant: str = "") -> str:
    """The name of a weight shape (and kind: "" bf16, or a quantized format's name) in tune's report."""
    return f"{N}x{K}" + (f"_{quant}" if quant else "")


def tune(shapes: list[tuple[int, int, bool, str]], device, candidates=None, log=None) -> dict:
    """Time block configs per weight shape (N, K, second weight?, kind: "" bf16, "fp8", "q8_0") at 1
    and 9 rows, in CUDA graphs with the weights out of L2, and keep the best in CONFIGS (QUANT_CONFIGS)
    (the default heuristic's config is always a candidate). A candidate whose output at 9 rows is off
    the default config's by more than AGREE of its scale is not one (logged): a fast config that
    computes something else never serves. Run it before any step is captured: a shape's config then
    stays fixed, so rows stay invariant."""
    candidates = list(candidates or CANDIDATES + TMA_CANDIDATES)
    chosen = {}
    merged: dict[tuple[int, int, str], bool] = {}
    for N, K, dual, quant in shapes:  # one config per (N, K, kind): tune the most demanding use
        merged[(N, K, quant)] = merged.get((N, K, quant), False) or dual
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    for (N, K, quant), dual in sorted(merged.items()):
        configs = QUANT_CONFIGS[quant] if quant else CONFIGS
        table = configs.pop((N, K), None)
        default = pick_config(N, K, quant)
        if table is not None and table not in candidates:
            candidates.append(table)
        nbytes = int(N * K * _bytes_per_weight(quant) * (2 if dual else 1))
        copies, reps = graph_plan(nbytes, l2_bytes)
        ws = [_tune_weight(N, K, quant, device) for _ in range(copies)]
        w2s = [_tune_weight(N, K, quant, device) for _ in range(copies)] if dual else None
        x = torch.randn(9, K, device=device, dtype=torch.bfloat16)
        want = skinny_linear(x, ws[0], up_weight=w2s[0] if dual else None, config=default).float()
        best = None
        for cfg in [default] + [c for c in candidates + QUANT_CANDIDATES.get(quant, []) if c != default]:
            bn, bk, _, _, split, *way = cfg
            way = way[0] if way else 0
            if (split > 1 and K % (split * bk)) or bk > K:
                continue
            fmt = FORMATS[quant] if quant else None
            if (fmt and not takes_block_k(fmt, bk)) or not takes_way(way, fmt):
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
                    log(f"tune {config_key(N, K, quant)} {cfg}: {type(e).__name__}")
                continue
            got = skinny_linear(x, ws[0], up_weight=w2s[0] if dual else None, config=cfg).float()
            if (err := disagreement(got, want)) > AGREE:  # a fast config must compute the same product
                if log:
                    log(f"tune {config_key(N, K, quant)} {cfg}: its output is off the default config's by {err:.3g}")
                continue
            score = times[0] + 0.25 * times[1]
            if best is None or score < best[0]:
                best = (score, cfg, times[0], times[1])
        configs[(N, K)] = best[1]
        key = config_key(N, K, quant)
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


# a candidate's output against the default config's: other configs sum in other orders (a few ulps of
# the output's scale in bf16); one that computes something else is off by its whole scale
AGREE = 2e-2


def disagreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want| (inf where got is not finite): how far a config's output is
    from the default config's."""
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _bytes_per_weight(quant: str) -> float:
    """A weight's bytes (its values and scales) by kind."""
    if not quant:
        return 2.0
    fmt = FORMATS[quant]  # (FP8's step scales: one per 128x128 block, negligible)
    return fmt.values.itemsize + (0 if fmt == FP8 else fmt.scale.itemsize / fmt.block)


def _tune_weight(N: int, K: int, quant: str, device) -> torch.Tensor | QuantWeight:
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16)
    if quant == FP8.name:
        return compact_scales(quantize(w))  # (the step's layout)
    return q8_0_quantize(w) if quant else w
