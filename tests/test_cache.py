"""The cache slots: one allocation whose byte count is every tensor it holds, a memory check that
refuses what does not fit with the numbers that would, and the commit rule on host and device."""

from __future__ import annotations

import pytest
import torch

from nextn.cache import CacheLayout, CacheMemoryError, HybridCache, StepBatch, commit_ctl
from nextn.cache import pool as pool_mod
from nextn.cache.hybrid import (
    CONV_AT,
    CONV_WRITE,
    NUM_CTL,
    PENDING,
    SEQ_LEN,
    STATE_AT,
    STATE_WRITE,
    nbytes_of,
    tensor_specs,
)
from nextn.config.model import ModelConfig
from nextn.engine.device_round import round_buffers
from nextn.models.loader import load_model
from nextn.sample.sampler import sampler_buffers


@pytest.fixture(scope="module")
def cfg(dense_ckpt) -> ModelConfig:
    return ModelConfig.from_hf(dense_ckpt)


def _layout(cfg, slots=3, max_len=100, k=3, kv="auto"):
    extra = tuple(round_buffers(cfg, k, torch.float32) + sampler_buffers(cfg.vocab_size, max_len))
    return CacheLayout(slots, max_len, k + 1, draft=True, extra=extra, kv_cache_dtype=kv)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_nbytes_is_every_tensor_the_cache_holds(cfg, kv):
    layout = _layout(cfg, kv=kv)
    cache = HybridCache(cfg, layout, "cpu", torch.float32)
    held = {id(t): t for t in vars(cache).values() if isinstance(t, torch.Tensor)}
    held.update({id(t): t for t in cache.tensors.values()})
    assert cache.nbytes == sum(t.numel() * t.element_size() for t in held.values())
    assert cache.nbytes == nbytes_of(tensor_specs(cfg, layout, torch.float32))
    # every per-slot tensor has the slot dimension first; a slot's views are disjoint
    a, b = cache.slot(0), cache.slot(2)
    for name, t in cache.tensors.items():
        assert t.shape[0] == 3, name
        assert a.t(name).data_ptr() != b.t(name).data_ptr()
    # the step buffers are part of it: two halves of one base state and R = K + 1 rows' gates per GDN layer
    assert cache.tensors["states"].shape[2] == 2 and cache.tensors["gates"].shape[2] == 2 * layout.step_states
    # fp8: e4m3 K/V and a float32 scale per (slot, position, kv head), counted; the draft K/V as they were
    kv_layer = cache.kv(cfg.layer_types.index("full_attention"))
    assert (kv_layer.key_scale is not None) == (kv == "fp8") and cache.draft_kv().key.dtype == torch.float32
    if kv == "fp8":
        assert kv_layer.key.dtype == torch.float8_e4m3fn and kv_layer.key_scale.shape == kv_layer.key.shape[:3]
        exact = nbytes_of(tensor_specs(cfg, _layout(cfg), torch.float32))
        assert cache.nbytes < exact  # 1 + 4 / head_dim bytes per K/V value, not 4


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_a_cache_that_does_not_fit_is_refused_with_what_fits(cfg, monkeypatch, kv):
    layout = _layout(cfg, slots=8, max_len=4096, kv=kv)
    need = nbytes_of(tensor_specs(cfg, layout, torch.float32))
    monkeypatch.setattr(pool_mod, "available_bytes", lambda device: int(need * 0.6 / 0.9))
    budget = pool_mod.cpu_budget(torch.device("cpu"))
    with pytest.raises(CacheMemoryError) as info:
        pool_mod.SlotPool(cfg, layout, "cpu", torch.float32, budget)
    msg = str(info.value)
    # 0.6 of the 8 slots' bytes holds 4 slots: 3 sequences beside the engine's scratch slot (SCRATCH_SLOTS)
    assert "8 sequence(s) of 4096 tokens" in msg and "3 sequence(s) of 4096 tokens fit" in msg
    fits = int(msg.split("or 8 of up to ")[1].split(" tokens")[0])
    assert 0 < fits < 4096
    # what the message says fits, fits
    smaller = _layout(cfg, slots=8, max_len=fits, kv=kv)
    assert nbytes_of(tensor_specs(cfg, smaller, torch.float32)) <= int(need * 0.6 / 0.9) * 0.9
    pool_mod.check_fits(cfg, smaller, torch.float32, budget)


def test_the_engine_checks_memory_before_allocating(dense_ckpt, monkeypatch):
    import nextn

    monkeypatch.setattr(pool_mod, "available_bytes", lambda device: 10_000)
    with pytest.raises(CacheMemoryError, match="--max-num-seqs"):
        nextn.LLM(model=dense_ckpt, max_num_seqs=4)


def test_commit_rule_on_host_and_device_agree(cfg):
    """commit_ctl with a device scalar (a round's accept) equals it with a host int (a request's
    end), and keeps tokens by moving pointers between the halves."""
    R, C = 4, 7
    ctl = torch.tensor([10, -1, 0, -1, 0, 9, 1, 0, 0], dtype=torch.int32)
    for kept in range(1, R + 1):
        host = commit_ctl(ctl, kept, C, round_=True)
        device = commit_ctl(ctl, torch.tensor(kept), C, round_=True)
        assert torch.equal(host, device) and host.dtype == torch.int32 and host.shape == (NUM_CTL,)
        assert host[SEQ_LEN] == 10 + kept and host[STATE_AT] == 0 and host[STATE_WRITE] == 1
        assert host[CONV_AT] == kept and host[CONV_WRITE] == C and host[PENDING] == kept  # the kept rows pend
        again = commit_ctl(host, 1, C, round_=True)  # the next step wrote the other halves
        assert again[STATE_AT] == 1 and again[STATE_WRITE] == 0 and again[CONV_AT] == C + 1 and again[PENDING] == 1
    prefill = commit_ctl(again, 16, C, store_all=False)  # a prefill step keeps its last state only
    assert prefill[STATE_AT] == 0 and prefill[SEQ_LEN] == 27 + R and prefill[PENDING] == 0


def test_prefilled_states_are_where_ctl_says(dense_ckpt):
    """An empty slot reads zeros from half 0; a chunked prefill and each step write the other half
    and the commit points there; a verify's kept rows are pending."""
    model = load_model(dense_ckpt)
    cache = HybridCache(model.cfg, CacheLayout(1, 64, 4, draft=False), "cpu", torch.float32).slot(0)
    cols = cache.cols
    assert cache.get(STATE_AT) == 0 and cache.get(STATE_WRITE) == 1 and cache.get(CONV_WRITE) == cols
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), cache)
        cache.commit_chunk(3)
        assert cache.get(STATE_AT) == 1 and cache.get(CONV_AT) == cols and cache.get(PENDING) == 0
        model(torch.tensor([[8, 9]]), StepBatch([cache], [2]))
        cache.commit(2)
    assert cache.get(STATE_AT) == 0 and cache.get(CONV_AT) == 2 and cache.seq_len == 5 and cache.get(PENDING) == 2


@pytest.mark.parametrize("state_at,conv_at,pending", [(0, 0, 0), (1, 9, 0), (0, 2, 2), (1, 10, 3), (0, 4, 4)])
def test_snapshot_gdn_gathers_what_the_host_reads_say(cfg, state_at, conv_at, pending):
    """A checkpoint's gather at ctl's device values (no host read) holds what the host-read parts
    hold: every GDN layer's base state, its conv columns with the pending rows' before them, and the
    pending rows' gates; a restore brings the same parts back."""
    torch.manual_seed(state_at * 100 + conv_at * 10 + pending)
    cache = HybridCache(cfg, CacheLayout(2, 64, 4, draft=False), "cpu", torch.float32)
    for name in ("window", "states", "gates"):
        cache.tensors[name].normal_()
    slot = cache.slot(1)
    slot.set(state_at=state_at, conv_at=conv_at, pending=pending)
    parts = {i: slot.gdn_parts(i) for i in cache.gdn_index}
    slot.snapshot_gdn()
    W = cfg.linear_conv_kernel_dim
    assert int(slot.t("ckpt_pending")) == pending
    for i, j in cache.gdn_index.items():
        cols = parts[i].conv if parts[i].rows is None else parts[i].rows
        assert cols.shape[-1] == W - 1 + pending
        assert torch.equal(slot.t("ckpt_conv")[j][:, : W - 1 + pending], cols)
        assert torch.equal(slot.t("ckpt_recurrent")[j], parts[i].base)
        if pending:
            assert torch.equal(slot.t("ckpt_gates")[j][:pending], parts[i].gates)
    snapshot = {i: [t.clone() if t is not None else None for t in p] for i, p in parts.items()}
    for name in ("window", "states", "gates"):
        cache.tensors[name].normal_()  # what the slot ran after the checkpoint
    slot.restore_gdn(20)
    for i, before in snapshot.items():
        after = slot.gdn_parts(i)
        for a, b in zip(after, before, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_a_resplit_step_batch_holds_what_a_batch_of_its_split_holds(cfg):
    """StepBatch.resplit (a chunked mixed step's pieces split otherwise, the same count, total rows and
    chunks: one graph key, StepBatch.sizes) leaves every device tensor the step's kernels read, the
    chunk layout made before it included, as a batch made for the new split holds it (the slot
    tensors re-derived by `refresh`, as a graph's replay does), and refuses a split of other sizes."""
    cache = HybridCache(cfg, _layout(cfg, slots=4), "cpu", torch.float32)
    caches = [cache.slot(s) for s in (3, 0, 2, 1)]
    before, after = [4, 1, 70, 30], [4, 1, 30, 70]  # verify rows 4 + 1, pieces of 3 chunks in 100 rows
    assert StepBatch.sizes(before, 2, True) == StepBatch.sizes(after, 2, True) != StepBatch.sizes(after, 2, False)
    assert StepBatch.sizes(before, 2, True) != StepBatch.sizes([4, 1, 64, 36], 2, True)  # 2 chunks
    batch = StepBatch(caches, before, pieces_from=2, chunked=True)
    layout, flat = batch.chunk_layout(2, 4), batch.flat_rows(4)
    batch.follow(torch.tensor([3, 0, 2, 1], dtype=torch.int32))
    batch.resplit(after)
    batch.refresh(caches)
    fresh = StepBatch(caches, after, pieces_from=2, chunked=True)
    assert batch.rows == fresh.rows and batch.offsets == fresh.offsets
    for name in ("seqs", "slot_index", "row_seq", "row_idx", "row_slot"):
        assert torch.equal(getattr(batch, name), getattr(fresh, name)), name
    assert torch.equal(flat, fresh.flat_rows(4))
    made = fresh.chunk_layout(2, 4)
    assert batch.chunk_layout(2, 4) is layout and layout.bound == made.bound == 100
    for name in ("index", "real", "starts"):
        assert torch.equal(getattr(layout, name), getattr(made, name)), name
    # the layout: piece p's rows from chunk starts[p], zero rows (the step's row count) to its last chunk's end
    assert made.starts.tolist() == [0, 1, 3] and made.index.shape == (1, 3 * 64)
    assert made.index[0, :30].tolist() == list(range(5, 35)) and set(made.index[0, 30:64].tolist()) == {105}
    assert made.index[0, 64:134].tolist() == list(range(35, 105)) and made.real[30:].tolist() == list(range(64, 134))
    for rows in ([4, 1, 64, 36], [4, 2, 30, 69], [4, 1, 30, 71]):  # chunks, verify rows, total rows
        with pytest.raises(ValueError):
            batch.resplit(rows)
