"""What a sampled draw costs at the released vocabulary (248,320 columns): the chunked kernels of
nextn.sample.triton_wide against the torch ops the sampler used before them
(nextn.sample.pipeline.probs_from_logits, then sample), at 1, 4 and 7 rows, for a temperature law, Qwen's
suggested law (top-k 20, top-p 0.8: decided on the candidates), top-p 0.9 alone (decided on the
candidates) and the same on flat rows (logits near uniform: the nucleus outruns the candidates,
decided by passes over the row).
Timed in CUDA graphs of 20 calls (nextn.ops.linear_tune.graph_us).

    python bench/wide_sample_probe.py --out wide_sample_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's nextn, run from anywhere

import torch  # noqa: E402

from nextn.ops.linear_tune import graph_us  # noqa: E402
from nextn.sample.pipeline import (  # noqa: E402
    Law,  # noqa: E402
    SamplingParams,
    probs_from_logits,
    sample,
)
from nextn.sample.triton_wide import temperature_sample  # noqa: E402

V = 248_320
LAWS = {
    "T0.7": (dict(), 4.0),
    "T0.7_k20_p0.8": (dict(top_k=20, top_p=0.8), 4.0),
    "T0.7_p0.9": (dict(top_p=0.9), 4.0),
    "T0.7_p0.9_flat": (dict(top_p=0.9), 0.01),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(), "V": V, "laws": {}}
    for name, (f, scale) in LAWS.items():
        params = SamplingParams(temperature=0.7, **f)
        law = Law(torch.tensor(0.7, device=dev), **{k: torch.tensor(getattr(params, k), device=dev) for k in f})
        for rows in (1, 4, 7):
            g = torch.Generator(device=dev).manual_seed(rows)
            logits = [(torch.randn(rows, V, generator=g, device=dev) * scale).bfloat16() for _ in range(2)]
            u = torch.rand(rows, generator=g, device=dev, dtype=torch.float64)
            out = torch.empty(rows, V, device=dev)
            ids = torch.empty(rows, device=dev, dtype=torch.long)
            bounds = torch.empty(rows, 3, device=dev, dtype=torch.int32)

            def chunked(i, logits=logits, u=u, out=out, ids=ids, bounds=bounds if f else None, law=law):
                temperature_sample(logits[i], law, u, out=out, ids=ids, bounds=bounds)

            def reference(i, logits=logits, u=u, ids=ids, params=params):
                sample(probs_from_logits(logits[i], params), u, out=ids)

            entry = {"chunked_us": graph_us(chunked, 2, 20), "torch_us": graph_us(reference, 2, 20)}
            if f:
                entry["rows_covered"] = int(bounds[:, 2].sum())
            report["laws"].setdefault(name, {})[rows] = entry
            print(
                f"{name:16s} rows {rows}: chunked {entry['chunked_us']:7.1f} us, torch {entry['torch_us']:7.1f} us"
                + (f", {entry['rows_covered']} of {rows} rows decided on the candidates" if f else "")
            )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
