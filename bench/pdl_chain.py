"""Programmatic dependent launch on the step's GEMMs: Qwen3.5-9B's per-layer skinny GEMM chain
(fused q/k/v with its norm, o_proj + residual, gate/up SwiGLU, down_proj + residual) over 32
layers of distinct weights, replayed as one CUDA graph with `pdl` off and on, in one run.
Reports microseconds per chain, the weight bytes streamed per second, and the ratio.

    python bench/pdl_chain.py [--rows 1] [--layers 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from nextn.ops.triton_linear import skinny_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    H, I, QKV = 4096, 12288, 10240
    layers = [
        [torch.randn(n, k, device=dev, dtype=bf) * 0.02 for n, k in ((QKV, H), (H, H), (I, H), (I, H), (H, I))]
        for _ in range(args.layers)
    ]
    nbytes = sum(w.numel() * 2 for ws in layers for w in ws)
    nw = torch.zeros(H, device=dev, dtype=bf)
    result = {"layers": args.layers, "weight_bytes": nbytes, "rows": {}}
    for rows in args.rows:
        x = torch.randn(rows, H, device=dev, dtype=bf)

        def chain(pdl, x=x):
            h = x
            for qkv, o, gate, up, down in layers:
                q = skinny_linear(h, qkv, norm_weight=nw, pdl=pdl)
                a = skinny_linear(q[:, :H], o, residual=h, pdl=pdl)
                m = skinny_linear(a, gate, norm_weight=nw, up_weight=up, pdl=pdl)
                h = skinny_linear(m, down, residual=a, pdl=pdl)
            return h

        row = {}
        outs = {}
        for pdl in (False, True):
            chain(pdl)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs[pdl] = chain(pdl)
            graph.replay()
            times = []
            for _ in range(20):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            us = sorted(times)[len(times) // 2]
            row["pdl" if pdl else "plain"] = {"us": us, "GBps": nbytes / (us * 1e-6) / 1e9}
        row["same_bits"] = bool(torch.equal(outs[False], outs[True]))
        row["speedup"] = row["plain"]["us"] / row["pdl"]["us"]
        result["rows"][str(rows)] = row
        print(
            f"rows {rows}: plain {row['plain']['us']:.0f} us ({row['plain']['GBps']:.0f} GB/s), "
            f"pdl {row['pdl']['us']:.0f} us ({row['pdl']['GBps']:.0f} GB/s), x{row['speedup']:.3f}, "
            f"same bits {row['same_bits']}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
