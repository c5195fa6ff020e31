"""Where a prompt prefill's time goes on the GPU: wall time of `runner.extend` over a prompt,
GPU time per kernel name (torch.profiler), and the CPU ops by self time (is it launch-bound?).

python bench/profile_prefill.py --preset qwen3.5-9b [--prompt-len 512] [--out prefill.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from nextn.bench.measure import Bench, BenchConfig, time_ms
from nextn.models.random_weights import random_model


def kernel_totals(prof) -> list[tuple[float, int, str]]:
    """(GPU us, launches, name) per CUDA kernel name of a torch.profiler run, the most time first."""
    per_kernel = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name][0] += ev.device_time
            per_kernel[ev.name][1] += 1
    return sorted(((us, n, name) for name, (us, n) in per_kernel.items()), reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = random_model(args.preset, "cuda", "bfloat16")
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,)).tolist()
    bench = Bench(model, prompt, BenchConfig(spec_ks=[0], gen_len=16, kernels="triton"))

    def prefill() -> None:
        bench.prefilled(0)

    wall_ms = time_ms(prefill, "cuda", warmup=2, iters=3)  # host-bound: the events span the host's issue time
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill()
        torch.cuda.synchronize()
    rows = kernel_totals(prof)
    gpu_ms = sum(r[0] for r in rows) / 1e3
    print(
        f"{args.preset} prefill {args.prompt_len} tokens: wall {wall_ms:.2f} ms "
        f"({args.prompt_len / wall_ms * 1e3:.0f} tok/s), GPU kernels {gpu_ms:.2f} ms, "
        f"{sum(r[1] for r in rows)} launches"
    )
    for us, n, name in rows[:20]:
        print(f"  {us:9.1f} us  {n:5d}x  {name[:110]}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    print(table)
    # the chunked delta rule alone, one GDN layer of this model over the prompt: reference vs Triton
    from nextn.layers.gdn import l2norm
    from nextn.ops.gdn import chunk_gated_delta_rule as torch_rule
    from nextn.ops.triton_gdn_chunk import chunk_gated_delta_rule as triton_rule

    cfg, T = model.cfg, args.prompt_len
    H, HV, K, V = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    q = l2norm(torch.randn(1, T, H, K, device="cuda"))
    k = l2norm(torch.randn(1, T, H, K, device="cuda"))
    v = torch.randn(1, T, HV, V, device="cuda", dtype=torch.bfloat16)
    g, beta = -torch.rand(1, T, HV, device="cuda"), torch.rand(1, T, HV, device="cuda")
    h0 = torch.randn(1, HV, K, V, device="cuda")
    rule_ms = {
        name: time_ms(lambda r=rule: r(q, k, v, g, beta, h0), "cuda", warmup=2, iters=10)
        for name, rule in (("torch", torch_rule), ("triton", triton_rule))
    }
    print("chunked delta rule, one layer, ms:", {n: round(v, 3) for n, v in rule_ms.items()})
    experts_ms = {}
    if cfg.num_experts:  # the routed experts alone, one layer over the prompt: reference vs Triton
        from nextn.layers.ffn import Experts
        from nextn.ops.moe import routed_experts
        from nextn.ops.triton_moe_grouped import grouped_experts

        layer = next(m for m in model.modules() if isinstance(m, Experts))
        x = torch.randn(T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        top_w, top_idx = torch.topk(
            torch.softmax(torch.randn(T, cfg.num_experts, device="cuda"), -1), cfg.num_experts_per_tok, dim=-1
        )
        top_w = top_w.to(torch.bfloat16)
        experts_ms = {
            name: time_ms(
                lambda r=rule: r(x, top_idx, top_w, layer.gate_up_proj, layer.down_proj), "cuda", warmup=2, iters=5
            )
            for name, rule in (("torch", routed_experts), ("triton", grouped_experts))
        }
        print("routed experts, one layer, ms:", {n: round(v, 3) for n, v in experts_ms.items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "preset": args.preset,
                    "prompt_len": args.prompt_len,
                    "wall_ms": wall_ms,
                    "gpu_kernel_ms": gpu_ms,
                    "chunk_rule_ms": rule_ms,
                    "routed_experts_ms": experts_ms,
                    "kernels_us": [[us, n, name] for us, n, name in rows],
                    "cpu_table": table,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
