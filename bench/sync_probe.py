"""Where the engine's host waits for the GPU, on a GPU: torch.cuda.set_sync_debug_mode("warn")
over `LLM.generate` runs after a warm-up, each synchronizing call's stack counted at its innermost
nextn frame. A step should wait only where it reads a round (nextn.engine.rounds: the event of the
round's copy) and where a prefill pass apart ends (the step's one host wait); anything else drains
the rounds queued ahead and leaves the GPU idle while the host works (run 203: a request's
finish and start each waited so, a mixed round's capture synchronized the device).

The bundled model (or --random-weights PRESET with --tokenizer DIR), --requests prompts of staggered
lengths and output lengths (so requests start and finish one by one, as a served closed loop has
them), 16 at a time, chunked prefill with a 512-token budget (mixed steps) and greedy decoding at
each K of --spec-k, then a seeded sampled run with penalties and min_tokens.

python bench/sync_probe.py [--spec-k 0 3] [--requests 48] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

import nextn

ROOT = str(Path(nextn.__file__).parent)


def where(stack: list) -> str:
    """The innermost nextn frame of a stack (and its caller), as file:line function."""
    ours = [f for f in stack if f.filename.startswith(ROOT)]
    if not ours:
        return "outside nextn"
    names = [f"{f.filename[len(ROOT) - 5 :]}:{f.lineno} {f.name}" for f in ours[-2:]]
    return " <- ".join(reversed(names))


def probe(llm, prompts: list[list[int]], params: list) -> Counter:
    counts: Counter = Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        counts[where(traceback.extract_stack()[:-1])] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-weights", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--spec-k", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "cells": {}}
    for k in args.spec_k:
        settings = dict(num_speculative_tokens=k, max_num_seqs=16, max_model_len=1024, prefill="chunked")
        settings.update(max_num_batched_tokens=512, k_policy="fixed", dtype="bfloat16")
        if args.random_weights:
            settings.update(random_weights=args.random_weights, tokenizer=args.tokenizer)
        llm = nextn.LLM(**settings)
        V = llm.model.cfg.vocab_size
        rng = random.Random(k)
        prompts = [[rng.randrange(100, V - 100) for _ in range(rng.randrange(60, 900))] for _ in range(args.requests)]
        lengths = [rng.randrange(16, 128) for _ in prompts]
        greedy = [nextn.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
        sampled = [
            nextn.SamplingParams(
                max_tokens=p.max_tokens, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True,
                repetition_penalty=1.1, min_tokens=4,
            )
            for i, p in enumerate(greedy)
        ]  # fmt: skip
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # warm-up: graphs
            counts = probe(llm, prompts, params)
            steps = llm.engine.time.steps
            report["cells"][f"k{k}_{name}"] = {"syncs": dict(counts.most_common()), "engine_steps": steps}
            print(f"K={k} {name}: {sum(counts.values())} synchronizing calls (engine steps so far {steps})")
            for at, n in counts.most_common(12):
                print(f"  {n:6d}  {at}")
        llm.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
