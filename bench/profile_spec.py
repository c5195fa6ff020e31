"""Where a speculative round's host time goes: cProfile of the round loop on a GPU (Python
functions by own time; time blocked on a device read shows under the read), beside the round's
GPU time from CUDA-event step costs.

python bench/profile_spec.py [--model nextn/default_model] [--spec-k 3] [--gen-len 256]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

from nextn.bench import BenchConfig, generate_once, text_prompt
from nextn.engine.fast import TritonStep
from nextn.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="nextn/default_model")
    ap.add_argument("--spec-k", type=int, default=3)
    ap.add_argument("--gen-len", type=int, default=256)
    args = ap.parse_args()
    model = load_model(args.model, device="cuda", dtype="bfloat16")
    step = TritonStep(model)
    cfg = BenchConfig(spec_ks=[args.spec_k], gen_len=args.gen_len, kernels="triton")
    prompt = text_prompt(args.model, 128)
    for k in (0, args.spec_k):
        generate_once(model, prompt, k, cfg, step)  # warm-up: compiles, captures
        run = generate_once(model, prompt, k, cfg, step)
        rounds = max(1, run.stats.num_rounds)
        print(f"K={k}: {len(run.token_ids) / run.seconds:.0f} tok/s, {run.seconds / rounds * 1e3:.3f} ms per round "
              f"({rounds} rounds)")
    prof = cProfile.Profile()
    prof.enable()
    run = generate_once(model, prompt, args.spec_k, cfg, step)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue()[-9000:])


if __name__ == "__main__":
    main()
