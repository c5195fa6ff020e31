"""skinny_linear in wide row tiles (`block_m`) against its 16-row tiles and cuBLAS, at the 9B's shapes.

A prefill step's rows go through the same GEMM as a decode's (a prompt row must be what a decode row
of it would be: sessions resume, the prefix cache and batches never change a request's bits). In
16-row tiles a program's weight tile meets 16 rows; at thousands of rows that re-reads each weight
tile hundreds of times and the dot is too narrow for the tensor cores. A wide tile (64-256 rows a
program, the shape's K splits summed in the program in split order) keeps each row's arithmetic
(the same k order and MMA; bits checked here per row count) and multiplies more rows per weight load.

Per shape and row count M: the 16-row tiles' us and TFLOP/s, below WIDE_ROWS the default call's
(mid tiles: linear_configs.mid_tile) us and whether its bits are the 16-row tiles', each wide candidate's us and
whether its output equals the default's bitwise, and torch's F.linear (cuBLAS, not row-invariant)
as the ceiling. --q8_0: the weights in Q8_0 (a GGUF file's: int8 with fp16 scales, the tile
dequantized in the k-loop; cuBLAS over the dequantized bf16 weights). Usage (device):
python3 bench/wide_tile_probe.py [--rows 16 256 1024 3072 8192] [--q8_0] [--extra BM,BN,WARPS,STAGES,BK ...]
[--only-extra] [--json OUT]. --extra: more candidates, each with its own BLOCK_K (the split kept) and optionally
a way (1: the weight tiles through tensor descriptors, TMA): whether a k-tile of another width keeps a row's bits is
what the bits column says."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from nextn.ops.fp8 import dequantize
from nextn.ops.linear_configs import TILE_ROWS, WIDE_ROWS, mid_tile, pick_config
from nextn.ops.linear_tune import graph_us
from nextn.ops.q8_0 import q8_0_quantize
from nextn.ops.triton_linear import skinny_linear

# (N, K, epilogue): the 9B's trunk GEMMs (bf16), as a layer calls them
SHAPES = [
    (12352, 4096, "plain"),  # GDN in_proj (fused)
    (10240, 4096, "plain"),  # q/k/v (fused)
    (4096, 4096, "residual"),  # o_proj / out_proj
    (12288, 4096, "silu_mul"),  # gate + up
    (4096, 12288, "residual"),  # down
]
# (block_m, block_n, warps, stages); BLOCK_K and the split stay the shape's
WIDE = [(64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (256, 64, 8, 2),
        (256, 128, 8, 2)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 256, 1024, 3072, 8192])
    ap.add_argument("--q8_0", action="store_true", help="Q8_0 weights")
    ap.add_argument("--extra", nargs="*", default=[], help="BM,BN,WARPS,STAGES,BK[,WAY] candidates beside WIDE")
    ap.add_argument("--only-extra", action="store_true", help="the --extra candidates alone (fewer compiles)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    extra = [tuple(int(v) for v in c.split(",")) for c in args.extra]
    result = {"device": torch.cuda.get_device_name(), "weights": "q8_0" if args.q8_0 else "bf16", "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for N, K, kind in SHAPES:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K**-0.5
        w2 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K**-0.5
        base = pick_config(N, K, "q8_0" if args.q8_0 else "")
        if args.q8_0:  # the kernel reads the quantized weights, cuBLAS their dequantized values
            (w, dw), (w2, dw2) = (
                (q, dequantize(q.weight, q.scale, torch.bfloat16)) for q in map(q8_0_quantize, (w, w2))
            )
        else:
            dw, dw2 = w, w2
        for M in args.rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
            kw = {"residual": dict(residual=res), "silu_mul": dict(up_weight=w2), "plain": {}}[kind]
            flops = 2 * M * N * K * (2 if kind == "silu_mul" else 1)

            def call(cfg=base, block_m=16, x=x, w=w, kw=kw):
                return skinny_linear(x, w, config=cfg, block_m=block_m, **kw)

            ref = call()
            row = {"default": base, "default_us": graph_us(lambda i: call(), 1, 10)}
            if kind == "silu_mul":
                row["cublas_us"] = graph_us(
                    lambda i, x=x, w=dw, w2=dw2: F.silu(F.linear(x, w)) * F.linear(x, w2), 1, 10
                )
            else:
                row["cublas_us"] = graph_us(lambda i, x=x, w=dw: F.linear(x, w), 1, 10)
            if TILE_ROWS < M < WIDE_ROWS:  # the default call: mid tiles (linear_configs.mid_tile)
                y = skinny_linear(x, w, **kw)
                us = graph_us(lambda i, x=x, w=w, kw=kw: skinny_linear(x, w, **kw), 1, 10)
                row["mid"] = [mid_tile(N, K, M, kind == "silu_mul", 2, "q8_0" if args.q8_0 else ""),
                              round(us, 2), bool(torch.equal(y.view(torch.int16), ref.view(torch.int16)))]  # fmt: skip
            row["wide"] = []
            best = None
            for bm, bn, warps, stages, *rest in extra if args.only_extra else [*WIDE, *extra]:
                cfg = (bn, rest[0] if rest else base[1], warps, stages, base[4], *rest[1:])  # (rest[1]: the way)
                try:
                    y = call(cfg, bm)
                except Exception as e:  # a tile that does not fit the SM's shared memory
                    row["wide"].append([bm, cfg, type(e).__name__])
                    continue
                same = bool(torch.equal(y.view(torch.int16), ref.view(torch.int16)))
                us = graph_us(lambda i, cfg=cfg, bm=bm: call(cfg, bm), 1, 10)
                row["wide"].append([bm, cfg, round(us, 2), same])
                if same and (best is None or us < best[2]):
                    best = (bm, cfg, us)
            row["best_same_bits"] = best
            result["shapes"][f"{N}x{K} {kind} M={M}"] = row
            tf = lambda us, flops=flops: flops / us / 1e6  # noqa: E731
            diff = [c for c in row["wide"] if len(c) == 4 and not c[3]]
            mid = f"mid {row['mid'][0]} {row['mid'][1]:.1f} us (bits {row['mid'][2]}), " if "mid" in row else ""
            print(
                f"wide: {N}x{K} {kind} M={M}: 16-row {row['default_us']:.1f} us ({tf(row['default_us']):.0f} TFLOP/s), "
                + mid
                + (f"best wide {best[0]} {best[1]} {best[2]:.1f} us ({tf(best[2]):.0f}), " if best else "no wide, ")
                + f"cuBLAS {row['cublas_us']:.1f} us ({tf(row['cublas_us']):.0f}); other bits: {diff}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
