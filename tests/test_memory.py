"""Sizing the cache by memory (nextn.engine.memory, vLLM's gpu_memory_utilization): one slot's
bytes from the config alone, max_num_seqs from a (fake) GPU's memory reading, the errors of a
budget nothing fits or a max_num_seqs over it, the flag's validation, and the bench's report."""

from __future__ import annotations

import json
import types

import pytest
import torch

import nextn
from nextn.cache import pool as pool_mod
from nextn.cache.hybrid import HybridCache, nbytes_of, tensor_specs
from nextn.cache.pool import CacheMemoryError, GiB, check_fits
from nextn.cli import main
from nextn.config import (
    ATTENTION_ROWS,
    MAX_NUM_SEQS,
    PREFILL_CHUNK,
    SCRATCH_SLOTS,
    STEP_ROWS,
    EngineConfig,
    SpecConfig,
)
from nextn.config.model import ModelConfig
from nextn.engine import memory
from nextn.models.random_weights import PRESETS

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def cfg_9b() -> ModelConfig:
    """The released Qwen3.5-9B text config (no weights)."""
    return ModelConfig.from_dict(PRESETS["qwen3.5-9b"])


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_bytes_per_sequence_is_a_slots_share_of_the_cache(cfg_9b, kv):
    """The 9B preset at 800 tokens, K=3: the function's bytes are what a pool of 3 slots (made on the
    meta device: no memory) holds per slot, engine buffers included, tensor by tensor."""
    per_seq = memory.bytes_per_sequence(cfg_9b, 800, 3, BF16, kv)
    layout = memory.cache_layout(cfg_9b, 800, 3, BF16, kv, num_slots=3)
    cache = HybridCache(cfg_9b, layout, "meta", BF16)
    assert per_seq * 3 == cache.nbytes == nbytes_of(tensor_specs(cfg_9b, layout, BF16))
    assert {"logits", "uniforms", "states", "draft_key"} <= set(cache.tensors)  # round, sampler, GDN, head
    if kv == "auto":
        # mostly GDN states of 2 MiB a layer (24 layers): the two halves' bases and the checkpoint (was 538.6
        # MiB with a home state and 2 x (K+1) per-row states a layer)
        assert 190 * 2**20 < per_seq < 220 * 2**20


def test_sequences_that_fit_is_the_budget_over_a_slot_and_its_share_of_the_reserve(cfg_9b):
    """n sequences fit where the reserve, n slots with their share of it, and the scratch slot do."""
    slot = memory.bytes_per_sequence(cfg_9b, 8192, 3, BF16)
    r = memory.reserve(cfg_9b, 3, BF16)
    for n in (1, 17, MAX_NUM_SEQS):
        exact = r.fixed + n * (slot + r.per_seq) + SCRATCH_SLOTS * slot
        assert memory.sequences_that_fit(cfg_9b, 8192, 3, exact, BF16) == n
        assert memory.sequences_that_fit(cfg_9b, 8192, 3, exact - 1, BF16) == n - 1
    assert memory.sequences_that_fit(cfg_9b, 8192, 3, 10**15, BF16) == MAX_NUM_SEQS
    assert memory.sequences_that_fit(cfg_9b, 8192, 3, r.fixed // 2, BF16) == 0
    # the reserve: the runner's step rows (float32 logits) and a chunked prefill's logits at least
    assert r.per_seq >= 4 * (4 * cfg_9b.vocab_size) and r.fixed >= 2 * PREFILL_CHUNK * cfg_9b.vocab_size * 4
    # a steps prefill packs a whole chunk's rows too, and adds the step attention's partials over the context
    steps = memory.reserve(cfg_9b, 3, BF16, "steps", 8192)
    partials = ATTENTION_ROWS * cfg_9b.num_attention_heads * -(-(8192 + 32) // 128) * (cfg_9b.head_dim + 2) * 4
    assert steps.fixed == r.fixed + partials and steps.per_seq == r.per_seq


def _fake_gpu(monkeypatch, total: int, in_use: int, tensors: int | None = None) -> None:
    """The GPU has `total` bytes, `in_use` of them taken, `tensors` of those by torch's tensors (the
    weights; default all but 1 GiB of the CUDA context)."""
    monkeypatch.setattr(pool_mod, "device_memory", lambda device: (total, total - in_use))
    monkeypatch.setattr(pool_mod, "tensor_bytes", lambda device: in_use - GiB if tensors is None else tensors)


def _gpu_config(max_len=8192, k=3, **kw) -> EngineConfig:
    return EngineConfig("m", "cuda", "bfloat16", SpecConfig(k), max_len, **kw)


def test_max_num_seqs_defaults_to_what_fits_the_gpu(cfg_9b, monkeypatch):
    """80 GiB, 20 GiB of it in use after the weights, 0.9 of it for nextn: (0.9 * 80 - 20 GiB -
    reserve.fixed - the scratch slot) // (slot + reserve.per_seq) sequences; max_num_batched_tokens
    follows the count."""
    total, in_use = 80 * GiB, 20 * GiB
    _fake_gpu(monkeypatch, total, in_use)
    config = _gpu_config()
    assert config.max_num_seqs is None and config.max_num_batched_tokens is None  # unresolved until sized
    resolved, budget = memory.fit_cache(cfg_9b, config, BF16)
    slot, r = memory.bytes_per_sequence(cfg_9b, 8192, 3, BF16), memory.reserve(cfg_9b, 3, BF16)
    expected = (int(0.9 * total) - in_use - r.fixed - SCRATCH_SLOTS * slot) // (slot + r.per_seq)
    assert 40 < expected < MAX_NUM_SEQS
    assert resolved.max_num_seqs == expected
    assert resolved.max_num_batched_tokens == PREFILL_CHUNK + expected * STEP_ROWS
    assert budget.nbytes == int(0.9 * total) - in_use and budget.where == "0.9 of the GPU's 80.0 GiB"
    layout = memory.cache_layout(cfg_9b, 8192, 3, BF16, num_slots=expected, scratch=SCRATCH_SLOTS)
    check_fits(cfg_9b, layout, BF16, budget)
    # half the GPU: fewer; a huge GPU: capped at MAX_NUM_SEQS
    half, _ = memory.fit_cache(cfg_9b, _gpu_config(gpu_memory_utilization=0.5), BF16)
    assert half.max_num_seqs == (int(0.5 * total) - in_use - r.fixed - SCRATCH_SLOTS * slot) // (slot + r.per_seq)
    _fake_gpu(monkeypatch, 2000 * GiB, in_use)
    assert memory.fit_cache(cfg_9b, config, BF16)[0].max_num_seqs == MAX_NUM_SEQS


def test_nothing_fits_is_one_error_saying_what_would(cfg_9b, monkeypatch):
    _fake_gpu(monkeypatch, 80 * GiB, 70 * GiB, 66 * GiB)  # 0.9 of 80 GiB leaves 2 GiB: less than the reserve and a slot
    with pytest.raises(CacheMemoryError) as info:
        memory.fit_cache(cfg_9b, _gpu_config(), BF16)
    msg = str(info.value)
    assert "\n" not in msg and "0 sequence(s) of 8192 tokens fit (--max-num-seqs)" in msg
    assert "0.9 of the GPU's 80.0 GiB (less 70.00 GiB in use" in msg and "--gpu-memory-utilization" in msg
    # what of it torch's tensors hold and what lies beside them (run 156: memory outside the allocator)
    assert "66.00 GiB of tensors" in msg and "4.00 GiB beside them" in msg


def test_an_explicit_max_num_seqs_over_the_budget_is_refused(cfg_9b, monkeypatch):
    _fake_gpu(monkeypatch, 80 * GiB, 20 * GiB)
    fits = memory.fit_cache(cfg_9b, _gpu_config(), BF16)[0].max_num_seqs
    for n in (fits, fits + 1):
        config, budget = memory.fit_cache(cfg_9b, _gpu_config(max_num_seqs=n), BF16)
        assert config.max_num_seqs == n  # a count given wins, checked by the pool
        layout = memory.cache_layout(cfg_9b, 8192, 3, BF16, num_slots=n, scratch=SCRATCH_SLOTS)
        if n == fits:
            check_fits(cfg_9b, layout, BF16, budget)
            continue
        with pytest.raises(CacheMemoryError) as info:
            check_fits(cfg_9b, layout, BF16, budget)
        msg = str(info.value)
        assert f"the cache for {n} sequence(s) (and 1 scratch slot) of 8192 tokens" in msg
        assert f"{fits} sequence(s) of 8192 tokens fit (--max-num-seqs)" in msg and "--max-model-len" in msg


def test_tensor_parallel_ranks_take_the_fewest(monkeypatch):
    """Every rank holds the same slots: each sizes its own GPU, all take the least."""
    import torch.distributed as dist

    monkeypatch.setattr("nextn.parallel.launch.initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, n: out.__setitem__(slice(None), [n, 3]))
    assert memory._fewest(5, 2) == 3 and memory._fewest(5, 1) == 5


def test_the_cpu_keeps_its_8_slots_checked_against_available_memory(dense_ckpt):
    """No GPU memory to size: 8 slots whatever gpu_memory_utilization says, and the start-up line says so."""
    llm = nextn.LLM(model=dense_ckpt, device="cpu", max_model_len=64, gpu_memory_utilization=0.1)
    assert llm.config.max_num_seqs == 8 == llm.engine.pool.num_slots - SCRATCH_SLOTS == llm.engine.scheduler.num_slots
    assert llm.config.gpu_memory_utilization == 0.1
    line = llm.engine.pool.describe()
    assert line.startswith("cache: 8 sequences of 64 tokens (") and "gpu_memory_utilization sizes GPUs only" in line


@pytest.mark.parametrize("value", [0, 1.5, -0.1, float("nan"), "x", True])
def test_gpu_memory_utilization_outside_0_1_is_refused_by_llm(dense_ckpt, value, monkeypatch):
    monkeypatch.setattr("nextn.engine.llm.load_model", lambda *a, **kw: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be (a number )?in \(0, 1\]"):
        nextn.LLM(model=dense_ckpt, device="cpu", gpu_memory_utilization=value)


@pytest.mark.parametrize("command", ["generate --prompt hi", "serve", "bench"])
@pytest.mark.parametrize("value", ["0", "1.5", "x"])
def test_gpu_memory_utilization_outside_0_1_is_one_cli_line(command, value, capsys, monkeypatch):
    monkeypatch.setattr("nextn.hub.download", lambda *a: pytest.fail("the model downloaded"))
    argv = [*command.split(), "--device", "cpu", "--gpu-memory-utilization", value, "--log-level", "warning"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nextn: error: --gpu-memory-utilization must be"), err
    assert f"got {value!r}" in err if value == "x" else f"got {float(value)}" in err


def test_bench_reports_the_cache_fit(tmp_path):
    """The bundled model on the CPU: the report's bytes per sequence are what the pool of the
    bench's own engine holds per slot (K = the largest --spec-k, the bench's context); 8 slots."""
    from nextn.config import DEFAULT_MODEL_DIR
    from nextn.engine.engine import build_core
    from nextn.models.loader import load_model

    out = tmp_path / "res.json"
    argv = ["bench", "--device", "cpu", "--spec-k", "1", "--prompt-len", "4", "--gen-len", "2", "--repeats", "1"]
    assert main([*argv, "--log-level", "warning", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    max_len = 4 + 2 + 2 * STEP_ROWS
    assert (res["cache_max_model_len"], res["cache_spec_k"], res["max_num_seqs"]) == (max_len, 1, 8)
    model = load_model(DEFAULT_MODEL_DIR)
    pool, _, _ = build_core(model, EngineConfig("m", "cpu", "float32", SpecConfig(1), max_len, 2))
    assert res["cache_bytes_per_sequence"] == pool.slot_nbytes == pool.cache.nbytes // (2 + SCRATCH_SLOTS)
    assert res["cache_bytes_total"] == (8 + SCRATCH_SLOTS) * pool.slot_nbytes and res["gpu_memory_utilization"] == 0.9


def test_bench_sizes_the_cache_before_it_measures(monkeypatch):
    """--max-model-len and --gpu-memory-utilization reach the fit; a fake GPU reading gives the count."""
    from nextn.bench import measure as bench_measure
    from nextn.bench import offline as bench

    seen = {}

    def fit(model, cfg, max_len, k):
        seen.update(max_len=max_len, k=k, f=cfg.gpu_memory_utilization)
        raise SystemExit(0)  # the fit comes first: nothing else runs

    monkeypatch.setattr(bench, "cache_fit", fit)
    argv = ["bench", "--device", "cpu", "--spec-k", "2", "3", "--max-model-len", "800"]
    with pytest.raises(SystemExit):
        main([*argv, "--gpu-memory-utilization", "0.5", "--log-level", "warning"])
    assert seen == {"max_len": 800, "k": 3, "f": 0.5}
    # the fit itself, for a model on a (fake) GPU: the engine's count
    _fake_gpu(monkeypatch, 80 * GiB, 20 * GiB)
    cfg_9b = ModelConfig.from_dict(PRESETS["qwen3.5-9b"])
    weight = types.SimpleNamespace(device="cuda", dtype=BF16)
    model = types.SimpleNamespace(cfg=cfg_9b, parameters=lambda: iter([weight]))  # a loaded 9B, as cache_fit sees it
    fit = bench_measure.cache_fit(model, bench_measure.BenchConfig(spec_ks=[3]), 800, 3)
    expected = memory.sequences_that_fit(cfg_9b, 800, 3, int(0.9 * 80 * GiB) - 20 * GiB, BF16)
    assert fit.max_num_seqs == expected and fit.bytes_per_sequence == memory.bytes_per_sequence(cfg_9b, 800, 3, BF16)
