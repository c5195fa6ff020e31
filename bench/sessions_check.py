"""Kept sessions against cold runs on one device: a 6-turn conversation (each turn's prompt is the
previous prompt, the reply and new user text from a held-out file), greedy and seeded sampled,
with prefill="steps"; per turn, whether the resumed session's reply equals a cold engine's.

python bench/sessions_check.py [--device cuda] [--file tests/test_batching.py] [--out F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import nextn

MODES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_k=20, seed=1234),
}


def conversation(warm, cold, sampling: dict, chunks: list[str], max_tokens: int) -> list[dict]:
    params = nextn.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    prompt: list[int] = []
    turns = []
    for text in chunks:
        prompt = prompt + warm.tokenizer.encode(text)
        resumed = warm.generate(prompt_token_ids=prompt, params=params, use_sessions=True)
        fresh = cold.generate(prompt_token_ids=prompt, params=params)
        turns.append(
            {
                "prompt_tokens": len(prompt),
                "cached": resumed.cached_tokens,
                "equal": resumed.token_ids == fresh.token_ids,
            }
        )
        prompt = prompt + resumed.token_ids
    return turns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--file", default="tests/test_batching.py", help="held-out text the user turns come from")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = Path(args.file).read_text().splitlines(keepends=True)
    step = max(1, len(lines) // args.turns)
    chunks = ["".join(lines[i * step : (i + 1) * step]) for i in range(args.turns)]
    kw = dict(device=args.device, num_speculative_tokens=3, prefill="steps", max_model_len=4096)
    warm, cold = nextn.LLM(**kw), nextn.LLM(**kw)
    res = {
        "device": torch.cuda.get_device_name() if warm.config.device.startswith("cuda") else "cpu",
        "dtype": warm.config.dtype,
        "kernels": warm.config.kernels,
        "prefill": warm.config.prefill,
        "file": args.file,
        "max_tokens": args.max_tokens,
        "turns": {},
        "resumed_equals_cold": {},
        "command": "python bench/sessions_check.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
    }
    for mode, sampling in MODES.items():
        turns = conversation(warm, cold, sampling, chunks, args.max_tokens)
        res["turns"][mode] = turns
        res["resumed_equals_cold"][mode] = [t["equal"] for t in turns]
        print(mode, [(t["cached"], t["equal"]) for t in turns], flush=True)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
