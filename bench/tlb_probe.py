"""Does a skinny GEMM slow down as the weights it cycles over spread over more memory?

In the 35B-A3B step (run 89's profile) the skinny GEMMs' kernels take 1,355 us a token for 81 launches,
while the tuner times the same shapes at ~1,040 us (graphs of one shape's calls cycling over 8 weight
copies, 0.1-0.4 GB). One difference is the memory a step spans: ~67 GB of weights, each launch on a
region of its own, where the tuner's copies stay within a few hundred MB, so the GPU's address
translation (TLB) may miss at the start of every in-step launch and not in the tuner. This probe
times one shape's launches in a CUDA graph (`linear_tune.graph_us`) cycling over C copies of its
weight, C from 4 up to ~16 GB of copies, with the copies allocated one tensor each (as the loader
does) and as slices of one allocation. Per-call time rising with C at equal bytes a call points at
translation; flat means the in-step overhead is elsewhere.

    python bench/tlb_probe.py --out tlb_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's nextn, run from anywhere

import torch  # noqa: E402

from nextn.ops.linear_tune import graph_us  # noqa: E402
from nextn.ops.triton_linear import skinny_linear  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_qwen3.5-35b-a3b_run97_main.json"
SHAPES = [(12352, 2048), (2048, 4096)]
BUDGET = 16 << 30  # bytes of weight copies at the largest C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    tuned = json.loads(RESULTS.read_text())["linear_configs"]
    result = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for n, k in SHAPES:
        config = tuple(tuned[f"{n}x{k}"]["config"])
        nbytes = n * k * 2
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        counts = [c for c in (4, 16, 64, 256, 1024) if c * nbytes <= BUDGET]
        rows = {}
        for layout in ("tensors", "one allocation"):
            for c in counts:
                if layout == "tensors":
                    ws = [torch.empty(n, k, device=dev, dtype=torch.bfloat16).normal_(std=k**-0.5) for _ in range(c)]
                else:
                    arena = torch.empty(c, n, k, device=dev, dtype=torch.bfloat16).normal_(std=k**-0.5)
                    ws = list(arena.unbind(0))
                us = graph_us(
                    lambda i, ws=ws, x=x, out=out, cf=config: skinny_linear(x, ws[i], out=out, config=cf), c, max(64, c)
                )
                rows[f"{layout} C={c}"] = {
                    "us": round(us, 3),
                    "GB/s": round(nbytes / us / 1e3, 1),
                    "GB": c * nbytes / 1e9,
                }
                print(f"{n}x{k} {config} {layout:14s} C={c:5d} ({c * nbytes / 1e9:5.1f} GB): {us:7.2f} us a call, "
                      f"{nbytes / us / 1e3:6.0f} GB/s", flush=True)  # fmt: skip
                del ws
                if layout != "tensors":
                    del arena
                torch.cuda.empty_cache()
        result["shapes"][f"{n}x{k}"] = {"config": config, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
