"""Which kernels' programmatic dependent launches (PDL) move the step, and which way.

Per preset (random weights, bf16, Triton): the trunk step at T = 1 (a decode) to T = 4 (a K = 3
verify) and the MTP head step, as graph replays (`Bench.step_costs`), with PDL on in every kernel,
then off in one module's kernels at a time (each module's `pdl_supported` answering False, as
tests/test_step.py's PDL test does), in the GEMMs and MoE kernels together or over one row only,
then off everywhere, then on everywhere again (the drift within the process). The GEMM configs are
tuned once at the start and kept for every case.

    python bench/pdl_attribution.py --preset qwen3.5-35b-a3b qwen3.5-9b --out pdl_attribution.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's nextn, run from anywhere

import torch  # noqa: E402

from nextn.bench.measure import Bench, BenchConfig  # noqa: E402
from nextn.models.random_weights import random_model  # noqa: E402
from nextn.ops import triton_attention, triton_gdn, triton_linear, triton_moe  # noqa: E402

MODULES = {"linear": triton_linear, "moe": triton_moe, "gdn": triton_gdn, "attention": triton_attention}
# (label, {module: "off" | "one row"}): "one row" keeps PDL in launches over one row (a decode) only
CASES = [
    ("all on", {}),
    ("linear off", {"linear": "off"}),
    ("moe off", {"moe": "off"}),
    ("gdn off", {"gdn": "off"}),
    ("attention off", {"attention": "off"}),
    ("linear+moe off", {"linear": "off", "moe": "off"}),
    ("linear+moe one row", {"linear": "one row", "moe": "one row"}),
    ("all off", dict.fromkeys(MODULES, "off")),
    ("all on again", {}),
]


def _policy(real, mode):
    if mode == "off":
        return lambda tensor: False
    if mode == "one row":
        return lambda tensor: real(tensor) and tensor.shape[0] == 1
    return real


def measure(preset: str, iters: int, device: str = "cuda") -> dict:
    model = random_model(preset, device, "bfloat16")
    prompt = torch.randint(0, model.cfg.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    bench = Bench(model, prompt, BenchConfig(spec_ks=[3], gen_len=64, kernels="triton", iters=iters))
    if device == "cuda":
        bench.core(0)[1].step.tune(log=lambda *a, **k: None)
    real = {name: module.pdl_supported for name, module in MODULES.items()}
    out = {}
    try:
        for label, modes in CASES:
            for name, module in MODULES.items():
                module.pdl_supported = _policy(real[name], modes.get(name))
            bench.close()
            bench.cores.clear()  # a new engine: graphs captured with this case's launches
            costs = bench.step_costs([3])
            row = {"step_ms": {str(t): round(ms, 4) for t, ms in costs["step_ms"].items()}}
            row["head_step_ms"] = round(costs["head_step_ms"], 4) if costs["head_step_ms"] else None
            out[label] = row
            steps = "  ".join(f"T={t} {ms:.4f}" for t, ms in row["step_ms"].items())
            print(f"{preset} {label:14s}: {steps}  head {row['head_step_ms']} ms", flush=True)
    finally:
        for name, module in MODULES.items():
            module.pdl_supported = real[name]
        bench.close()
    del bench, model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", nargs="+", default=["qwen3.5-35b-a3b"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "cases": dict(CASES)}
    for preset in args.preset:
        result[preset] = measure(preset, args.iters)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
