"""`nextn bench`: speed and exactness of one model on one device, measured in one run.

A model comes from a checkpoint directory or from a released config with random weights made on
the device (`--random-weights qwen3.5-9b | qwen3.5-35b-a3b | ...`: a random MTP head too, so it drafts
but rarely guesses right); `--quantization fp8` quantizes its bf16 weights into 128x128 FP8 blocks
as it loads (an FP8 checkpoint is FP8 without it), and the report records `quantization`;
`--kv-cache-dtype fp8` stores the attention layers' K/V in e4m3 (recorded as `kv_cache_dtype`).
One run measures, with CUDA events around warmed-up work, medians:
- the device copy bandwidth, the weight bytes held (`weight_bytes`) and those a decoded token reads
  (`weight_bytes_per_token`; an MoE model's experts counted from the routing of the plain run:
  `routed_experts_per_layer`, `verify_weight_bytes[K]`, `batch_weight_bytes_per_step[B]`,
  nextn.bench.roofline), the roofline tokens/s they imply, and the fraction of it that plain decoding
  reaches (`roofline_fraction`, engine loop; `step_roofline_fraction`, the step alone;
  `batch_roofline_fraction[B]`);
- prefill tokens/s; decode tokens/s through the engine's round loop, plain and for each K;
- `verify_cost_ratio[K]` = t(step of K+1 tokens) / t(step of 1 token), `draft_cost_ratio` =
  t(one MTP head step and its greedy pick) / t(step of 1 token) (the pick's kernel counted: a
  one-program argmax over the vocabulary had hidden in round_overhead, run 165); `round_overhead[K]` =
  t(spec round) / t(plain token) - verify_cost_ratio[K] - K * draft_cost_ratio: what a round costs
  beyond its steps;
- `spec_equals_plain[K]`: greedy speculative output == plain greedy output, token for token;
- per K, from one more run traced round by round: `round_split_ms[K]` (the mean wall time of a
  round's draft, verify and commit: CUDA events inside its graph), `head_steps_per_round[K]`,
  `num_zero_draft_rounds[K]` and `accept_length_histogram[K]` (rounds by drafts accepted, 0..K);
- `--p-min P ...`: the spec runs with each draft confidence gate, greedy and sampled (the first
  gives the keys above, the others `p_min_runs[P]` with the same keys); `--draft-gate mask` runs a gated
  round's head steps after every draft was cut instead of skipping them in the graph;
- acceptance and `spec_speedup[K]` (meaningful for a checkpoint whose head predicts); with
  `--temperature T`, `sampled_spec_speedup[K]` at T (seeded, against plain decoding at T); with
  `--acceptance-profile p1,p2,..`, `profile_spec_speedup[K]`: drafts replaced, with probability p_j
  at position j, by the token plain decoding emits there (nextn.spec.proposer.ProfileProposer);
- with `--batch B ...`, `batch_tokens_per_s["plain"|"spec"][B]`: B sequences decoding together
  (continuous batching: one batched round per step), plain and spec at the largest K (through the
  acceptance profile when one is given), and whether every sequence's output equals the plain
  single-sequence output; with `--prefill-len N`, prefill tokens/s of an N-token prompt.
The cache an engine would allocate beside these weights with max_num_seqs unset (nextn.engine.memory,
at LLM's and generate's chunked prefill; sized before the bench allocates anything): `max_num_seqs`
sequences of `cache_max_model_len` tokens (`--max-model-len`; default the bench's own, prompt +
generated + 32) at K = `cache_spec_k` (the largest --spec-k) within `gpu_memory_utilization` of the
GPU (on the CPU, its 8), `cache_bytes_per_sequence` each (every cache tensor's share of a slot, the
engine's per-slot buffers included), `cache_bytes_total` in all (the scratch slot's included:
nextn.config.SCRATCH_SLOTS).
With `--draft-vocab FILE` or `--draft-vocab-size N` (the first N ids, for random weights) the head
drafts over that reduced vocabulary (`draft_vocab_size`): draft_cost_ratio and every speed-up
then measure the reduced head.
Writes a JSON file and two PNG plots beside it.

This module runs it and writes the report: run_bench (the device, weight, cost and plain-decode
keys, then the speculative sections of nextn.bench.sweeps), the plots and the CLI entry (model
loading, tensor-parallel ranks, argument checks, the JSON file). The engines and their timing
are nextn.bench.measure's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from nextn.bench.measure import (
    Bench,
    BenchConfig,
    cache_fit,
    copy_bandwidth,
    spread_text,
    sync_device,
    tokens_per_s,
)
from nextn.bench.roofline import routed_roofline
from nextn.bench.sweeps import batched_runs, gate_entry, profiled_runs, sampled_runs, spec_sweep
from nextn.cache.pool import GiB
from nextn.config import SCRATCH_SLOTS, STEP_ROWS, EngineConfig, check_kernels, resolve_device, resolve_dtype
from nextn.config.model import ModelConfig
from nextn.models.loader import load_model, model_config
from nextn.models.qwen3_5 import CausalLM
from nextn.models.random_weights import PRESETS, CacheQuery, random_model, weight_bytes, weight_bytes_per_token
from nextn.ops import OPS
from nextn.parallel import comm
from nextn.parallel.comm import broadcast_object
from nextn.parallel.launch import check_ranks, initialized, rank, rank_device, start
from nextn.spec.draft_vocab import DraftVocab, load_draft_vocab


def run_bench(
    model: CausalLM,
    name: str,
    cfg: BenchConfig,
    log=print,
    prompt: list[int] | None = None,
    draft_vocab: DraftVocab | None = None,
) -> dict:
    """prompt: token ids (default: prompt_len random ids, all a random-weight model can use);
    draft_vocab: the head drafts over it (FR-Spec)."""
    device = next(model.parameters()).device
    if prompt is None:
        g = torch.Generator().manual_seed(cfg.seed)
        prompt = torch.randint(0, model.cfg.vocab_size, (cfg.prompt_len,), generator=g).tolist()
    kernels = EngineConfig("bench", str(device), kernels=cfg.kernels, kv_cache_dtype=cfg.kv_cache_dtype).kernels
    bench = Bench(model, prompt, cfg, draft_vocab)
    res: dict = {
        "model": name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(bench.dtype).replace("torch.", ""),
        "kernels": kernels,
        "cuda_graphs": kernels == "triton" and device.type == "cuda",
        "config": asdict(cfg),
        "prompt_tokens": len(prompt),
        "torch": torch.__version__,
        "has_mtp_head": model.mtp is not None,
        # FP8 weights: "fp8" (block-wise, from the checkpoint or quantized at load) or "compressed-tensors"
        "quantization": quant.method if (quant := model.cfg.quantization) else None,
        "quantization_config": asdict(quant) if quant else None,
        "draft_vocab_size": None if draft_vocab is None else draft_vocab.size,
        # ranks the model is sharded over; weight bytes and the roofline below are one rank's
        "tensor_parallel_size": model.cfg.tp_size,
        # the fused step's all-reduce under tensor parallelism: "ipc", "nccl" or "gloo" (nextn.parallel.comm)
        "all_reduce": comm.backend if model.cfg.tp_size > 1 else None,
        "kv_cache_dtype": cfg.kv_cache_dtype,
    }
    # the cache an engine would allocate here (max_num_seqs unset), read before the bench allocates anything
    fit = cache_fit(model, cfg, cfg.max_model_len or bench.max_len, max(cfg.spec_ks) if model.mtp is not None else 0)
    res.update(
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        cache_max_model_len=fit.max_len,
        cache_spec_k=fit.k,
        max_num_seqs=fit.max_num_seqs,
        cache_bytes_per_sequence=fit.bytes_per_sequence,
        cache_bytes_total=(fit.max_num_seqs + SCRATCH_SLOTS) * fit.bytes_per_sequence,  # (the scratch slot's too)
    )
    log(
        f"bench: cache: {fit.max_num_seqs} sequences of {fit.max_len} tokens at K={fit.k} "
        f"({fit.bytes_per_sequence / GiB:.3f} GiB each, {res['cache_bytes_total'] / GiB:.2f} GiB total; {fit.where})"
    )
    if kernels == "triton" and device.type == "cuda" and cfg.tune:
        from nextn.ops.linear_configs import CONFIGS, QUANT_CONFIGS
        from nextn.ops.linear_tune import config_key

        t0 = time.perf_counter()
        step = bench.core(0)[1].step
        head_vocab = None if draft_vocab is None else draft_vocab.size
        res["linear_configs"] = step.tune(log=log, head_vocab=head_vocab)
        if model.cfg.tp_size > 1:  # rank 0's choices everywhere: replicated GEMMs must round alike
            for table in (CONFIGS, *QUANT_CONFIGS.values()):
                table.update(broadcast_object(dict(table)))
        res["tune_seconds"] = time.perf_counter() - t0
        # what the step's matmuls alone would take, from the tuning measurements (graph, L2 cold)
        res["step_matmul_ms_estimate"] = (
            sum(res["linear_configs"][config_key(n, k, q)]["us_1row"] for n, k, _, q in step.linear_uses(head=False))
            / 1e3
        )
    res["weight_bytes"] = weight_bytes(model)  # every weight held (one rank's), the MTP head's included
    # a one-row decode step's bytes (top-k experts a layer); an MoE model's are counted again from its
    # routing once the plain run gave a sequence to route (nextn.bench.roofline)
    res["weight_bytes_per_token"] = weight_bytes_per_token(model)
    if device.type == "cuda":
        res["copy_bandwidth_GBps"] = copy_bandwidth(device) / 1e9
        res["roofline_tokens_per_s"] = res["copy_bandwidth_GBps"] * 1e9 / res["weight_bytes_per_token"]
    log(
        f"bench: {name} {res['dtype']} quantization={res['quantization']} kv_cache_dtype={cfg.kv_cache_dtype} "
        f"kernels={kernels}: "
        f"{res['weight_bytes_per_token'] / 1e9:.2f} GB/token, "
        f"prompt {len(prompt)} tokens"
    )

    res["prefill_tokens_per_s"], res["prefill_len"] = bench.prefill_tokens_per_s()
    log(f"bench: prefill {res['prefill_tokens_per_s']:.0f} tok/s at {res['prefill_len']} tokens")
    ks = cfg.spec_ks if model.mtp is not None else []
    costs = bench.step_costs(ks or [0])
    t1 = costs["step_ms"][1]
    res.update(
        decode_step_ms=t1,
        step_tokens_per_s=1e3 / t1,
        step_ms=costs["step_ms"],
        verify_cost_ratio={k: costs["step_ms"][k + 1] / t1 for k in ks},
    )
    if costs["head_step_ms"] is not None:
        res["draft_step_ms"] = costs["head_step_ms"]
        res["draft_cost_ratio"] = costs["head_step_ms"] / t1
    log(
        f"bench: step {t1:.3f} ms, verify ratios {_fmt(res['verify_cost_ratio'])}, "
        f"draft ratio {res.get('draft_cost_ratio', float('nan')):.3f}"
    )

    plain_runs, res["decode_tokens_per_s"] = bench.repeated(0)
    plain = plain_runs[0]
    res["decode_tokens_per_s_runs"] = tokens_per_s(plain_runs)
    res["plain_runs_agree"] = all(r.token_ids == plain.token_ids for r in plain_runs)
    res["plain_overhead"] = (1e3 / res["decode_tokens_per_s"]) / t1 - 1  # the round loop beyond the step
    if model.cfg.num_experts:  # the experts read, counted from the routing of the plain run's sequence
        bandwidth = res.get("copy_bandwidth_GBps")
        routed = routed_roofline(
            model, prompt + plain.token_ids, len(prompt), ks, cfg.batch_sizes, bandwidth, OPS[kernels]()
        )
        res.update(routed)
        log(
            f"bench: routed experts per MoE layer: decode {_mean(routed['routed_experts_per_layer']['decode']):.2f}, "
            f"verify {_fmt({k: _mean(c) for k, c in routed['routed_experts_per_layer']['verify'].items()})} "
            f"of {model.cfg.num_experts}; {res['weight_bytes_per_token'] / 1e9:.3f} GB/token"
        )
    if "roofline_tokens_per_s" in res:
        res["roofline_fraction"] = res["decode_tokens_per_s"] / res["roofline_tokens_per_s"]
        res["step_roofline_fraction"] = res["step_tokens_per_s"] / res["roofline_tokens_per_s"]
    log(
        f"bench: plain decode {res['decode_tokens_per_s']:.1f} tok/s{spread_text(plain_runs)} "
        f"(roofline fraction {res.get('roofline_fraction', float('nan')):.3f})"
    )
    for i, p_min in enumerate(cfg.p_mins):
        spec_sweep(bench, res, gate_entry(res, i, p_min), ks, plain.token_ids, p_min, log)
    for temperature in cfg.temperatures:
        sampled_runs(bench, res, ks, temperature, log)
    if cfg.acceptance_profile and ks:
        profiled_runs(bench, res, ks, cfg.acceptance_profile, plain.token_ids, log)
    if cfg.batch_sizes:
        batched_runs(bench, res, max(ks, default=0), plain.token_ids, log)
        if "batch_roofline_tokens_per_s" in res:
            res["batch_roofline_fraction"] = {
                b: res["batch_tokens_per_s"]["plain"][b] / r for b, r in res["batch_roofline_tokens_per_s"].items()
            }
    res["plain_token_ids_head"] = plain.token_ids[:32]
    res["plain_token_ids"] = plain.token_ids  # to compare runs (e.g. tensor_parallel_size 1 and 2)
    bench.close()
    return res


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _fmt(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:.3f}" for k, v in d.items()) + "}"


# ---------------------------------------------------------------------------------------------
# plots and the CLI entry


def plot(res: dict, path_prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(int(k) for k in res.get("spec_tokens_per_s", {}))
    title = f"{res['model']} {res['dtype']} kernels={res['kernels']} on {res['device']}"
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if ks:
        ax.plot(ks, [res["spec_tokens_per_s"][k] for k in ks], "o-", label="spec decode (engine loop)")
    ax.axhline(res["decode_tokens_per_s"], color="C1", ls="--", label="plain decode (engine loop)")
    ax.axhline(res["step_tokens_per_s"], color="C2", ls=":", label="plain step alone")
    if "roofline_tokens_per_s" in res:
        ax.axhline(res["roofline_tokens_per_s"], color="k", ls="-.", label="HBM roofline")
    paths.append(
        _save(plt, fig, ax, "K (draft tokens per round)", "tokens/s", title, f"{path_prefix}_tokens_per_s.png")
    )
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    vk = sorted(int(k) for k in res.get("verify_cost_ratio", {}))
    if vk:
        ax.plot(vk, [res["verify_cost_ratio"][k] for k in vk], "o-", label="verify K+1 / decode 1")
    if "draft_cost_ratio" in res:
        ax.axhline(res["draft_cost_ratio"], color="C1", ls="--", label="draft step / decode")
        ax.plot(
            vk,
            [1 + k * res["draft_cost_ratio"] for k in vk],
            "s:",
            label="round (K drafts + verify) / decode",
            color="C2",
        )
    ax.axhline(1.15, color="grey", lw=0.8, ls=":")
    paths.append(_save(plt, fig, ax, "K", "cost ratio", title, f"{path_prefix}_cost_ratios.png"))
    return paths


def _save(plt, fig, ax, xlabel: str, ylabel: str, title: str, path: str) -> str:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


PROMPT_TEXT = """The report below explains how the cache works and why each step matters.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

Question: what does the function return for n = 10? Answer: it returns 55, because the loop
advances the pair (a, b) ten times. In the same way, a speculative decoder drafts a few tokens
with a small head and lets the large model verify them all at once; when the drafts are right,
several tokens are accepted for the price of one forward pass.
"""


def text_prompt(model_dir: str, prompt_len: int, text: str = PROMPT_TEXT) -> list[int] | None:
    """prompt_len ids of a text (repeated if short) if the checkpoint has a tokenizer: a trained
    head's acceptance on random ids says nothing."""
    from nextn.tokenizer import load_tokenizer

    try:
        ids = load_tokenizer(model_dir).encode(text)
    except (OSError, ValueError):
        return None
    return (ids * (prompt_len // max(1, len(ids)) + 1))[:prompt_len] if ids else None


def _bench_rank(conn, args, cfg: BenchConfig, prompt_text: str | None) -> None:
    """A follower rank of a tensor-parallel bench: the same measurements, silently."""
    _bench(args, cfg, prompt_text)


def _bench(args, cfg: BenchConfig, prompt_text: str | None) -> dict:
    """This rank's model (its shard under tensor parallelism), then run_bench (rank 0 logs)."""
    tp, t0 = (rank(), args.tensor_parallel_size), time.perf_counter()
    device = rank_device(resolve_device(args.device))
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if tp[0] == 0 else (lambda s: None)
    draft_vocab = _draft_vocab(args, _model_config(args).vocab_size)  # checked before the weights load
    if args.random_weights is not None:  # released presets are bfloat16 checkpoints
        dtype = resolve_dtype(args.dtype, device, "bfloat16")
        # the fit line (before a weight is drawn) sizes the cache the bench's own would be (cache_fit)
        max_len = cfg.max_model_len or args.prompt_len + args.gen_len + 2 * STEP_ROWS
        cache = CacheQuery(max_len, max(cfg.spec_ks), cfg.kv_cache_dtype, cfg.gpu_memory_utilization)
        model = random_model(args.random_weights, device, dtype, quantization=args.quantization, tp=tp, cache=cache)
        name = args.random_weights
    else:
        model = load_model(args.model, device=device, dtype=args.dtype, quantization=args.quantization, tp=tp)
        name = Path(args.model).name
    sync_device(next(model.parameters()).device)
    log(f"bench: model ready in {time.perf_counter() - t0:.1f} s")
    prompt = None
    if args.model is not None:
        prompt = text_prompt(args.model, args.prompt_len, prompt_text or PROMPT_TEXT)
        if prompt_text is not None and prompt is None:
            raise ValueError(f"{args.prompt_file}: the checkpoint has no tokenizer to encode it with")
    return run_bench(model, name, cfg, log=log, prompt=prompt, draft_vocab=draft_vocab)


def _model_config(args) -> ModelConfig:
    """The whole model's config: the --random-weights preset's or the checkpoint's (no weight read)."""
    if args.random_weights is None:
        return model_config(args.model)
    if args.random_weights not in PRESETS:
        raise ValueError(f"unknown preset {args.random_weights!r}; choose from {sorted(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[args.random_weights])


def _draft_vocab(args, vocab_size: int) -> DraftVocab | None:
    """--draft-vocab-size N (the first N ids) or --draft-vocab FILE, checked against the model."""
    if args.draft_vocab_size is not None:
        return DraftVocab.first(args.draft_vocab_size, vocab_size)
    if args.draft_vocab is not None:
        from nextn.tokenizer import load_tokenizer

        return load_draft_vocab(args.draft_vocab, vocab_size, load_tokenizer(args.model))
    return None


def check_args(args) -> None:
    """The flags that need no model, checked before one is downloaded or loaded."""
    if args.model is not None and args.random_weights is not None:
        raise ValueError("nextn bench runs MODEL or --random-weights PRESET, not both")
    if any(not 0 <= k < STEP_ROWS for k in args.spec_k):
        raise ValueError(f"--spec-k values must be in 0..{STEP_ROWS - 1}, got {' '.join(map(str, args.spec_k))}")
    if min(counts := (args.prompt_len, args.gen_len, args.repeats)) < 1:
        raise ValueError(f"--prompt-len, --gen-len and --repeats must be >= 1, got {' / '.join(map(str, counts))}")
    if args.acceptance_profile:
        try:
            profile = [float(p) for p in args.acceptance_profile.split(",")]
        except ValueError:
            raise ValueError(
                f"--acceptance-profile takes comma-separated probabilities, got {args.acceptance_profile!r}"
            ) from None
        if not profile or not all(0.0 <= p <= 1.0 for p in profile):
            raise ValueError(f"--acceptance-profile probabilities must be in [0, 1], got {args.acceptance_profile!r}")
    if args.draft_vocab is not None and args.random_weights is not None:
        raise ValueError("--draft-vocab needs --model (a file is checked against the checkpoint's tokenizer)")
    if any(b < 1 for b in args.batch) or (args.prefill_len is not None and args.prefill_len < 1):
        raise ValueError(f"--batch and --prefill-len take positive sizes, got {args.batch} / {args.prefill_len}")
    if any(not 0.0 <= p < 1.0 for p in args.p_min):
        raise ValueError(f"--p-min takes values in [0, 1), got {args.p_min}")
    if any(not 0.0 < t <= 100.0 for t in args.temperature):
        raise ValueError(f"--temperature takes values in (0, 100] (greedy always runs), got {args.temperature}")
    if args.prompt_file is not None:
        if args.random_weights is not None:
            raise ValueError("--prompt-file needs --model (a checkpoint with a tokenizer)")
        if not Path(args.prompt_file).is_file():
            raise ValueError(f"--prompt-file {args.prompt_file}: not a file")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    check_kernels(args.kernels, resolve_device(args.device))
    if args.json_out is not None:  # a report that cannot be written fails now, not after the runs
        out = Path(args.json_out)
        if out.is_dir():
            raise ValueError(f"--json {out}: a directory; give the report's file name")
        out.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(out.parent, os.W_OK):
            raise ValueError(f"--json {out}: its folder is not writable")


def bench_from_args(args) -> int:
    check_args(args)
    profile = [float(p) for p in args.acceptance_profile.split(",")] if args.acceptance_profile else None
    prompt_text = None if args.prompt_file is None else Path(args.prompt_file).read_text(errors="replace")
    cfg = BenchConfig(
        spec_ks=list(args.spec_k),
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        kernels=args.kernels,
        repeats=args.repeats,
        temperatures=list(args.temperature),
        acceptance_profile=profile,
        prompt_file=args.prompt_file,
        batch_sizes=list(args.batch),
        prefill_len=args.prefill_len,
        p_mins=list(args.p_min),
        draft_gate=args.draft_gate,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        tune=args.tune,
    )
    size = args.tensor_parallel_size
    if size > 1 and not initialized():  # every rank runs the same bench; rank 0 reports
        check_ranks(size, args.device)
        if args.draft_vocab is not None or args.draft_vocab_size is not None:
            raise ValueError("a draft vocabulary does not run under tensor parallelism yet")
        _model_config(args).shard(0, size)
        ranks = start(size, args.device, _bench_rank, args, cfg, prompt_text)
        try:
            res = _bench(args, cfg, prompt_text)
        finally:
            ranks.close()
    else:
        res = _bench(args, cfg, prompt_text)
    res["prompt_file"], res["draft_vocab"] = args.prompt_file, args.draft_vocab
    text = json.dumps(res, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
        try:
            plot(res, str(Path(args.json_out).with_suffix("")))
        except ImportError:
            print("bench: matplotlib missing, no plots", file=sys.stderr)
    print(text)
    return 0
