"""Checks nextn.engine.memory's estimate on a GPU: a random-weight preset, its cache sized by
gpu_memory_utilization (max_num_seqs unset), then the work the reserve is for, measured: a batched
round of every slot (captured in CUDA graphs, sampled), a chunked prefill of PREFILL_CHUNK tokens
with prompt logprobs. Prints the estimate beside what the device held at its peak (one JSON line).

  python bench/memory_probe.py --preset qwen3.5-9b --max-model-len 8192 --spec-k 3
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nextn.cache.pool import GiB, device_memory
from nextn.config import PREFILL_CHUNK, EngineConfig, SpecConfig
from nextn.core import SamplingParams
from nextn.engine.engine import build_core
from nextn.engine.memory import activation_bytes_per_row, bytes_per_sequence, reserve
from nextn.engine.rounds import RequestRounds, advance
from nextn.engine.scheduler import RoundSettings
from nextn.engine.sequence import Sequence
from nextn.models.random_weights import random_model
from nextn.sample.pipeline import top_logprobs


def used(device) -> int:
    """Bytes in use on the device now (the allocator's cache included: it is what others cannot take)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3.5-9b")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--spec-k", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--quantization", default=None)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=64)
    args = p.parse_args()
    device = torch.device("cuda")
    t0 = time.perf_counter()
    model = random_model(args.preset, "cuda", "bfloat16", quantization=args.quantization)
    total, free = device_memory(device)
    out = {"preset": args.preset, "device": torch.cuda.get_device_name(), "total_GiB": total / GiB}
    out["in_use_after_weights_GiB"] = (total - free) / GiB
    out["allocated_after_weights_GiB"] = torch.cuda.memory_allocated() / GiB
    cfg, dtype, k = model.cfg, torch.bfloat16, args.spec_k
    r = reserve(cfg, k, dtype)
    out["act_bytes_per_row"] = activation_bytes_per_row(cfg, dtype)
    out["slot_GiB"] = bytes_per_sequence(cfg, args.max_model_len, k, dtype) / GiB
    config = EngineConfig(
        "probe",
        "cuda",
        "bfloat16",
        SpecConfig(k),
        args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    pool, runner, proposer = build_core(model, config)
    S = runner.config.max_num_seqs
    out.update(
        max_num_seqs=S,
        reserve_GiB=(r.fixed + r.per_seq * S) / GiB,
        reserve_fixed_GiB=r.fixed / GiB,
        reserve_per_seq_MiB=r.per_seq / 2**20,
        graph_budget_GiB=pool.graph_budget / GiB,
        cache_GiB=pool.cache.nbytes / GiB,
        in_use_after_cache_GiB=used(device) / GiB,
        allowed_GiB=args.gpu_memory_utilization * total / GiB,
    )
    print(json.dumps(out), flush=True)
    # every slot: a short prompt, then batched sampled rounds (graphs: eager, captured, replayed)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    seqs = []
    for s in range(S):
        seq = Sequence(s, heads=proposer is not None)
        runner.slot(s).reset()
        runner.extend(seq, torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist())
        seqs.append(seq)
    params = SamplingParams(max_tokens=10**6, temperature=0.8, seed=0, ignore_eos=True)
    rounds = [RequestRounds(runner, proposer, s, RoundSettings(params)) for s in seqs]
    peak_used = used(device)
    for _ in range(args.rounds):
        advance(runner, proposer, rounds)
        torch.cuda.synchronize()
        peak_used = max(peak_used, used(device))
    out.update(
        rounds_peak_allocated_over_base_GiB=(torch.cuda.max_memory_allocated() - base) / GiB,
        graph_memory_GiB=runner.graph_memory.total / GiB,
        rounds_peak_used_GiB=peak_used / GiB,
    )
    print(json.dumps(out), flush=True)
    for r_ in rounds:
        r_.close()
    # a chunked prefill of PREFILL_CHUNK tokens with prompt logprobs, beside the graphs
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seq = Sequence(0, heads=proposer is not None)
    runner.slot(0).reset()
    ids = torch.randint(0, cfg.vocab_size, (PREFILL_CHUNK,), generator=g).tolist()
    runner.extend(seq, ids, on_logits=lambda start, logits: top_logprobs(logits, 5))
    torch.cuda.synchronize()
    out.update(
        prefill_logprobs_peak_over_base_GiB=(torch.cuda.max_memory_allocated() - base) / GiB,
        prefill_peak_used_GiB=max(peak_used, used(device)) / GiB,
    )
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seq = Sequence(1, heads=proposer is not None)
    runner.slot(1).reset()
    runner.extend(seq, ids)
    torch.cuda.synchronize()
    out.update(
        prefill_peak_over_base_GiB=(torch.cuda.max_memory_allocated() - base) / GiB,
        peak_used_GiB=max(peak_used, used(device)) / GiB,
        seconds=time.perf_counter() - t0,
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
