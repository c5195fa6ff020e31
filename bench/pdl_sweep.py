"""The skinny GEMM as a programmatic dependent launch (`skinny_linear(pdl=True)`, the default on Hopper)
against plain launches, at Qwen3.5-35B-A3B's GEMM shapes with the configs the run-97 bench
tuned on main (read from bench/results/bench_qwen3.5-35b-a3b_run97_main.json).

Two chains, each timed in a CUDA graph (`linear_tune.graph_us`, weights cycled out of L2), per mode:
- "same shape": one shape's calls back to back (how the tuner times a config);
- "layer": a GDN layer's two GEMMs as the step runs them, each reading the other's output: in_proj
  (12352x2048) over the norm's input, then out_proj (2048x4096) over the first 4096 columns of that
  output with the residual and the next norm's input, which the next in_proj reads.
Both launches' outputs are compared bit for bit. Run 98 timed five variants here: plain 22.2 us a
layer; wait and release at the start 26.1; wait, release after the k-loop (what the kernel keeps) 21.1;
an L2 prefetch of the first weight tiles before the wait, releasing at the start (run 97's) 26.6 or
after the k-loop 22.5.

    python bench/pdl_sweep.py --out pdl_sweep.json
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
MODES = (False, True)  # skinny_linear's pdl
COPIES = 8  # weight copies a chain cycles over (more than the 50 MB L2 holds)
REPS = 64


def configs() -> dict[tuple[int, int], tuple[int, ...]]:
    tuned = json.loads(RESULTS.read_text())["linear_configs"]
    return {tuple(map(int, k.split("x"))): tuple(v["config"]) for k, v in tuned.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    cfg = configs()

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(torch.bfloat16)

    result = {"device": torch.cuda.get_device_name(), "configs": {f"{n}x{k}": c for (n, k), c in cfg.items()}}
    x = {k: rand(1, k) for k in (2048, 4096)}
    for (n, k), c in cfg.items():
        if n > 100_000:
            continue  # the lm_head: one call a step, 1 GB a copy
        ws = [rand(n, k, scale=k**-0.5) for _ in range(COPIES)]
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        row = {}
        for mode in MODES:
            us = graph_us(
                lambda i, m=mode, xk=x[k], ws=ws, out=out, c=c: skinny_linear(xk, ws[i], out=out, config=c, pdl=m),
                COPIES,
                REPS,
            )
            row[str(mode)] = round(us, 3)
        result[f"same shape {n}x{k}"] = row
        print(
            f"same shape {n}x{k} {c}: " + "  ".join(f"pdl={m!s:5s} {us:6.2f} us" for m, us in row.items()), flush=True
        )

    # the layer chain
    H, P, V = 2048, 12352, 4096
    nw = rand(H, scale=0.3)
    w_in = [rand(P, H, scale=H**-0.5) for _ in range(COPIES)]
    w_out = [rand(H, V, scale=V**-0.5) for _ in range(COPIES)]
    h0 = rand(1, H)
    h_first, ni_first = skinny_linear(h0, rand(H, H, scale=H**-0.5), residual=h0, norm_out=nw)

    def layer_chain(mode, layers):
        h, ni = h_first, ni_first
        for i in range(layers):
            p = skinny_linear(None, w_in[i % COPIES], rms=ni, eps=1e-6, config=cfg[(P, H)], pdl=mode)
            h, ni = skinny_linear(p[:, :V], w_out[i % COPIES], residual=h, norm_out=nw, config=cfg[(H, V)], pdl=mode)
        return h

    plain = layer_chain(False, 2 * COPIES)
    row = {}
    for mode in MODES:
        equal = torch.equal(layer_chain(mode, 2 * COPIES), plain)
        us = graph_us(lambda i, m=mode: layer_chain(m, COPIES), 1, 4) / COPIES
        row[str(mode)] = {"us_per_layer": round(us, 3), "equals_plain": equal}
        print(f"layer chain pdl={mode!s:5s}: {us:6.2f} us a layer, equal {equal}", flush=True)
    result["layer chain"] = row
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
