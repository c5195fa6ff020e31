"""Does a CUDA graph that holds programmatic dependent launches replay back to back as fast as alone?

Run 79 (bench/NOTES.md): with the MoE block's down kernel a programmatic dependent launch, the
35B-A3B step (one graph replay, timed alone) fell 2.618 -> 2.480 ms, but the plain decode loop, which
replays a round's graph per token while the round before runs, only 2.636 -> 2.604 ms a token. This
probe separates the candidates on a graph of LAYERS MoE blocks at Qwen3.5-35B-A3B's shape
(bench/moe_step_sweep.py's weights, 4 layers cycled), with `pdl` off and on, in one run:
- `alone_ms`: one replay between two events, synchronised (how `nextn bench` times a step);
- `back_to_back_ms`: 20 replays queued at once, per replay;
- `pipelined_ms`: 20 replays the way the plain loop runs them (replay, a pinned copy of a row
  and an event; then wait for the event of the replay before), per replay;
- `host_replay_us`: the host's time inside `graph.replay()` (median, after a synchronise).

  python bench/pdl_graph_probe.py [--layers 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's nextn, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from moe_step_sweep import EPS, IS, TOP_K, E, H, I, layer  # noqa: E402

from nextn.ops.triton_moe import moe_step  # noqa: E402


def probe(layers: int, pdl: bool, weights, norms, x0) -> dict:
    def block():
        x = x0
        for i in range(layers):
            x = moe_step(x, norms[i % len(weights)], EPS, *weights[i % len(weights)], TOP_K, True, pdl=pdl)
        return x

    block()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block()
    graph.replay()
    torch.cuda.synchronize()

    def events():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    alone, host = [], []
    for _ in range(10):
        start, end = events()
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        alone.append(start.elapsed_time(end))
    n = 20
    start, end = events()
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    back_to_back = start.elapsed_time(end) / n
    pinned = torch.empty(n, out.shape[1], dtype=out.dtype, pin_memory=True)
    marks = [torch.cuda.Event() for _ in range(n)]
    t0 = time.perf_counter()
    for i in range(n):
        graph.replay()
        pinned[i].copy_(out[0], non_blocking=True)
        marks[i].record()
        if i:
            marks[i - 1].synchronize()
    marks[-1].synchronize()
    pipelined = (time.perf_counter() - t0) * 1e3 / n
    return {
        "alone_ms": statistics.median(alone),
        "back_to_back_ms": back_to_back,
        "pipelined_ms": pipelined,
        "host_replay_us": statistics.median(host),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=40, help="MoE blocks in the graph (35B-A3B has 40)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [layer(E, H, I, IS, torch.bfloat16, device, gen) for _ in range(4)]
    norms = [torch.randn(H, generator=gen, device=device).bfloat16() * 0.1 for _ in weights]
    x0 = torch.randn(1, H, generator=gen, device=device).bfloat16()
    report = {"device": torch.cuda.get_device_name(), "layers": args.layers}
    for pdl in (False, True, False, True):  # twice each, interleaved: the spread between repeats
        row = probe(args.layers, pdl, weights, norms, x0)
        report.setdefault("pdl" if pdl else "no_pdl", []).append(row)
        print(f"pdl={pdl!s:5s} " + " ".join(f"{k} {v:.3f}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
