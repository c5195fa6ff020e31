"""Issue 44's 16-stream TTFT cell on the engine alone: no HTTP, no core process, no detokenizing.

The bundled model with serve's engine settings (K=3 with the K policy, --max-num-seqs 64, steps
prefill unless --prefill chunked, the prefix cache on unless --no-prefix-cache), prompts of 60-900
tokens cut from nextn/engine/rounds.py, 128 greedy output tokens each (ignore_eos), a closed loop
of 16 streams (a request leaves as one finishes) driving `Engine.add` / `Engine.step` directly.
It prints what the served figures leave unexplained:
- TTFT (arrival to the step that returns the first token) median / p99, output tokens/s;
- the engine steps: how many prefilled, their mean wall time and rows, the others' mean wall time;
- Triton compiles during the timed requests (kernel name and specialization key, seconds each);
- with --profile, torch.profiler's CUDA kernel totals over the timed requests, and the CUDA busy
  time against the wall time.
- with --keys, the mixed rounds' graph keys (`watch_mixed_keys`; the CPU runs it too).
Usage (device): python3 bench/serve_core_probe.py [--no-prefix-cache] [--prefill chunked] [--profile | --cprofile]
  [--keys] [--json OUT]."""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time
from pathlib import Path

import torch


def record_compiles() -> list:
    """Every Triton JIT compile from now on: (kernel, key, seconds). The hooks chain after those
    already set (the engine's own count and warning: nextn.ops.triton_utils.watch_compiles)."""
    import triton.knobs as knobs

    seen, started = [], {}
    cache_hook, post_hook = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

    def before(**kw):
        started[kw["key"]] = time.perf_counter()
        return cache_hook(**kw) if cache_hook is not None else False

    def after(**kw):
        t = started.pop(kw["key"], time.perf_counter())
        seen.append((kw["fn"].name, str(kw["key"]), time.perf_counter() - t))
        return post_hook(**kw) if post_hook is not None else False

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after
    return seen


def watch_mixed_keys(engine) -> dict:
    """The mixed rounds' graph keys from now on (nextn.engine.rounds.launch: the pieces by count, total
    rows and chunks, a pad piece filling them to a bucket), beside the keys by each piece's rows they
    replaced, and the chunked rule's rows: the pieces' own, padded to the longest (the layout before),
    padded to whole chunks (now); and the trunk's rows with the pad pieces'. The rounds are padded as
    with graphs (pad_rounds), on the CPU too."""
    runner, seen = engine.runner, {"keys": collections.Counter(), "by_rows": collections.Counter()}
    runner.pad_rounds = True  # (as with graphs: rounds padded to their bucket, pieces by a pad piece)
    seen.update(rows=0, padded_to_longest=0, whole_chunks=0, padded_rows=0)
    run, resplit = runner.run, runner.resplit

    def watched_run(key, fn, *args, mixed=False, **kw):
        if mixed:
            seen["keys"][key] += 1
        return run(key, fn, *args, mixed=mixed, **kw)

    def watched_resplit(caches, rows, pieces_from, chunked, chunks=None):
        real = len(rows) - (chunks is not None)  # (a pad piece last: rounds._pad_piece)
        members, pieces = tuple(rows[:pieces_from]), tuple(rows[pieces_from:real])
        seen["by_rows"][(members, pieces)] += 1
        seen["rows"] += sum(pieces)
        seen["padded_to_longest"] += len(pieces) * max(pieces)
        seen["whole_chunks"] += sum(-(-n // 64) * 64 for n in pieces)
        seen["padded_rows"] += sum(rows[pieces_from:])
        return resplit(caches, rows, pieces_from, chunked, chunks)

    runner.run, runner.resplit = watched_run, watched_resplit
    return seen


def key_counts(seen: dict) -> dict:
    """`watch_mixed_keys`' record in figures."""
    keys, by_rows = seen["keys"], seen["by_rows"]
    return {
        "mixed_rounds": sum(keys.values()),
        "keys": len(keys),
        "keys_met_once": sum(n == 1 for n in keys.values()),
        "keys_by_piece_rows": len(by_rows),
        "keys_by_piece_rows_met_once": sum(n == 1 for n in by_rows.values()),
        # the pieces' part of the keys alone (the members' part: their bucket, Ks and sampler kinds)
        "piece_sizes": len({key[-2][-1] for key in keys}),
        "piece_rows": len({pieces for _, pieces in by_rows}),
        "chunk_rule_rows": {k: seen[k] for k in ("rows", "padded_to_longest", "whole_chunks")},
        "trunk_rows_with_pads": seen["padded_rows"],  # the pieces' and their pad pieces' rows
    }


def prompts(tokenizer, n: int, seed: int, length: int | None = None) -> list[list[int]]:
    """n prompts of 60-900 tokens cut from nextn/engine/rounds.py, or of `length` random token ids (the
    tokenizer's vocabulary, as `nextn bench serve --dataset random` sends)."""
    rng = random.Random(seed)
    if length:
        vocab = tokenizer.vocab_size
        return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
    ids = tokenizer.encode(Path("nextn/engine/rounds.py").read_text())
    out = []
    for _ in range(n):
        length = rng.randint(60, 900)
        start = rng.randrange(len(ids))
        out.append([ids[(start + i) % len(ids)] for i in range(length)])
    return out


def closed_loop(engine, todo: list[list[int]], streams: int, params) -> dict:
    """The requests at `streams` at once, each leaving as another finishes; per-request TTFT and the
    steps' wall times."""
    pending = list(todo)
    live, ttft, ttft_steps, steps, out_tokens = {}, [], [], [], 0
    t_start = time.perf_counter()

    def send():
        req = engine.add(pending.pop(0), params, use_sessions=True, detokenize=False)  # as the core adds them
        live[req.request_id] = [time.perf_counter(), None, len(steps)]

    for _ in range(min(streams, len(pending))):
        send()
    while live:
        t0 = time.perf_counter()
        events = engine.step()
        t1 = time.perf_counter()
        steps.append((t1 - t0, engine.prefilled_rows, len(engine.scheduler.running)))
        for req, ev in events:
            if isinstance(ev, BaseException):
                raise ev
            rec = live[req.request_id]
            if ev.token_ids and rec[1] is None:
                rec[1] = t1
                ttft.append(t1 - rec[0])
                ttft_steps.append(len(steps) - rec[2])  # engine steps from its arrival to its first token
            out_tokens += len(ev.token_ids)
            if ev.output is not None:
                del live[req.request_id]
                if pending:
                    send()
    wall = time.perf_counter() - t_start
    pre = [s for s in steps if s[1]]
    dec = [s for s in steps if not s[1]]
    return {
        "requests": len(todo),
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall,
        "median_ttft_ms": 1e3 * statistics.median(ttft),
        "p99_ttft_ms": 1e3 * sorted(ttft)[int(0.99 * (len(ttft) - 1))],
        "median_ttft_steps": statistics.median(ttft_steps),
        "ttft_steps_hist": dict(sorted(collections.Counter(ttft_steps).items())),
        "steps": len(steps),
        "prefill_steps": len(pre),
        "prefill_step_ms_mean": 1e3 * statistics.mean(s[0] for s in pre) if pre else None,
        "prefill_step_rows_mean": statistics.mean(s[1] for s in pre) if pre else None,
        "prefill_steps_s": sum(s[0] for s in pre),
        "other_step_ms_mean": 1e3 * statistics.mean(s[0] for s in dec) if dec else None,
        "other_steps_s": sum(s[0] for s in dec),
        "step_ms_hist": dict(collections.Counter(min(int(s[0] * 1e3), 50) for s in steps)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--prefill", default="steps")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument(
        "--profile", action="store_true", help="the timed requests once plain, then again under torch.profiler (CUDA)"
    )
    ap.add_argument(
        "--cprofile", action="store_true", help="the timed requests under cProfile: the host's time by function"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=None, help="prompts of this many random ids (the 9B cell's)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--kernels", default=None, help="the engine's kernels (default: its own choice)")
    ap.add_argument("--random-weights", default=None, help="a preset's shape (the bundled tokenizer's ids)")
    ap.add_argument("--spec-k", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--keys", action="store_true", help="count the mixed rounds' graph keys (`watch_mixed_keys`)")
    args = ap.parse_args()
    from nextn.core import SamplingParams
    from nextn.engine.llm import LLM

    settings = dict(
        num_speculative_tokens=args.spec_k,
        max_num_seqs=args.max_num_seqs,
        prefill=args.prefill,
        enable_prefix_caching=not args.no_prefix_cache,
    )
    if args.max_num_batched_tokens:
        settings["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kernels:
        settings["kernels"] = args.kernels
    if args.spec_k:
        settings["k_policy"] = "auto"
    if args.random_weights:
        settings.update(random_weights=args.random_weights, tokenizer="nextn/default_model", max_model_len=1024)
    t = time.perf_counter()
    llm = LLM(None, **settings)
    print(f"probe: {settings}: LLM ready in {time.perf_counter() - t:.1f} s")
    engine = llm.engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if torch.cuda.is_available():  # warm-up, apart from the measured (kernels and graphs at these shapes)
        closed_loop(engine, prompts(llm.tokenizer, 32, 8, args.prompt_len), args.streams, params)
        compiles = record_compiles()
    else:
        compiles = []
    measured = prompts(llm.tokenizer, args.num_prompts, 7, args.prompt_len)
    seen = watch_mixed_keys(engine) if args.keys else None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        result = closed_loop(engine, measured, args.streams, params)  # unprofiled first: the figures
        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # (CUDA alone: the least host overhead)
            again = closed_loop(engine, measured, args.streams, params)
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        busy = sum(e.self_device_time_total for e in events) / 1e6
        result["profiled_wall_s"] = again["wall_s"]
        result["cuda_busy_s"] = busy  # the kernels' time in the profiled loop: wall - busy is the GPU idle
        result["cuda_busy_over_wall"] = busy / again["wall_s"]
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:25]
        result["cuda_kernels"] = [(e.key[:80], e.count, e.self_device_time_total / 1e3) for e in top]
    elif args.cprofile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        result = closed_loop(engine, measured, args.streams, params)
        prof.disable()
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(35)
            print(f"probe: cProfile by {key}:")
            print("\n".join(line[:200] for line in text.getvalue().splitlines()[4:50]))
    else:
        result = closed_loop(engine, measured, args.streams, params)
    result["compiles"] = compiles
    if seen is not None:
        result["mixed_keys"] = key_counts(seen)
    result["settings"] = settings
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tag = f"[{args.prefill}{' nocache' if args.no_prefix_cache else ''}{' prof' if args.profile else ''}]"
    for k, v in result.items():
        if k in ("cuda_kernels", "compiles"):
            print(f"{tag} {k}:")
            for row in v:
                print(f"{tag}   {row}")
        else:
            print(f"{tag} {k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
