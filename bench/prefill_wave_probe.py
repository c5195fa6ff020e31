"""Where a served wave's prefill goes: N prompts of L random token ids arrive together at an idle
engine (serve's settings: --prefill steps with the prefix cache unless told), and the engine steps
until every one has its first token, under torch.profiler.

It prints the wave's wall time (its prompts' TTFT on the engine alone: no HTTP), each engine step's
wall time and prefill rows, the CUDA time the kernels take against that wall (is the wave GPU-bound
or host-bound?), and the kernels by total GPU time. One warm-up wave of the same shape runs first,
unprofiled (compiles, graphs, the prefix cache holds nothing the measured prompts share: other ids).

Usage (device): python3 bench/prefill_wave_probe.py [--preset qwen3.5-9b] [--prompts 16] [--prompt-len 512]
  [--prefill steps|chunked] [--no-prefix-cache] [--max-num-batched-tokens 8448] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from profile_prefill import kernel_totals  # (bench/ is on the path of a bench script)

from nextn.bench.measure import sync_device


def wave(engine, prompts: list[list[int]], params) -> list[tuple[float, int]]:
    """The prompts added at once, steps until each has a first token: [(step wall s, prefill rows)]."""
    waiting = {engine.add(p, params, use_sessions=True, detokenize=False).request_id for p in prompts}
    steps = []
    while waiting:
        t0 = time.perf_counter()
        events = engine.step()
        steps.append((time.perf_counter() - t0, engine.prefilled_rows))
        for req, ev in events:
            if isinstance(ev, BaseException):
                raise ev
            if ev.token_ids:
                waiting.discard(req.request_id)
    while engine.scheduler.running:  # the wave's decodes end (max_tokens), unprofiled by the caller's choice
        engine.step()
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--model", default=None, help="a checkpoint, not the preset (a CPU check)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prefill", default="steps")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8448)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from nextn.core import SamplingParams
    from nextn.engine.llm import LLM

    settings = dict(
        max_model_len=1024,
        max_num_seqs=args.prompts,
        num_speculative_tokens=0,
        prefill=args.prefill,
        enable_prefix_caching=not args.no_prefix_cache and args.prefill == "steps",
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    if args.model is None:
        settings.update(random_weights=args.preset, tokenizer="nextn/default_model")
    llm = LLM(args.model, **settings)
    cuda = torch.cuda.is_available()
    engine = llm.engine
    vocab = min(engine.runner.cfg.vocab_size, 150_000)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)

    def draw() -> list[list[int]]:
        return [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]

    wave(engine, draw(), params)  # warm-up
    measured = draw()
    sync_device(engine.runner.device)
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        t0 = time.perf_counter()
        steps = wave(engine, measured, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        sync_device(engine.runner.device)
        wall = time.perf_counter() - t0
    rows = kernel_totals(prof)
    busy = sum(r[0] for r in rows) / 1e6
    tokens = args.prompts * args.prompt_len
    result = {
        "settings": settings,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "wave_wall_s": wall,
        "prefill_tokens_per_s": tokens / wall,
        "cuda_kernel_s": busy,
        "launches": sum(r[1] for r in rows),
        "steps": [{"wall_ms": 1e3 * s, "prefill_rows": n} for s, n in steps],
        "kernels": [{"name": k[:120], "count": n, "ms": us / 1e3} for us, n, k in rows[:30]],
    }
    tag = f"[{args.prefill}{'' if settings['enable_prefix_caching'] else ' nocache'}]"
    print(
        f"{tag} {args.prompts} x {args.prompt_len} tokens: wave {wall * 1e3:.1f} ms ({tokens / wall:.0f} tok/s), "
        f"CUDA kernels {busy * 1e3:.1f} ms, {result['launches']} launches; steps (ms, rows): "
        + ", ".join(f"({1e3 * s:.1f}, {n})" for s, n in steps)
    )
    for k in result["kernels"][:22]:
        print(f"{tag}   {k['ms']:9.2f} ms {k['count']:6d}x  {k['name'][:100]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
