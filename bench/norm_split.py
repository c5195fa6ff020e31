"""The rms prologue of the skinny GEMM against the norm as its own launch, on Qwen3.5-9B's normed
projections (GDN qkv|z, attention q|k|v, gate|up), bf16 and FP8 weights, 1 and 9 rows.

In the prologue every program sums the squares of the whole row before its k-loop and normalizes
each x tile in registers, which makes the tensor-core dot wait every tile (bench/NOTES.md, runs
64-68). Split, one launch writes the normalized rows (nextn.ops.triton_norm.rms_norm, the same
formula) and the GEMM loads them as they are. Each way is timed in a CUDA graph of 100 calls
cycling over weight copies past L2, at the block config `tune` picks for it; the report gives
microseconds per projection and the largest difference between the two ways' outputs.

  python bench/norm_split.py --out norm_split.json
  TRITON_INTERPRET=1 python bench/norm_split.py --check     # CPU: the two ways agree (tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's nextn, run from anywhere

import torch  # noqa: E402

from nextn.ops import triton_linear  # noqa: E402
from nextn.ops.fp8 import compact_scales, quantize  # noqa: E402
from nextn.ops.triton_linear import _graph_us, skinny_linear  # noqa: E402
from nextn.ops.triton_norm import rms_norm  # noqa: E402

SHAPES = [(12352, 4096, False), (10240, 4096, False), (12288, 4096, True)]  # (N, K, gate|up)


def prologue(x, w, nw, up, buf, config=None):
    return skinny_linear(x, w, norm_weight=nw, up_weight=up, config=config)


def split(x, w, nw, up, buf, config=None):
    rms_norm(x, nw, 1e-6, out=buf[: x.shape[0]])
    return skinny_linear(buf[: x.shape[0]], w, up_weight=up, config=config)


def weights(N, K, fp8, device, copies):
    def one():
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
        return compact_scales(quantize(w)) if fp8 else w

    return [one() for _ in range(copies)]


def check() -> None:
    """Both ways on tiny shapes (the interpreter): the same values up to the sum's order."""
    torch.manual_seed(0)
    for fp8 in (False, True):
        for dual in (False, True):
            w, up = weights(256, 256, fp8, "cpu", 2)
            x = torch.randn(5, 256, dtype=torch.bfloat16)
            nw = torch.randn(256, dtype=torch.bfloat16) * 0.1
            buf = torch.empty_like(x)
            a = prologue(x, w, nw, up if dual else None, buf).float()
            b = split(x, w, nw, up if dual else None, buf).float()
            diff = (a - b).abs().max().item() / a.abs().max().item()
            print(f"fp8={fp8} gate|up={dual}: largest difference {diff:.2e} of the largest output")
            assert diff < 2e-2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true", help="CPU: compare the two ways on tiny shapes")
    args = ap.parse_args()
    if args.check:
        return check()
    device = torch.device("cuda")
    torch.manual_seed(0)
    tuned = {}  # each way at its own best config (tune keeps one per shape and kind: run it per way)
    for norm in (True, False):
        shapes = [(N, K, norm, dual, fp8) for N, K, dual in SHAPES for fp8 in (False, True)]
        tuned["prologue" if norm else "split"] = triton_linear.tune(shapes, device, log=print)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    report = {"device": torch.cuda.get_device_name(), "tune": tuned, "shapes": {}}
    for N, K, dual in SHAPES:
        for fp8 in (False, True):
            nbytes = N * K * (1 if fp8 else 2) * (2 if dual else 1)
            copies = max(2, min(8, -(-4 * l2 // nbytes)))
            ws, ups = weights(N, K, fp8, device, copies), weights(N, K, fp8, device, copies) if dual else None
            nw = torch.randn(K, device=device, dtype=torch.bfloat16) * 0.1
            x = torch.randn(9, K, device=device, dtype=torch.bfloat16)
            buf = torch.empty_like(x)
            key = f"{N}x{K}{'_gate_up' if dual else ''}{'_fp8' if fp8 else ''}"
            entry = report["shapes"][key] = {}
            for rows in (1, 9):
                for name, way in (("prologue", prologue), ("split", split)):
                    cfg = tuple(tuned[name][triton_linear.config_key(N, K, fp8)]["config"])

                    def call(i, way=way, rows=rows, ws=ws, ups=ups, nw=nw, x=x, buf=buf, cfg=cfg):
                        way(x[:rows], ws[i], nw, ups[i] if ups else None, buf, cfg)

                    entry[f"{name} rows={rows}"] = us = _graph_us(call, copies, 100)
                    print(f"{key:24s} rows={rows} {name:8s} {us:7.1f} us ({nbytes / us / 1e3:5.0f} GB/s)")
            a = prologue(x, ws[0], nw, ups[0] if ups else None, buf).float()
            b = split(x, ws[0], nw, ups[0] if ups else None, buf).float()
            entry["max_rel_diff"] = (a - b).abs().max().item() / a.abs().max().item()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
