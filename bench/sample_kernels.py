"""The sampled draw (temperature alone, and with the bundled model's top-k 20 / top-p 0.95) and
the round's rejection sampling: the reference torch ops against the
one-launch kernels (nextn.sample.triton_sample, up to their MAX_V columns), per vocabulary size, each
timed as a CUDA graph of 100 calls (what a replayed round pays).

  python bench/sample_kernels.py [--out F.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from nextn.ops import linear_tune
from nextn.sample import triton_sample, verifier
from nextn.sample.pipeline import Law, RequestRng, SamplingParams, Stream, probs_from_logits, sample


def graph_us(fn, calls: int = 100) -> float:
    """us per call of fn, captured `calls` times in one CUDA graph (median of 5 replays)."""
    return linear_tune.graph_us(lambda i: fn(), 1, calls)


def measure(V: int, K: int, table, index, temperature) -> dict:
    """us per call of the reference and fused draw and verify at vocabulary size V."""
    dev = table.device
    head = torch.randn(1, V, device=dev) * 3
    trunk = torch.randn(K + 1, V, device=dev) * 3
    q = torch.empty(K, V, device=dev)
    pick = torch.empty(1, dtype=torch.long, device=dev)
    drafts = torch.randint(0, V, (K,), device=dev)
    num = torch.tensor(K, device=dev)
    u = table[Stream.DRAFT, :1]

    def ref_draw():
        torch.softmax(head / temperature, dim=-1, out=q[:1])
        sample(q[:1], u, out=pick)

    def fused_draw():
        triton_sample.temperature_sample(head, Law(temperature), u, out=q[:1], ids=pick)

    filters = SamplingParams(temperature=0.7, top_k=20, top_p=0.95)  # the bundled model's defaults
    law = Law(temperature, top_k=torch.tensor(20, device=dev), top_p=torch.tensor(0.95, device=dev))

    def ref_draw_filtered():
        q[:1].copy_(probs_from_logits(head, filters))
        sample(q[:1], u, out=pick)

    def fused_draw_filtered():
        triton_sample.temperature_sample(head, law, u, out=q[:1], ids=pick)

    def ref_verify():
        p = torch.softmax(trunk / temperature, dim=-1)
        ua = table[Stream.ACCEPT].index_select(0, index.long() + torch.arange(K, device=dev))
        us = table[Stream.SAMPLE].index_select(0, index.long() + torch.arange(K + 1, device=dev))
        verifier.verify_sampled(p, q, drafts, ua, us, num)

    def fused_verify():
        p, _ = triton_sample.temperature_sample(trunk, Law(temperature))
        triton_sample.verify_sampled(p, q, drafts, table, index, num)

    fns = [("ref_draw", ref_draw), ("ref_verify", ref_verify), ("ref_draw_top_k20_p095", ref_draw_filtered)]
    if V <= triton_sample.MAX_V:  # wider rows: the sampler keeps the torch ops
        fns += [
            ("fused_draw", fused_draw),
            ("fused_verify", fused_verify),
            ("fused_draw_top_k20_p095", fused_draw_filtered),
        ]
    return {name: graph_us(fn) for name, fn in fns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, K = "cuda", 3
    table = RequestRng(0).table(0, 64, dev)
    index = torch.tensor(5, dtype=torch.int32, device=dev)
    temperature = torch.tensor(0.7, device=dev)
    report = {"device": torch.cuda.get_device_name(), "k": K, "sizes": {}}
    for V in (8192, 16384, 32768, 151936, 248320):
        row = measure(V, K, table, index, temperature)
        report["sizes"][V] = row
        print(f"V={V}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
