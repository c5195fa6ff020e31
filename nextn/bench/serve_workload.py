"""`nextn bench serve`'s workload: the prompts (random token ids, or slices of a text file, with an
optional shared prefix; warm-ups drawn apart from them) and their Poisson send times, seeded, as
vLLM's random dataset draws them (lengths uniform in [len * (1 - ratio), len * (1 + ratio)])."""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path
from typing import NamedTuple


class Prompt(NamedTuple):
    prompt: str | list[int]  # text, or token ids (the completions `prompt` field takes either)
    input_len: int  # tokens (characters / 4 without a tokenizer)
    output_len: int  # max_tokens


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request leaves: Poisson arrivals at `rate` per second
    (exponential gaps drawn from a generator seeded with `seed`), the first at 0; all at 0 for inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def sample_prompts(args, tokenizer) -> list[Prompt]:
    """`--num-prompts` prompts, the same for the same `--seed`: random token ids from the tokenizer's
    vocabulary, or slices of `--prompt-file` from random offsets (the file repeated where too short).
    `--random-range-ratio` spreads both lengths for the random dataset (vLLM's), the input lengths
    only for a prompt file (its outputs are `--random-output-len` each). `--prefix-len N`: every
    prompt starts with the same N tokens (drawn once the same way) before its own."""
    rng = random.Random(args.seed)
    prefix = _prompts(args, tokenizer, rng, [args.prefix_len], [0])[0] if args.prefix_len else None

    def lengths(mean: int, ratio: float) -> list[int]:
        return [max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio)))) for _ in range(args.num_prompts)]

    ratio = args.random_range_ratio
    input_lens = lengths(args.random_input_len, ratio)
    output_lens = lengths(args.random_output_len, ratio if args.prompt_file is None else 0.0)
    prompts = _prompts(args, tokenizer, rng, input_lens, output_lens)
    if prefix is None:
        return prompts
    return [Prompt(prefix.prompt + p.prompt, prefix.input_len + p.input_len, p.output_len) for p in prompts]


def warmup_prompts(args, tokenizer) -> list[Prompt]:
    """`--num-warmups` prompts drawn apart from the measured ones (the next seed, no shared prefix,
    each as long as a measured prompt with its prefix): they warm the server's kernels and graphs at
    the run's shapes without leaving the measured prompts' blocks in a prefix cache."""
    if not args.num_warmups:
        return []
    apart = argparse.Namespace(
        **{**vars(args), "seed": args.seed + 1, "prefix_len": 0, "num_prompts": args.num_warmups}
    )
    apart.random_input_len = args.random_input_len + args.prefix_len
    return sample_prompts(apart, tokenizer)


def _prompts(args, tokenizer, rng: random.Random, input_lens: list[int], output_lens: list[int]) -> list[Prompt]:
    pairs = zip(input_lens, output_lens, strict=True)
    if args.prompt_file is None:
        return [Prompt([rng.randrange(tokenizer.vocab_size) for _ in range(n)], n, m) for n, m in pairs]
    text = Path(args.prompt_file).read_text(errors="replace")
    if not text:
        raise ValueError(f"--prompt-file {args.prompt_file}: empty")
    if tokenizer is None:  # a token taken as 4 characters
        return [Prompt(_cut(text, rng.randrange(len(text)), 4 * n), n, m) for n, m in pairs]
    ids = tokenizer.encode(text)
    return [Prompt(tokenizer.decode(_cut(ids, rng.randrange(len(ids)), n)), n, m) for n, m in pairs]


def _cut(source, start: int, n: int):
    """n items of `source` from `start`, wrapping around to its beginning."""
    out = source[start : start + n]
    while len(out) < n:
        out += source[: n - len(out)]
    return out
