"""Where a "steps" prefill step's GPU time goes (issue 44's TTFT), on the bundled model:

1. one engine step that prefills 6 prompts of 500 tokens (3,000 rows: serve's default step budget at
   --max-num-seqs 64), every CUDA kernel in launch order with its time (torch.profiler);
2. skinny_linear at the bundled model's shapes and M = 16 .. 3,072 rows: the default config's time,
   and other configs' times with whether each row's bits equal the default's (a prefill may take a
   different config only where they do: a prompt row must be what a decode row of it would be).
Usage (device): python3 bench/prefill_step_probe.py [--json OUT]"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch


def timed(fn, iters: int = 20) -> float:
    """Mean ms of fn() over iters calls, after two warm-up calls."""
    fn()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def step_kernels(llm, result: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    from nextn.core import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)

    def wave():
        for _ in range(6):
            engine.add(torch.randint(10, 8000, (500,), generator=gen).tolist(), params, detokenize=False)
        walls = []
        while engine.has_work:
            t = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - t))
        return walls

    wave()
    print("probe: warm waves:", [f"{w:.1f}" for w in wave()], "ms a step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        walls = wave()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        per[e.name[:70]][0] += e.device_time / 1e3
        per[e.name[:70]][1] += 1
    total = sum(v[0] for v in per.values())
    print(f"probe: profiled wave: steps {[f'{w:.1f}' for w in walls]} ms, GPU kernels {total:.2f} ms, {len(kernels)}")
    for name, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"probe:   {ms:8.3f} ms {n:5d}x {name}")
    print("probe: launch order (first 120 kernels, us):")
    for e in kernels[:120]:
        print(f"probe:   {e.device_time:9.1f} {e.name[:80]}")
    result["wave_step_ms"] = walls
    result["wave_gpu_ms"] = total
    result["wave_kernels"] = {k: v for k, v in per.items()}


def linear_configs(llm, result: dict) -> None:
    from nextn.ops.linear_configs import pick_config
    from nextn.ops.triton_linear import skinny_linear

    shapes = sorted({tuple(p.shape) for p in llm.model.parameters() if p.dim() == 2 and p.shape[0] <= 16384})
    print("probe: 2-D weights:", shapes)
    out = {}
    for N, K in shapes:
        if K % 16 or N % 16:
            continue
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        base = pick_config(N, K)
        cands = {base}
        for bn in (16, 32, 64, 128):
            for bk in (128, 256):
                cands.add((bn, bk, 4, 3, base[4]))
        for M in (64, 1024, 3072):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = skinny_linear(x, w, config=base)
            row = {"default": base, "default_ms": timed(lambda x=x, w=w, base=base: skinny_linear(x, w, config=base))}
            best = None
            for cfg in sorted(cands):
                try:
                    y = skinny_linear(x, w, config=cfg)
                except Exception as e:  # (a config the shape cannot take)
                    print(f"probe:   {N}x{K} {cfg}: {type(e).__name__}")
                    continue
                same = bool(torch.equal(y, ref))
                ms = timed(lambda x=x, w=w, cfg=cfg: skinny_linear(x, w, config=cfg))
                if same and (best is None or ms < best[1]):
                    best = (cfg, ms)
                row.setdefault("configs", []).append((cfg, round(ms, 4), same))
            row["best_same_bits"] = best
            flops = 2 * M * N * K
            print(
                f"probe: {N}x{K} M={M}: default {base} {row['default_ms'] * 1e3:.1f} us "
                f"({flops / row['default_ms'] / 1e9:.1f} TFLOP/s); best with the same bits {best[0]} "
                f"{best[1] * 1e3:.1f} us; configs with other bits: {sum(not c[2] for c in row['configs'])} "
                f"of {len(row['configs'])}"
            )
            out[f"{N}x{K}@{M}"] = row
    result["linear"] = out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from nextn.engine.llm import LLM

    llm = LLM(None, num_speculative_tokens=3, max_num_seqs=64, prefill="steps", k_policy="auto",
              enable_prefix_caching=False)  # fmt: skip
    result = {"device": torch.cuda.get_device_name()}
    step_kernels(llm, result)
    linear_configs(llm, result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
