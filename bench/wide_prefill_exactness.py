"""Exactness with wide-tile prefills on the GPU (run 150): the bundled model, a 300-token prompt and two
more turns (reply + 30 new tokens each), greedy: a session resumed from kept state (its reply's rows
were decode rows, in 16-row tiles) equals a cold engine's prefill of the whole conversation (300-440
rows a step, wide tiles: nextn.ops.linear_configs.WIDE_ROWS), and spec K=3 equals plain K=0.
Usage (device): python3 bench/wide_prefill_exactness.py [--json OUT]"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

import nextn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kw = dict(device="cuda", dtype="bfloat16", num_speculative_tokens=3, prefill="steps")
    warm, cold = nextn.LLM(**kw), nextn.LLM(**kw)
    plain = nextn.LLM(**dict(kw, num_speculative_tokens=0))
    rng = random.Random(5)
    params = nextn.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = [rng.randrange(8000) for _ in range(300)]
    turns = []
    for _ in range(3):
        resumed = warm.generate(prompt_token_ids=prompt, params=params, use_sessions=True)
        fresh = cold.generate(prompt_token_ids=prompt, params=params)
        base = plain.generate(prompt_token_ids=prompt, params=params)
        turns.append(
            dict(
                prompt_tokens=len(prompt),
                cached_tokens=resumed.cached_tokens,
                resumed_equals_cold=resumed.token_ids == fresh.token_ids,
                spec_equals_plain=fresh.token_ids == base.token_ids,
            )
        )
        prompt = prompt + resumed.token_ids + [rng.randrange(8000) for _ in range(30)]
    print("wide-prefill exactness:", turns)
    if args.json:
        out = {"device": torch.cuda.get_device_name(), "turns": turns}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
