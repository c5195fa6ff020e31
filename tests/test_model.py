"""The trunk against transformers, the checkpoint layouts, and the cached-forward invariants."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_fixtures import hf_greedy, hf_logits
from safetensors.torch import load_file, save_file

import nextn
from nextn.cache import CacheLayout, HybridCache, StepBatch
from nextn.cache.hybrid import PENDING
from nextn.config import FULL
from nextn.config.model import ConfigError, ModelConfig
from nextn.models.loader import CheckpointError, load_model

CKPTS = ["dense_ckpt", "moe_ckpt", "moe_perexpert_ckpt", "next_ckpt", "vlm_ckpt", "moe_vlm_ckpt"]
PROMPT = [7, 81, 3, 199, 42, 5, 260, 11]


def _ids(n, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


@pytest.mark.parametrize("name", CKPTS)
def test_logits_match_transformers(name, request):
    ckpt = request.getfixturevalue(name)
    model = load_model(ckpt)
    ids = _ids(70)  # crosses the 64-token chunk of the delta rule
    with torch.no_grad():
        ours = model.logits(model.final_norm(model(ids)))[0]
    ref = hf_logits(ckpt, ids[0].tolist())
    assert torch.allclose(ours, ref, atol=2e-4, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("name", ["dense_ckpt", "moe_ckpt", "next_ckpt", "vlm_ckpt"])
def test_greedy_matches_transformers(name, request):
    ckpt = request.getfixturevalue(name)
    llm = nextn.LLM(model=ckpt, num_speculative_tokens=0)
    for prompt in (PROMPT, [17], [5, 5, 5, 5, 9]):
        out = llm.generate(
            prompt_token_ids=prompt, params=nextn.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        )
        assert out.token_ids == hf_greedy(ckpt, prompt, 24)


def test_vlm_layout_loads_the_same_weights(dense_ckpt, vlm_ckpt, moe_ckpt, moe_vlm_ckpt, moe_perexpert_ckpt):
    for a, b in ((dense_ckpt, vlm_ckpt), (moe_ckpt, moe_vlm_ckpt), (moe_ckpt, moe_perexpert_ckpt)):
        sa, sb = load_model(a).state_dict(), load_model(b).state_dict()
        assert sa.keys() == sb.keys() and any(k.startswith("mtp.") for k in sa)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def _slots(model, num_slots=2, rows=5):
    """num_slots views of one cache (64 tokens each, steps keeping up to `rows` states)."""
    cache = HybridCache(model.cfg, CacheLayout(num_slots, 64, rows, draft=False), "cpu", torch.float32)
    return [cache.slot(s) for s in range(num_slots)]


def _step(model, ids, cache):
    """A keep-states step of one sequence: a batch of one."""
    return model(ids, StepBatch([cache], [ids.shape[1]]))


def _gdn_layers(model):
    return [i for i, t in enumerate(model.cfg.layer_types) if t != FULL]


@pytest.mark.parametrize("name", ["dense_ckpt", "moe_ckpt", "next_ckpt"])
def test_multi_token_step_equals_single_steps(name, request):
    """A (K+1)-token keep-states step over the cache == K+1 one-token steps: outputs and per-token states."""
    model = load_model(request.getfixturevalue(name))
    ids = _ids(20, seed=1)
    multi, single = _slots(model)
    with torch.no_grad():
        for cache in (multi, single):
            model(ids[:, :15], cache)
            cache.commit_chunk(15)
        h_multi = _step(model, ids[:, 15:], multi)
        before = multi.ctl.clone()
        for t in range(5):
            h1 = _step(model, ids[:, 15 + t : 16 + t], single)
            single.commit(1)
            # bitwise: decode and verify rows share one arithmetic (the fixed-shape step)
            assert torch.equal(h1[0, 0], h_multi[0, t])
            multi.ctl.copy_(before)
            multi.commit(t + 1)  # keeping t + 1 rows of the verify: their states are the fold's
            assert multi.get(PENDING) == t + 1
            for i in _gdn_layers(model):
                for x, y in zip(model.committed_gdn(multi, i), model.committed_gdn(single, i), strict=True):
                    assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["dense_ckpt", "moe_ckpt", "next_ckpt"])
def test_batched_step_equals_each_sequence_alone(name, request):
    """A step over three sequences (different lengths and row counts, rows packed) == each one's
    step alone, bitwise: hiddens, K/V and every state written."""
    model = load_model(request.getfixturevalue(name))
    ids = _ids(40, seed=3)
    caches = _slots(model, num_slots=6)
    batched, alone = caches[:3], caches[3:]
    lengths, rows = (9, 17, 4), (1, 5, 3)
    with torch.no_grad():
        for b, n in enumerate(lengths):
            for cache in (batched[b], alone[b]):
                model(ids[:, :n] + b, cache)
                cache.commit_chunk(n)
        step_ids = [ids[:, 20 + b : 20 + b + r] for b, r in enumerate(rows)]
        h_batch = model(torch.cat(step_ids, dim=1), StepBatch(batched, list(rows)))[0]
        offsets = [0, 1, 6, 9]
        for b, cache in enumerate(alone):
            h = _step(model, step_ids[b], cache)[0]
            assert torch.equal(h, h_batch[offsets[b] : offsets[b + 1]]), b
            batched[b].commit(rows[b])
            cache.commit(rows[b])
            for i in _gdn_layers(model):
                for x, y in zip(model.committed_gdn(batched[b], i), model.committed_gdn(cache, i), strict=True):
                    assert torch.equal(x, y)
            for i in (i for i, t in enumerate(model.cfg.layer_types) if t == FULL):
                n = cache.seq_len
                assert torch.equal(batched[b].kv(i)[0][:n], cache.kv(i)[0][:n])


@pytest.mark.parametrize("name", ["dense_ckpt", "next_ckpt"])
@pytest.mark.parametrize("n_keep", [1, 2, 3, 4, 5])
def test_commit_rolls_back_to_the_kept_prefix(name, n_keep, request):
    """State after a 5-token step committing n == state after feeding those n tokens one at a time."""
    model = load_model(request.getfixturevalue(name))
    ids = _ids(15, seed=2)
    a, b = _slots(model)
    with torch.no_grad():
        for cache in (a, b):
            model(ids[:, :10], cache)
            cache.commit_chunk(10)
        _step(model, ids[:, 10:15], a)
        a.commit(n_keep)
        for t in range(n_keep):
            _step(model, ids[:, 10 + t : 11 + t], b)
            b.commit(1)
        assert a.seq_len == b.seq_len == 10 + n_keep
        for i in _gdn_layers(model):
            for x, y in zip(model.committed_gdn(a, i), model.committed_gdn(b, i), strict=True):
                assert torch.equal(x, y)
        n = a.seq_len
        for i in (i for i, t in enumerate(model.cfg.layer_types) if t == FULL):
            assert torch.equal(a.kv(i)[0][:n], b.kv(i)[0][:n])
        # the next token sees identical states
        nxt = ids[:, 14:15]
        ha, hb = _step(model, nxt, a), _step(model, nxt, b)
        assert torch.equal(ha, hb)


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(ckpt, fn):
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_bad_checkpoints_name_the_tensor(dense_ckpt, tmp_path):
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    ckpt = _copy(dense_ckpt, tmp_path / "missing")
    _edit_tensors(ckpt, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing.*in_proj_qkv"):
        load_model(ckpt)
    ckpt = _copy(dense_ckpt, tmp_path / "unknown")
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.bogus.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unknown.*bogus"):
        load_model(ckpt)
    ckpt = _copy(dense_ckpt, tmp_path / "shape")
    _edit_tensors(ckpt, lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(CheckpointError, match="in_proj_qkv.*shape"):
        load_model(ckpt)
    ckpt = _copy(dense_ckpt, tmp_path / "mtp_shape")
    _edit_tensors(ckpt, lambda t: t.update({"mtp.fc.weight": t["mtp.fc.weight"][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match="mtp.fc.weight"):
        load_model(ckpt)


def test_bad_configs_are_clear(dense_ckpt, tmp_path):
    ckpt = _copy(dense_ckpt, tmp_path / "cfg")
    raw = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_dict({**raw, "model_type": "llama"})
    broken = dict(raw)
    broken.pop("linear_num_value_heads")
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        ModelConfig.from_dict(broken)
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_dict({**raw, "layer_types": ["linear_attention"]})
    # a hand-edited size of the wrong type was a TypeError deep in the model's construction
    for key, value in (("vocab_size", "352"), ("hidden_size", 64.0), ("num_key_value_heads", 0)):
        with pytest.raises(ConfigError, match=f"'{key}' must be a positive integer, got {value!r}"):
            ModelConfig.from_dict({**raw, key: value})
    with pytest.raises(ValueError, match="dtype must be one of"):  # was a KeyError
        load_model(ckpt, dtype="float8")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(ckpt)


def test_missing_mtp_head_means_plain_decoding(dense_ckpt, tmp_path, caplog):
    ckpt = _copy(dense_ckpt, tmp_path / "nohead")
    _edit_tensors(ckpt, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("mtp.")]])
    llm = nextn.LLM(model=ckpt)
    assert llm.num_speculative_tokens == 0 and llm.model.mtp is None
    assert "no mtp" in caplog.text.lower()
    with pytest.raises(ValueError, match="MTP head"):
        nextn.LLM(model=ckpt, num_speculative_tokens=2)


@pytest.mark.parametrize("name", ["vlm_ckpt", "next_ckpt"])
def test_cli_generate_matches_transformers(name, request):
    """The issue's bar command: `nextn generate ... --spec-k 0 --json` emits transformers' greedy continuation."""
    import subprocess
    import sys

    ckpt = request.getfixturevalue(name)
    cmd = [
        sys.executable,
        "-m",
        "nextn.cli",
        "generate",
        "--model",
        str(ckpt),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-tokens",
        "24",
        "--temperature",
        "0",
        "--ignore-eos",
        "--spec-k",
        "0",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == hf_greedy(ckpt, PROMPT, 24)


def test_weights_in_another_dtype_than_the_config_says_warn(dense_ckpt, tmp_path, caplog):
    """A shard whose weight matrices are not in config.json's dtype (a header calling bf16 bytes F16
    loads without error and emits garbage) is named in a warning; a shard in the config's dtype is not."""
    ckpt = _copy(dense_ckpt, tmp_path / "f16")
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    _edit_tensors(ckpt, lambda t: t.update({k: v.to(torch.float16) for k, v in t.items()}))
    with caplog.at_level("WARNING", logger="nextn.models.checkpoint"):
        load_model(ckpt)
    warned = [r.getMessage() for r in caplog.records if r.name == "nextn.models.checkpoint"]
    assert len(warned) == 1 and "model.safetensors" in warned[0] and "F16 weight tensors" in warned[0]
    assert "config.json says bfloat16" in warned[0]
    caplog.clear()
    _edit_tensors(ckpt, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    with caplog.at_level("WARNING", logger="nextn.models.checkpoint"):
        load_model(ckpt)
    assert not [r for r in caplog.records if r.name == "nextn.models.checkpoint"]
