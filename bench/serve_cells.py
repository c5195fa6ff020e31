"""Merge bench/serve_bench.sh's cells ($OUT/serve_*.json) into one $OUT/serve_cells.json and drop them and
the servers' logs (the device tool brings back at most 8 files), printing a line a cell: output tok/s,
median TTFT and TPOT (ms), mean acceptance length, and the server's graph captures, eager runs and Triton
compiles. Usage (device scripts): python3 bench/serve_cells.py"""

from __future__ import annotations

import glob
import json
import os


def main() -> None:
    out = os.environ["OUT"]
    cells = {}
    for f in sorted(glob.glob(f"{out}/serve_*.json")):
        cells[os.path.basename(f)[:-5]] = json.load(open(f))
        os.remove(f)
    for f in glob.glob(f"{out}/server_*.log"):
        os.remove(f)
    json.dump({"cells": cells}, open(f"{out}/serve_cells.json", "w"), indent=1)
    for name, c in cells.items():
        g = c.get("graph_metrics", {})
        counts = [g.get(f"nextn:graph_{k}_total") for k in ("captures", "eager", "kernel_compiles")]
        print(name, round(c["output_throughput"]), round(c["median_ttft_ms"], 1), round(c["median_tpot_ms"], 2),
              c.get("mean_acceptance_length"), *counts)  # fmt: skip


if __name__ == "__main__":
    main()
