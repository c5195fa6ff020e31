"""Timed runs of one model for `nextn bench`: the timing primitives and `Bench`, its engines.

`time_ms` (the median of warmed-up work: CUDA events on a GPU, the host clock otherwise) and
`copy_bandwidth` (the roofline's bandwidth); `cache_fit`, the sequences an engine's cache would hold
here (nextn.engine.memory); `BenchConfig`, what one bench run measures; `Bench`,
the model's engines (one per K, sharing the weights) on a single cache slot, which times one
generation, a batched one, repeated ones, the trunk and head step costs and the prefill speed;
`RunResult`, one timed generation, and its tokens/s.
Does not know the report: which runs make it and what its keys are computed from belong to
nextn.bench.offline (run_bench, the CLI entry) and nextn.bench.sweeps (the speculative sections).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from nextn.config import DEFAULT_GPU_MEMORY_UTILIZATION, STEP_ROWS, EngineConfig, SpecConfig
from nextn.core import SamplingParams, SpecStats
from nextn.engine.engine import build_core
from nextn.engine.memory import bytes_per_sequence, memory_budget
from nextn.engine.rounds import RequestRounds, advance
from nextn.engine.scheduler import RoundSettings
from nextn.engine.sequence import Sequence
from nextn.models.qwen3_5 import CausalLM
from nextn.spec.draft_vocab import DraftVocab
from nextn.spec.proposer import ProfileProposer

# ---------------------------------------------------------------------------------------------
# timing


def sync_device(device) -> None:
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
    p_mins: list[float] = field(default_factory=lambda: [0.0])  # draft confidence gates of the spec runs
    draft_gate: str = "skip"  # SpecConfig.draft_gate of the gated runs
    kv_cache_dtype: str = "auto"  # "fp8": the attention layers' K/V in e4m3 (EngineConfig.kv_cache_dtype)
    # the share of the GPU nextn may use (the engines' caches are checked against it) and the
    # context of the cache fit the report gives (cache_fit; None: the bench's own sequences,
    # prompt + generated tokens + 2 * STEP_ROWS)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_model_len: int | None = None


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
                p_min=p_min if k > 0 else 0.0,
                draft_vocab=self.draft_vocab if k > 0 else None,
                draft_gate=self.cfg.draft_gate,
                k_policy="fixed",  # each run at the K it reports (the bench drives the rounds itself)
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
                gpu_memory_utilization=self.cfg.gpu_memory_utilization,
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
        rounds = [RequestRounds(runner, proposer, s, RoundSettings(params)) for s in seqs]
        sync_device(self.device)
        t0 = time.perf_counter()
        ids: list[list[int]] = [[] for _ in seqs]
        live = list(range(B))
        while live:
            reads, _, _ = advance(runner, proposer, [rounds[b] for b in live])
            for b, r in zip(list(live), reads, strict=True):
                if isinstance(r, Exception):
                    raise r
                ids[b] += r.token_ids
                if r.finish_reason is not None:
                    rounds[b].close()
                    live.remove(b)
        sync_device(self.device)
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
        steps = int(proposer.head_steps) if trace and getattr(proposer, "head_steps", None) is not None else None
        rounds = RequestRounds(runner, proposer, seq, RoundSettings(params, trace=trace))
        stats = rounds.stats
        sync_device(self.device)
        t0 = time.perf_counter()
        ids = []
        while True:
            r = rounds.next()
            ids += r.token_ids
            if r.finish_reason is not None:
                break
        rounds.close()
        sync_device(self.device)
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
        """Median ms of one trunk step of T = 1..max(K)+1 tokens and of one MTP head step with its
        greedy pick (graph replays where graphs run: what the step costs the device)."""
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
                drafted, at = torch.zeros(1, dtype=torch.long, device=self.device), torch.zeros_like(ids)
                d2t = None if proposer.draft is None else proposer.draft.d2t

                def head_and_pick():  # a greedy round's draft step: the head, then its pick (the argmax kernel)
                    runner.step.head(batch, ids, hidden[:1], pos, None, (head_logits, hidden[1:2]), proposer.lm_head)
                    proposer.greedy_draft(head_logits, drafted, at, None, d2t)

                def head():
                    runner.run(("bench", "head"), head_and_pick)

                out["head_step_ms"] = time_ms(head, self.device, iters=self.cfg.iters)
        return out

    def prefill_tokens_per_s(self) -> tuple[float, int]:
        """(tokens/s, prompt length) of prefilling prefill_len tokens (default: the prompt)."""
        prompt = self.prompt
        if self.cfg.prefill_len:
            prompt = (self.prompt * (self.cfg.prefill_len // len(self.prompt) + 1))[: self.cfg.prefill_len]
        ms = time_ms(lambda: self.prefilled(0, prompt=prompt), self.device, warmup=1, iters=3)
        return len(prompt) / (ms * 1e-3), len(prompt)


class CacheFit(NamedTuple):
    """The cache an engine (`nextn serve`, `LLM`) would allocate for this model on this device."""

    max_num_seqs: int  # what fits cfg.gpu_memory_utilization (nextn.engine.memory; on the CPU its 8)
    bytes_per_sequence: int  # one slot: every cache tensor's share, the engine's per-slot buffers included
    max_len: int
    k: int
    where: str  # the budget it was sized in (Budget.summary: "0.9 of the GPU's 79.1 GiB")


def cache_fit(model: CausalLM, cfg: BenchConfig, max_len: int, k: int) -> CacheFit:
    """How many sequences of max_len tokens at k drafts a round fit beside the loaded weights, sized
    as the engine sizes max_num_seqs left unset (chunked prefill, LLM's default), from the memory
    in use now: call it before anything else is allocated."""
    param = next(model.parameters())
    spec = SpecConfig(num_speculative_tokens=k)
    config = EngineConfig(
        "bench",
        str(param.device),
        str(param.dtype).replace("torch.", ""),
        spec,
        max_len,
        kernels=cfg.kernels,
        tensor_parallel_size=model.cfg.tp_size,
        kv_cache_dtype=cfg.kv_cache_dtype,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
    )
    budget = memory_budget(model.cfg, config, param.dtype)
    slot = bytes_per_sequence(model.cfg, max_len, k, param.dtype, cfg.kv_cache_dtype)
    num_seqs = config.max_num_seqs if config.max_num_seqs is not None else budget.sequences(slot)
    return CacheFit(num_seqs, slot, max_len, k, budget.summary())


def spread_text(runs: list[RunResult]) -> str:
    tps = [len(r.token_ids) / r.seconds for r in runs]
    return f" (runs {min(tps):.1f}-{max(tps):.1f})" if len(tps) > 1 else ""


def tokens_per_s(runs: list[RunResult]) -> list[float]:
    return [len(r.token_ids) / r.seconds for r in runs]
