"""How many sequences of the Qwen3.5-9B shape fit one GPU at K=3, and that they all run at once
(issue 44: >= 192 sequences of 800 tokens in 80 GB).

An engine with random weights (the preset, drawn on the GPU) and `--gpu-memory-utilization`'s share
sizes its slot pool itself (max_num_seqs None: as many as fit, up to 256); then every slot gets a
request of `--prompt-len` random token ids and `--gen` greedy tokens (ignore_eos), so the cache fills
to prompt + gen tokens a sequence. The engine is stepped by hand to record how many requests ran
together. Writes --out (JSON): max_num_seqs, cache_bytes_per_sequence, the peak number running, the
device's memory, the tokens/s of the whole batch (prefills included).

Usage (device): python3 bench/fit_9b.py --tokenizer .tok/qwen3.5 --out $OUT/fit_9b.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import nextn
from nextn.engine.memory import bytes_per_sequence


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=800)
    ap.add_argument("--prompt-len", type=int, default=672)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.prompt_len + args.gen > args.max_model_len:
        sys.exit(f"fit_9b: --prompt-len + --gen ({args.prompt_len + args.gen}) is over --max-model-len")
    t0 = time.perf_counter()
    llm = nextn.LLM(
        random_weights=args.preset,
        tokenizer=args.tokenizer,
        num_speculative_tokens=args.k,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefill="steps",
    )
    engine = llm.engine
    n = engine.config.max_num_seqs
    start_s = time.perf_counter() - t0
    free, total = torch.cuda.mem_get_info()
    print(f"fit_9b: {n} sequences of {args.max_model_len} tokens at K={args.k} (engine up in {start_s:.0f} s; "
          f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free)", flush=True)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.cfg.vocab_size
    params = nextn.SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    for _ in range(n):
        engine.add(torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist(), params)
    done, peak, failed, tokens = set(), 0, [], 0
    t1 = time.perf_counter()
    while len(done) < n:
        peak = max(peak, len(engine.live))
        for req, ev in engine.step():
            if isinstance(ev, BaseException):
                failed.append(f"{type(ev).__name__}: {ev}")
                done.add(req.request_id)
            elif ev.output is not None:
                tokens += len(ev.output.token_ids)
                done.add(req.request_id)
    seconds = time.perf_counter() - t1
    result = {
        "preset": args.preset,
        "spec_k": args.k,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": n,
        "cache_bytes_per_sequence": bytes_per_sequence(
            engine.model.cfg, args.max_model_len, args.k, engine.runner.dtype, engine.config.kv_cache_dtype
        ),
        "cache_bytes": engine.runner.pool.cache.nbytes,
        "requests": n,
        "prompt_len": args.prompt_len,
        "gen": args.gen,
        "completed": n - len(failed),
        "failed": failed[:5],
        "peak_running": peak,
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "device_memory_total": total,
        "device": torch.cuda.get_device_name(),
        "command": "python3 bench/fit_9b.py " + " ".join(sys.argv[1:]),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"fit_9b: {result['completed']}/{n} completed, {peak} running at once, "
          f"{result['cache_bytes_per_sequence'] / 2**20:.1f} MiB a sequence, {result['tokens_per_s']:.0f} tok/s, "
          f"peak allocated {result['max_memory_allocated'] / 2**30:.1f} GiB -> {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
