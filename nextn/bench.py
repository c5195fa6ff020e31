"""`nextn bench`: speed and exactness of one model on one device, measured in one run.

A model comes from a checkpoint directory or from a released config with random weights made on
the device (`--random-weights qwen3.5-9b | qwen3.5-35b-a3b`: a random MTP head too, so it drafts
but rarely guesses right); `--quantization fp8` quantizes its bf16 weights into 128x128 FP8 blocks
as it loads (an FP8 checkpoint is FP8 without it), and the report records `quantization`;
`--kv-cache-dtype fp8` stores the attention layers' K/V in e4m3 (recorded as `kv_cache_dtype`).
One run measures, with CUDA events around warmed-up work, medians:
- the device copy bandwidth, the weight bytes a decoded token reads, the roofline tokens/s they
  imply, and the fraction of it that plain decoding reaches (`roofline_fraction`, engine loop;
  `step_roofline_fraction`, the step alone);
- prefill tokens/s; decode tokens/s through the engine's round loop, plain and for each K;
- `verify_cost_ratio[K]` = t(step of K+1 tokens) / t(step of 1 token), `draft_cost_ratio` =
  t(one MTP head step) / t(step of 1 token); `round_overhead[K]` = t(spec round) / t(plain token)
  - verify_cost_ratio[K] - K * draft_cost_ratio: what a round costs beyond its steps;
- `spec_equals_plain[K]`: greedy speculative output == plain greedy output, token for token;
- per K, from one more run traced round by round: `round_split_ms[K]` (the mean wall time of a
  round's draft, verify and commit: CUDA events inside its graph), `head_steps_per_round[K]`,
  `num_zero_draft_rounds[K]` and `accept_length_histogram[K]` (rounds by drafts accepted, 0..K);
- `--p-min P ...`: the greedy spec runs with each draft confidence gate (the first gives the keys
  above, the others `p_min_runs[P]` with the same keys); `--draft-gate mask` runs a gated
  round's head steps after every draft was cut instead of skipping them in the graph;
- acceptance and `spec_speedup[K]` (meaningful for a checkpoint whose head predicts); with
  `--temperature T`, `sampled_spec_speedup[K]` at T (seeded, against plain decoding at T); with
  `--acceptance-profile p1,p2,..`, `profile_spec_speedup[K]`: drafts replaced, with probability p_j
  at position j, by the token plain decoding emits there (nextn.spec.proposer.ProfileProposer);
- with `--batch B ...`, `batch_tokens_per_s["plain"|"spec"][B]`: B sequences decoding together
  (continuous batching: one batched round per step), plain and spec at the largest K (through the
  acceptance profile when one is given), and whether every sequence's output equals the plain
  single-sequence output; with `--prefill-len N`, prefill tokens/s of an N-token prompt.
With `--draft-vocab FILE` or `--draft-vocab-size N` (the first N ids, for random weights) the head
drafts over that reduced vocabulary (`draft_vocab_size`): draft_cost_ratio and every speed-up
then measure the reduced head.
Writes a JSON file and two PNG plots beside it.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nextn.config import (
    STEP_ROWS,
    EngineConfig,
    ModelConfig,
    SpecConfig,
    resolve_device,
    resolve_dtype,
)
from nextn.core import SamplingParams, SpecStats
from nextn.engine.engine import build_core
from nextn.engine.rounds import RequestRounds, advance
from nextn.engine.sequence import Sequence
from nextn.models.loader import load_model
from nextn.models.qwen3_5 import CausalLM
from nextn.models.random_weights import PRESETS, random_model, weight_bytes_per_token
from nextn.parallel import comm
from nextn.parallel.comm import broadcast_object
from nextn.parallel.launch import check_ranks, initialized, rank, rank_device, start
from nextn.spec.draft_vocab import DraftVocab, load_draft_vocab
from nextn.spec.proposer import ProfileProposer

# ---------------------------------------------------------------------------------------------
# timing


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn() (CUDA events on a GPU, the host clock otherwise)."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, iters=10)
    return 2 * nbytes / (ms * 1e-3)


# ---------------------------------------------------------------------------------------------
# the measurements


@dataclass
class BenchConfig:
    spec_ks: list[int]
    prompt_len: int = 512
    gen_len: int = 256
    kernels: str = "auto"
    seed: int = 0
    iters: int = 20
    repeats: int = 3  # end-to-end generations per K: the report gives their median and every run
    tune: bool = True  # measure the skinny GEMM's block configs for this model first (triton, GPU)
    temperatures: list[float] = field(default_factory=list)  # sampled runs besides the greedy ones
    acceptance_profile: list[float] | None = None
    prompt_file: str | None = None
    batch_sizes: list[int] = field(default_factory=list)  # B values of the batched runs
    prefill_len: int | None = None  # the prompt length of the prefill measurement (default: the prompt's)
    p_mins: list[float] = field(default_factory=lambda: [0.0])  # draft confidence gates of the greedy spec runs
    draft_gate: str = "skip"  # SpecConfig.draft_gate of the gated runs
    kv_cache_dtype: str = "auto"  # "fp8": the attention layers' K/V in e4m3 (EngineConfig.kv_cache_dtype)


@dataclass
class RunResult:
    token_ids: list[int]
    seconds: float
    stats: SpecStats
    rounds: list | None = None  # RoundTrace records of a traced run
    head_steps: int | None = None  # head steps it ran (a gated traced run: counted on the device)


class Bench:
    """The model's engines (one per K, sharing the weights) on a single cache slot; K > 0 drafts
    over draft_vocab when one is given."""

    def __init__(self, model: CausalLM, prompt: list[int], cfg: BenchConfig, draft_vocab: DraftVocab | None = None):
        self.model, self.prompt, self.cfg, self.draft_vocab = model, prompt, cfg, draft_vocab
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_len = len(prompt) + cfg.gen_len + 2 * STEP_ROWS
        self.cores: dict[tuple, tuple] = {}
        self.profilers: dict[int, ProfileProposer] = {}  # one per core: its graphs key on it

    def close(self) -> None:
        """The cores' CUDA graphs, destroyed now (under tensor parallelism they hold the communicator)."""
        for _, runner, _ in self.cores.values():
            if runner.use_graphs:
                runner.drop_graphs()

    def core(self, k: int, slots: int = 1, max_len: int | None = None, p_min: float = 0.0):
        max_len = max_len or self.max_len
        key = (k, slots, max_len, p_min)
        if key not in self.cores:
            self.cores.clear()  # one engine's cache at a time
            self.profilers.clear()
            gc.collect()
            spec = SpecConfig(
                num_speculative_tokens=k,
                p_min=p_min,
                draft_vocab=self.draft_vocab if k > 0 else None,
                draft_gate=self.cfg.draft_gate,
            )
            config = EngineConfig(
                "bench",
                str(self.device),
                str(self.dtype).replace("torch.", ""),
                spec,
                max_len,
                slots,
                self.cfg.kernels,
                tensor_parallel_size=self.model.cfg.tp_size,
                kv_cache_dtype=self.cfg.kv_cache_dtype,
            )
            self.cores[key] = build_core(self.model, config)
        return self.cores[key]

    def prefilled(
        self, k: int, slot: int = 0, slots: int = 1, prompt: list[int] | None = None, p_min: float = 0.0
    ) -> Sequence:
        max_len = None if prompt is None else len(prompt) + 2 * STEP_ROWS
        _, runner, proposer = self.core(k, slots, max_len, p_min)
        seq = Sequence(slot, heads=proposer is not None)
        runner.slot(slot).reset()
        runner.extend(seq, self.prompt if prompt is None else prompt)
        return seq

    def generate_batch(self, k: int, B: int, profile=None) -> tuple[list[list[int]], float]:
        """B sequences of the prompt decoding gen_len greedy tokens together (timed after the
        prefills and the head's catch-up over the prompts): (each one's tokens, seconds)."""
        _, runner, proposer = self.core(k, B)
        if profile is not None:
            if k not in self.profilers:
                self.profilers[k] = ProfileProposer(proposer, *profile)
            proposer = self.profilers[k]
        seqs = [self.prefilled(k, b, B) for b in range(B)]
        params = SamplingParams(max_tokens=self.cfg.gen_len, temperature=0.0, ignore_eos=True)
        rounds = [RequestRounds(runner, proposer, s, params, runner.config.spec, set(), SpecStats()) for s in seqs]
        _sync(self.device)
        t0 = time.perf_counter()
        ids: list[list[int]] = [[] for _ in seqs]
        live = list(range(B))
        while live:
            reads, _ = advance(runner, proposer, [rounds[b] for b in live])
            for b, r in zip(list(live), reads, strict=True):
                ids[b] += r.token_ids
                if r.finish_reason is not None:
                    rounds[b].close()
                    live.remove(b)
        _sync(self.device)
        return ids, time.perf_counter() - t0

    def generate(
        self, k: int, temperature: float = 0.0, profile=None, seed: int = 0, p_min: float = 0.0, trace: bool = False
    ) -> RunResult:
        """One generation of gen_len tokens through the engine's rounds, timed after the prefill
        work, as the batched runs are: the prompt's prefill, the head's catch-up over it and the
        first token (drawn from the prefill's logits) come before the clock starts (what they cost
        is the request's time to first token: bench/request_phases.py); traced: a record per
        round, rounds one at a time (not a speed measurement)."""
        _, runner, proposer = self.core(k, p_min=p_min)
        if profile is not None:
            if k not in self.profilers:
                self.profilers[k] = ProfileProposer(proposer, *profile)
            proposer = self.profilers[k]
        seq = self.prefilled(k, p_min=p_min)
        params = SamplingParams(
            max_tokens=self.cfg.gen_len, temperature=temperature, seed=self.cfg.seed + seed, ignore_eos=True
        )
        stats = SpecStats()
        steps = int(proposer.head_steps) if trace and getattr(proposer, "head_steps", None) is not None else None
        rounds = RequestRounds(runner, proposer, seq, params, runner.config.spec, set(), stats, trace=trace)
        _sync(self.device)
        t0 = time.perf_counter()
        ids = []
        while True:
            r = rounds.next()
            ids += r.token_ids
            if r.finish_reason is not None:
                break
        rounds.close()
        _sync(self.device)
        seconds = time.perf_counter() - t0
        if steps is not None:
            steps = int(proposer.head_steps) - steps
        return RunResult(ids, seconds, stats, rounds.trace, steps)

    def repeated(
        self, k: int, temperature: float = 0.0, profile=None, p_min: float = 0.0
    ) -> tuple[list[RunResult], float]:
        """A warm-up run (kernels compile, the rounds' CUDA graphs are captured), then cfg.repeats
        timed runs: (runs, tok/s). Greedy runs repeat one generation (the median of their tok/s);
        sampled runs draw with seeds seed, seed + 1, ... (one sampled path says little about the
        acceptance to expect) and report all their tokens over all their time."""
        if self.cfg.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.cfg.repeats}")
        self.generate(k, temperature, profile, p_min=p_min)
        runs = [
            self.generate(k, temperature, profile, seed=i if temperature > 0 else 0, p_min=p_min)
            for i in range(self.cfg.repeats)
        ]
        if temperature > 0:
            return runs, sum(len(r.token_ids) for r in runs) / sum(r.seconds for r in runs)
        return runs, statistics.median(len(r.token_ids) / r.seconds for r in runs)

    def step_costs(self, ks: list[int]) -> dict:
        """Median ms of one trunk step of T = 1..max(K)+1 tokens and of one MTP head step (graph
        replays where graphs run: what the step costs the device)."""
        k_max = max(ks)
        _, runner, proposer = self.core(k_max)
        seq = self.prefilled(k_max)
        cache, cfg = runner.slot(0), self.model.cfg
        logits = torch.empty(k_max + 1, cfg.vocab_size, device=self.device)
        hidden = torch.empty(k_max + 1, cfg.hidden_size, device=self.device, dtype=self.dtype)
        out = {"step_ms": {}, "head_step_ms": None}
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.seed)
        with torch.inference_mode():
            for T in range(1, k_max + 2):  # steps at the next free positions, never committed
                ids = torch.randint(0, cfg.vocab_size, (T,), device=self.device, generator=gen)

                batch = runner.batch([cache], [T])

                def trunk(T=T, ids=ids, batch=batch):
                    runner.run(("bench", T), lambda: runner.step.trunk(batch, ids, logits[:T], hidden[:T]))

                out["step_ms"][T] = time_ms(trunk, self.device, iters=self.cfg.iters)
            if proposer is not None:
                ids, pos = ids[:1], torch.tensor([len(seq.tokens)], dtype=torch.int32, device=self.device)
                batch, head_logits = runner.batch([cache], [1]), proposer.logits[:1]  # [1, V or Vd]

                def head():
                    runner.run(
                        ("bench", "head"),
                        lambda: runner.step.head(
                            batch, ids, hidden[:1], pos, None, head_logits, hidden[1:2], proposer.lm_head
                        ),
                    )

                out["head_step_ms"] = time_ms(head, self.device, iters=self.cfg.iters)
        return out

    def prefill_tokens_per_s(self) -> tuple[float, int]:
        """(tokens/s, prompt length) of prefilling prefill_len tokens (default: the prompt)."""
        prompt = self.prompt
        if self.cfg.prefill_len:
            prompt = (self.prompt * (self.cfg.prefill_len // len(self.prompt) + 1))[: self.cfg.prefill_len]
        ms = time_ms(lambda: self.prefilled(0, prompt=prompt), self.device, warmup=1, iters=3)
        return len(prompt) / (ms * 1e-3), len(prompt)


def _spread(runs: list[RunResult]) -> str:
    tps = [len(r.token_ids) / r.seconds for r in runs]
    return f" (runs {min(tps):.1f}-{max(tps):.1f})" if len(tps) > 1 else ""


def _tps(runs: list[RunResult]) -> list[float]:
    return [len(r.token_ids) / r.seconds for r in runs]


def _round_overhead(
    res: dict, key: str, k: int, runs: list[RunResult], out: dict | None = None, head_steps: float | None = None
) -> None:
    """t(round) / t(plain token) - verify - head steps (default k) drafts: what a round costs beyond
    its steps (into out, default res, whose costs it reads)."""
    if "draft_cost_ratio" not in res or k not in res["verify_cost_ratio"]:
        return
    out = res if out is None else out
    seconds = statistics.median(r.seconds / max(1, r.stats.num_rounds) for r in runs)
    ratio = seconds / (1.0 / res["decode_tokens_per_s"])
    out.setdefault(f"{key}round_cost_ratio", {})[k] = ratio
    steps = k if head_steps is None else head_steps
    out.setdefault(f"{key}round_overhead", {})[k] = (
        ratio - res["verify_cost_ratio"][k] - steps * res["draft_cost_ratio"]
    )


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
    if kernels == "triton" and device.type == "cuda" and cfg.tune:
        t0 = time.perf_counter()
        step = bench.core(0)[1].step
        head_vocab = None if draft_vocab is None else draft_vocab.size
        res["linear_configs"] = step.tune(log=log, head_vocab=head_vocab)
        if model.cfg.tp_size > 1:  # rank 0's choices everywhere: replicated GEMMs must round alike
            for table in (step.linear.CONFIGS, step.linear.FP8_CONFIGS):
                table.update(broadcast_object(dict(table)))
        res["tune_seconds"] = time.perf_counter() - t0
        # what the step's matmuls alone would take, from the tuning measurements (graph, L2 cold)
        res["step_matmul_ms_estimate"] = (
            sum(
                res["linear_configs"][step.linear.config_key(n, k, fp8)]["us_1row"]
                for n, k, _, fp8 in step.linear_uses(head=False)
            )
            / 1e3
        )
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
    res["decode_tokens_per_s_runs"] = _tps(plain_runs)
    res["plain_runs_agree"] = all(r.token_ids == plain.token_ids for r in plain_runs)
    res["plain_overhead"] = (1e3 / res["decode_tokens_per_s"]) / t1 - 1  # the round loop beyond the step
    if "roofline_tokens_per_s" in res:
        res["roofline_fraction"] = res["decode_tokens_per_s"] / res["roofline_tokens_per_s"]
        res["step_roofline_fraction"] = res["step_tokens_per_s"] / res["roofline_tokens_per_s"]
    log(
        f"bench: plain decode {res['decode_tokens_per_s']:.1f} tok/s{_spread(plain_runs)} "
        f"(roofline fraction {res.get('roofline_fraction', float('nan')):.3f})"
    )
    for i, p_min in enumerate(cfg.p_mins):
        out = res if i == 0 else res.setdefault("p_min_runs", {}).setdefault(p_min, {})
        _spec_sweep(bench, res, out, ks, plain.token_ids, p_min, log)
    for temperature in cfg.temperatures:
        _sampled(bench, res, ks, temperature, log)
    if cfg.acceptance_profile and ks:
        _profiled(bench, res, ks, cfg.acceptance_profile, plain.token_ids, log)
    if cfg.batch_sizes:
        _batched(bench, res, max(ks, default=0), plain.token_ids, log)
    res["plain_token_ids_head"] = plain.token_ids[:32]
    res["plain_token_ids"] = plain.token_ids  # to compare runs (e.g. tensor_parallel_size 1 and 2)
    bench.close()
    return res


_PER_K = (
    "spec_equals_plain",
    "spec_tokens_per_s",
    "spec_tokens_per_s_runs",
    "spec_speedup",
    "acceptance_rate",
    "mean_acceptance_length",
    "accepted_per_position",
)


def _spec_sweep(bench: Bench, res: dict, out: dict, ks: list[int], reference: list[int], p_min: float, log) -> None:
    """Greedy spec at each K with a draft confidence gate p_min, into out (res: the costs to compare
    with): speed, exactness, acceptance, and from one traced run more, the time split per round."""
    out["p_min"] = p_min
    for name in (*_PER_K, "num_zero_draft_rounds", "accept_length_histogram", "head_steps_per_round", "round_split_ms"):
        out[name] = {}
    for k in ks:
        runs, tps = bench.repeated(k, p_min=p_min)
        if res["cuda_graphs"]:  # the traced rounds' graphs captured first
            bench.generate(k, p_min=p_min, trace=True)
        traced = bench.generate(k, p_min=p_min, trace=True)
        stats = runs[0].stats
        out["spec_equals_plain"][k] = all(r.token_ids == reference for r in [*runs, traced])
        out["spec_tokens_per_s"][k] = tps
        out["spec_tokens_per_s_runs"][k] = _tps(runs)
        out["spec_speedup"][k] = tps / res["decode_tokens_per_s"]
        out["acceptance_rate"][k] = stats.acceptance_rate
        out["mean_acceptance_length"][k] = stats.mean_acceptance_length
        out["accepted_per_position"][k] = stats.accepted_per_position[:k]
        out["num_zero_draft_rounds"][k] = stats.num_zero_draft_rounds
        out["accept_length_histogram"][k] = stats.accept_length_histogram[: k + 1]
        rounds = traced.rounds
        steps = k * len(rounds) if traced.head_steps is None else traced.head_steps  # ungated: every step runs
        out["head_steps_per_round"][k] = steps / max(1, len(rounds))
        out["round_split_ms"][k] = {
            phase: 1e3 * statistics.fmean(getattr(r, f"{phase}_s") for r in rounds) if rounds else 0.0
            for phase in ("draft", "verify", "commit")
        }
        _round_overhead(res, "", k, runs, out, out["head_steps_per_round"][k])
        split = out["round_split_ms"][k]
        log(
            f"bench: K={k} p_min={p_min}: equal={out['spec_equals_plain'][k]} {tps:.1f} tok/s{_spread(runs)} "
            f"acceptance {stats.acceptance_rate:.2f} mean length {stats.mean_acceptance_length:.2f} "
            f"zero-draft rounds {stats.num_zero_draft_rounds}/{stats.num_rounds} "
            f"head steps/round {out['head_steps_per_round'][k]:.2f}; per round: draft {split['draft']:.3f} ms, "
            f"verify {split['verify']:.3f} ms, commit {split['commit']:.3f} ms; "
            f"round overhead {out.get('round_overhead', {}).get(k, float('nan')):.3f}"
        )


def _batched(bench: Bench, res: dict, k: int, reference: list[int], log) -> None:
    """B sequences decoding together, plain and at K = k (through the acceptance profile if set)."""
    profile = (bench.cfg.acceptance_profile, reference, bench.cfg.seed) if bench.cfg.acceptance_profile else None
    out = res["batch_tokens_per_s"] = {"plain": {}, "spec": {}, "spec_k": k, "spec_profile": profile is not None}
    equal = res["batch_outputs_equal_plain"] = {"plain": {}, "spec": {}}
    for B in bench.cfg.batch_sizes:
        for key, kk in (("plain", 0), ("spec", k)) if k > 0 else (("plain", 0),):
            bench.generate_batch(kk, B, profile if kk else None)  # warm-up: compiles, captures the graphs
            ids, seconds = bench.generate_batch(kk, B, profile if kk else None)
            out[key][B] = B * bench.cfg.gen_len / seconds
            equal[key][B] = all(x == reference for x in ids)
        spec = f", spec K={k} {out['spec'][B]:.1f} tok/s (equal {equal['spec'][B]})" if k > 0 else ""
        log(f"bench: batch {B}: plain {out['plain'][B]:.1f} tok/s (equal {equal['plain'][B]}){spec}")
    bench.cores.clear()


def _sampled(bench: Bench, res: dict, ks: list[int], temperature: float, log) -> None:
    """Seeded sampling at `temperature`: plain and each K (exact in law, not token for token)."""
    runs, plain = bench.repeated(0, temperature)
    entry = res.setdefault("sampled", {})[temperature] = {
        "decode_tokens_per_s": plain,
        "spec_tokens_per_s": {},
        "acceptance_rate": {},
        "mean_acceptance_length": {},
        "accepted_per_position": {},
        "num_rounds": {},
    }
    log(f"bench: T={temperature} plain {plain:.1f} tok/s{_spread(runs)}")
    for k in ks:
        runs, tps = bench.repeated(k, temperature)
        stats = SpecStats()
        for r in runs:
            stats.merge(r.stats)
        entry["spec_tokens_per_s"][k] = tps
        entry["acceptance_rate"][k] = stats.acceptance_rate
        entry["mean_acceptance_length"][k] = stats.mean_acceptance_length
        entry["accepted_per_position"][k] = stats.accepted_per_position[:k]
        entry["num_rounds"][k] = stats.num_rounds
        if temperature == 0.7 or len(bench.cfg.temperatures) == 1:
            res.setdefault("sampled_spec_speedup", {})[k] = tps / plain
        log(
            f"bench: T={temperature} K={k}: {tps:.1f} tok/s{_spread(runs)} ({tps / plain:.2f}x) "
            f"acceptance {stats.acceptance_rate:.2f} over seeds {bench.cfg.seed}..{bench.cfg.seed + len(runs) - 1}, "
            f"accepted per position {stats.accepted_per_position[:k]} of {stats.num_rounds} rounds"
        )


def _profiled(bench: Bench, res: dict, ks: list[int], profile: list[float], reference: list[int], log) -> None:
    """Greedy rounds whose drafts follow an acceptance profile (the real head still drafts)."""
    res["acceptance_profile"] = profile
    res.update(
        profile_spec_speedup={},
        profile_tokens_per_s={},
        profile_equals_plain={},
        profile_mean_acceptance_length={},
        profile_accepted_per_position={},
    )
    for k in ks:
        runs, tps = bench.repeated(k, profile=(profile, reference, bench.cfg.seed))
        stats = runs[0].stats
        res["profile_tokens_per_s"][k] = tps
        res["profile_spec_speedup"][k] = tps / res["decode_tokens_per_s"]
        res["profile_equals_plain"][k] = all(r.token_ids == reference for r in runs)
        res["profile_mean_acceptance_length"][k] = stats.mean_acceptance_length
        res["profile_accepted_per_position"][k] = [
            a / max(1, d) for a, d in zip(stats.accepted_per_position[:k], stats.drafted_per_position[:k], strict=True)
        ]
        _round_overhead(res, "profile_", k, runs)
        log(
            f"bench: profile K={k}: {tps:.1f} tok/s{_spread(runs)} ({res['profile_spec_speedup'][k]:.2f}x) "
            f"mean length {stats.mean_acceptance_length:.2f} equal={res['profile_equals_plain'][k]}"
        )


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
    from nextn.tokenizer import Tokenizer

    try:
        ids = Tokenizer(Path(model_dir)).encode(text)
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
    if args.random_weights is not None:  # released presets are bfloat16 checkpoints
        dtype = resolve_dtype(args.dtype, device, "bfloat16")
        model = random_model(args.random_weights, device, dtype, quantization=args.quantization, tp=tp)
        name = args.random_weights
    else:
        model = load_model(args.model, device=device, dtype=args.dtype, quantization=args.quantization, tp=tp)
        name = Path(args.model).name
    _sync(next(model.parameters()).device)
    log(f"bench: model ready in {time.perf_counter() - t0:.1f} s")
    draft_vocab = None
    if args.draft_vocab_size is not None:
        draft_vocab = DraftVocab.first(args.draft_vocab_size, model.cfg.vocab_size)
    elif args.draft_vocab is not None:
        from nextn.tokenizer import Tokenizer

        draft_vocab = load_draft_vocab(args.draft_vocab, model.cfg.vocab_size, Tokenizer(args.model))
    prompt = None
    if args.model is not None:
        prompt = text_prompt(args.model, args.prompt_len, prompt_text or PROMPT_TEXT)
        if prompt_text is not None and prompt is None:
            raise ValueError(f"{args.prompt_file}: the checkpoint has no tokenizer to encode it with")
    return run_bench(model, name, cfg, log=log, prompt=prompt, draft_vocab=draft_vocab)


def bench_from_args(args) -> int:
    if (args.model is None) == (args.random_weights is None):
        raise ValueError("nextn bench needs exactly one of --model DIR and --random-weights PRESET")
    profile = None
    if args.acceptance_profile:
        try:
            profile = [float(p) for p in args.acceptance_profile.split(",")]
        except ValueError:
            raise ValueError(
                f"--acceptance-profile takes comma-separated probabilities, got {args.acceptance_profile!r}"
            ) from None
        if not profile or not all(0.0 <= p <= 1.0 for p in profile):
            raise ValueError(f"--acceptance-profile probabilities must be in [0, 1], got {args.acceptance_profile!r}")
    if args.draft_vocab is not None and args.model is None:
        raise ValueError("--draft-vocab needs --model (a file is checked against the checkpoint's tokenizer)")
    if any(b < 1 for b in args.batch) or (args.prefill_len is not None and args.prefill_len < 1):
        raise ValueError(f"--batch and --prefill-len take positive sizes, got {args.batch} / {args.prefill_len}")
    if any(not 0.0 <= p < 1.0 for p in args.p_min):
        raise ValueError(f"--p-min takes values in [0, 1), got {args.p_min}")
    if any(not 0.0 < t <= 100.0 for t in args.temperature):
        raise ValueError(f"--temperature takes values in (0, 100] (greedy always runs), got {args.temperature}")
    prompt_text = None
    if args.prompt_file is not None:
        if args.random_weights is not None:
            raise ValueError("--prompt-file needs --model (a checkpoint with a tokenizer)")
        prompt_text = Path(args.prompt_file).read_text(errors="replace")
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
    )
    size = args.tensor_parallel_size
    if size > 1 and not initialized():  # every rank runs the same bench; rank 0 reports
        check_ranks(size, args.device)
        if args.draft_vocab is not None or args.draft_vocab_size is not None:
            raise ValueError("a draft vocabulary does not run under tensor parallelism yet")
        whole = ModelConfig.from_dict(PRESETS[args.random_weights]) if args.random_weights else None
        (whole or ModelConfig.from_hf(args.model)).shard(0, size)
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
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text + "\n")
        try:
            plot(res, str(Path(args.json_out).with_suffix("")))
        except ImportError:
            print("bench: matplotlib missing, no plots", file=sys.stderr)
    print(text)
    return 0
