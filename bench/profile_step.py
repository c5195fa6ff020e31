"""Where a decode step's time goes on the GPU: GPU time per kernel name over eager Triton steps
(torch.profiler), and the host side of the plain decoding loop (CPU ops by self time).

python bench/profile_step.py --preset qwen3.5-9b [--out profile.json]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from nextn.bench import BenchConfig, generate_once, random_model
from nextn.config import SpecConfig
from nextn.core import SamplingParams, SpecStats
from nextn.engine.fast import TritonStep, build_engine
from nextn.engine.generate import run_rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = random_model(args.preset, "cuda", "bfloat16")
    step = TritonStep(model)
    spec = SpecConfig(num_speculative_tokens=0)
    runner, _ = build_engine(model, spec, "triton", step=step)
    prompt = torch.randint(0, model.cfg.vocab_size, (512,)).tolist()
    state = runner.new_state(1024)
    runner.extend(state, prompt)
    cache = state.cache
    ids = torch.tensor([1], device="cuda")
    pos = torch.tensor([cache.seq_len], device="cuda", dtype=torch.int32)
    for _ in range(3):
        step.trunk(ids, pos, cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step.trunk(ids, pos, cache)
        torch.cuda.synchronize()
    per_kernel = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name][0] += ev.device_time / 5
            per_kernel[ev.name][1] += 1
    rows = sorted(((v[0], v[1] // 5, k) for k, v in per_kernel.items()), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"eager step: {total / 1e3:.3f} ms of kernels, {sum(r[1] for r in rows)} launches")
    for us, n, name in rows[:25]:
        print(f"  {us:9.1f} us  {n:4d}x  {name[:100]}")

    # the attention step kernel alone at this context, by inner block size (graph of 100 launches)
    from nextn.ops.triton_attention import attend_step
    from nextn.ops.triton_linear import _graph_us

    attn = {}
    kv = cache.kv[next(iter(cache.kv))]
    q = torch.randn(1, model.cfg.num_attention_heads, model.cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(1, 4 * model.cfg.num_attention_heads * model.cfg.head_dim, device="cuda",
                      dtype=torch.bfloat16)
    for block_s, warps in ((32, 8), (64, 8), (16, 4), (32, 4), (64, 4), (128, 8)):
        attn[f"{block_s}/{warps}"] = _graph_us(
            lambda i, b=block_s, w=warps: attend_step(q, qkv, kv.key[0], kv.value[0], pos, block_s=b, num_warps=w),
            1, 100)
    print("attend_step us by block_s/warps:", {k: round(v, 2) for k, v in attn.items()})

    # host side of plain decoding (graphs)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    def decode(n_tokens: int) -> float:  # seconds per token of the plain loop (graphs captured first)
        run = generate_once(model, prompt, 0, BenchConfig(spec_ks=[0], gen_len=n_tokens, kernels="triton"), step)
        return run.seconds / len(run.token_ids)

    decode(8)
    per_token = decode(128)
    def replay_ms() -> float:
        st = runner.new_state(1024)
        runner.extend(st, prompt)
        g = runner.graphs(st).trunk(1, st.cache)
        g.run(st.cache.seq_len, ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            g.graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 50 * 1e3

    replay = replay_ms()
    print(f"plain decode loop {per_token * 1e3:.3f} ms/token; graph replay back to back {replay:.3f} ms")
    st = runner.new_state(1024)
    runner.extend(st, prompt)
    runner.graphs(st).trunk(1, st.cache)
    with profile(activities=[ProfilerActivity.CPU]) as prof2:
        for _ in run_rounds(runner, None, st, params, spec, set(), SpecStats()):
            pass
    table = prof2.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"kernels_us": [[us, n, name] for us, n, name in rows], "loop_ms_per_token": per_token * 1e3,
                       "replay_ms": replay, "attend_us": attn, "host_table": table}, f, indent=1)


if __name__ == "__main__":
    main()
