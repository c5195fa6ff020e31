"""Sampled speculative acceptance of the bundled model through each step backend on one device.

The same prompt (the first 512 tokens of nextn/engine/rounds.py) and seeds 0..9, T = 0.7, K = 3,
256 tokens, through `kernels="torch"` (the reference modules, eager), `kernels="triton"` (the
fused step in CUDA graphs) and the fused step with `trace=True` (rounds one at a time): the
acceptance and the drafts accepted per position over all seeds. Every path is exact in law, so the
acceptance they reach should agree within the spread of the sampled paths.

  python bench/sampled_paths_check.py [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nextn.bench.offline import text_prompt
from nextn.core import SpecStats
from nextn.engine.llm import LLM
from nextn.sample.pipeline import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seeds", type=int, default=10)
    args = ap.parse_args()
    md = "nextn/default_model"
    prompt = text_prompt(md, 512, Path("nextn/engine/rounds.py").read_text())
    for kernels, trace in (("torch", False), ("triton", False), ("triton", True)):
        t = time.time()
        llm = LLM(md, device=args.device, dtype=args.dtype, num_speculative_tokens=3, kernels=kernels, trace=trace)
        total = SpecStats()
        for seed in range(args.seeds):
            params = SamplingParams(max_tokens=256, temperature=0.7, seed=seed, ignore_eos=True)
            out = llm.generate(prompt_token_ids=prompt, params=params)
            total.merge(out.spec)
            if seed < 3:
                print(
                    kernels,
                    trace,
                    seed,
                    out.spec.accepted_per_position[:3],
                    out.spec.num_rounds,
                    list(out.token_ids[:12]),
                )
        print(
            kernels,
            "trace" if trace else "",
            "acceptance",
            round(total.acceptance_rate, 3),
            "per position",
            total.accepted_per_position[:3],
            "of",
            total.num_rounds,
            f"{time.time() - t:.0f} s",
            flush=True,
        )
        llm.close()


if __name__ == "__main__":
    main()
