"""Where a round's time goes on the GPU: GPU time per kernel name over eager rounds of the engine
(torch.profiler), for plain decoding and for K drafts, and the replayed round against its steps;
where every round launches the same kernels (plain decoding), each launch's time in round order
(`sequence_us`: the i-th skinny GEMM is the same layer's projection every round, so a shape's time
in the step can be set against its time alone in `linear_tune`).

python bench/profile_round.py (--model DIR | --preset qwen3.5-9b) [--k 3] [--batch B]
    [--sampled 0.7 0.7,20,0.8 ...] [--plain-sampled] [--out profile.json]

--batch B: B requests decoding together (one batched round per step), as continuous batching runs them.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from nextn.bench.measure import Bench, BenchConfig
from nextn.core import SamplingParams
from nextn.engine.rounds import RequestRounds, advance
from nextn.engine.scheduler import RoundSettings
from nextn.models.loader import load_model
from nextn.models.random_weights import random_model


def kernels_per_round(
    bench: Bench, k: int, sampling: dict, rounds: int = 8, B: int = 1
) -> tuple[list, float, list | None]:
    """(rows of (us per round, launches per round, kernel name), GPU ms per round, the round's
    launches in order as [name, mean us] or None where rounds launch different sequences) over eager
    rounds of B requests together."""
    _, runner, proposer = bench.core(k, B)
    runner.use_graphs = False
    params = SamplingParams(max_tokens=4 * rounds + 8, seed=0, ignore_eos=True, **sampling)
    loops = [
        RequestRounds(runner, proposer, bench.prefilled(k, b, B), RoundSettings(params), ahead=False) for b in range(B)
    ]
    for _ in range(2):  # the first token, then a warm round: kernels compiled
        advance(runner, proposer, loops)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            advance(runner, proposer, loops)
        torch.cuda.synchronize()
    for loop in loops:
        loop.close()
    runner.use_graphs = True
    per_kernel = defaultdict(lambda: [0.0, 0])
    kernels = sorted(
        (ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda ev: ev.time_range.start,
    )
    for ev in kernels:
        per_kernel[ev.name][0] += ev.device_time / rounds
        per_kernel[ev.name][1] += 1
    rows = sorted(((us, n / rounds, name) for name, (us, n) in per_kernel.items()), reverse=True)
    return rows, sum(r[0] for r in rows) / 1e3, _sequence(kernels, rounds)


def _sequence(kernels: list, rounds: int) -> list | None:
    """[name, mean us] per launch position of a round, when every round launched the same kernels in
    the same order (a plain decode: the i-th GEMM of a round is the same layer's projection)."""
    if len(kernels) % rounds:
        return None
    n = len(kernels) // rounds
    names = [ev.name for ev in kernels[:n]]
    if any(kernels[r * n + i].name != names[i] for r in range(rounds) for i in range(n)):
        return None
    return [[names[i], sum(kernels[r * n + i].device_time for r in range(rounds)) / rounds] for i in range(n)]


def replayed_ms(bench: Bench, k: int, sampling: dict, B: int = 1, rounds: int = 20) -> float:
    """Wall ms per engine step of B requests with rounds replayed as CUDA graphs (one queued ahead)."""
    _, runner, proposer = bench.core(k, B)
    params = SamplingParams(max_tokens=4 * rounds + 32, seed=0, ignore_eos=True, **sampling)
    loops = [RequestRounds(runner, proposer, bench.prefilled(k, b, B), RoundSettings(params)) for b in range(B)]
    for _ in range(4):  # the first token, an eager round, the capture
        advance(runner, proposer, loops)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        advance(runner, proposer, loops)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / rounds
    for loop in loops:
        loop.close()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default=None)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--sampled",
        nargs="*",
        default=["0.7"],
        help="sampled cases T[,top_k[,top_p]] (e.g. 0.7,20,0.8: Qwen's suggested law), each profiled at K and, "
        "with --plain-sampled, at K = 0 too",
    )
    ap.add_argument("--plain-sampled", action="store_true")
    ap.add_argument("--quantization", default=None, help="fp8 / q8_0: --preset's weights drawn quantized")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = (
        load_model(args.model, "cuda", "bfloat16")
        if args.model
        else random_model(args.preset, "cuda", "bfloat16", quantization=args.quantization)
    )
    prompt = torch.randint(0, model.cfg.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    bench = Bench(model, prompt, BenchConfig(spec_ks=[args.k], gen_len=64, kernels="triton"))
    report = {}
    cases = [(0, "T0.0", {"temperature": 0.0}), (args.k, "T0.0", {"temperature": 0.0})]
    for spec in args.sampled:
        values = spec.split(",")
        law = {"temperature": float(values[0])}
        label = f"T{law['temperature']}"
        if len(values) > 1:
            law["top_k"] = int(values[1])
            label += f"_k{law['top_k']}"
        if len(values) > 2:
            law["top_p"] = float(values[2])
            label += f"_p{law['top_p']}"
        cases += [(k, label, law) for k in ((0, args.k) if args.plain_sampled else (args.k,))]
    for k, label, sampling in cases:
        rows, ms, sequence = kernels_per_round(bench, k, sampling, B=args.batch)
        wall = replayed_ms(bench, k, sampling, B=args.batch)
        launches = sum(r[1] for r in rows)
        small = [r for r in rows if r[0] < 5.0]  # the round's bookkeeping kernels (< 5 us each)
        print(
            f"B={args.batch} K={k} {label}: {ms:.3f} ms of kernels per round (eager), {wall:.3f} ms per "
            f"replayed round, {launches:.0f} launches; "
            f"{sum(r[1] for r in small):.0f} of them under 5 us ({sum(r[0] for r in small) / 1e3:.3f} ms)"
        )
        for us, n, name in rows[:12]:
            print(f"  {us:9.1f} us  {n:5.1f}x  {name[:100]}")
        report[f"K{k}_{label}"] = {
            "gpu_ms_per_round": ms,
            "replayed_ms_per_round": wall,
            "launches": launches,
            "kernels_us": [[us, n, name] for us, n, name in rows],
            "sequence_us": sequence,  # a round's launches in order (None: rounds differ)
        }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
