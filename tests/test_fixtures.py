"""The test fixtures themselves: transformers loads every checkpoint, the layouts and expert
formats hold identical weights, the MTP tensors are the released set, the random models are not
degenerate, and the MTP oracle agrees with its plain-torch reconstruction."""

from __future__ import annotations

import json

import hf_fixtures as hf
import pytest
import torch
import transformers

PROMPTS = ([1, 2, 3], [100, 40, 7, 250, 8, 61], [346, 84, 82, 262, 198, 39, 264, 75, 78, 11, 278, 347])
CKPTS = ("dense_ckpt", "vlm_ckpt", "moe_ckpt", "moe_perexpert_ckpt", "moe_vlm_ckpt", "next_ckpt")
H = hf.HIDDEN_SIZE


def _mtp_names(model_dir) -> list[str]:
    return sorted(k for k in hf.read_tensors(model_dir) if k.startswith("mtp."))


def _state(model) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def _assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("ckpt", CKPTS)
def test_transformers_loads_every_tensor(ckpt, request):
    """The trunk loads with nothing missing, and only mtp.* / model.visual.* left unused."""
    model_dir = request.getfixturevalue(ckpt)
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    cls = transformers.AutoModelForImageTextToText if hf.is_vlm_layout(model_dir) else transformers.AutoModelForCausalLM
    _, info = cls.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert all(k.startswith(("mtp.", "model.visual.")) for k in info["unexpected_keys"])
    assert cfg.get_text_config().vocab_size == hf.VOCAB_SIZE


def test_configs_mirror_released_ones(dense_ckpt, vlm_ckpt, moe_vlm_ckpt, next_ckpt):
    read = lambda d: json.loads((d / "config.json").read_text())  # noqa: E731
    assert read(dense_ckpt)["model_type"] == "qwen3_5_text"
    assert read(dense_ckpt)["mtp_num_hidden_layers"] == 1
    assert "mtp_num_hidden_layers" not in read(next_ckpt)
    for d, model_type in ((vlm_ckpt, "qwen3_5"), (moe_vlm_ckpt, "qwen3_5_moe")):
        cfg = read(d)
        assert cfg["model_type"] == model_type and "vision_config" in cfg
        assert cfg["architectures"][0].endswith("ForConditionalGeneration")
        assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
        assert cfg["text_config"]["model_type"] == model_type + "_text"


def test_vlm_layout_holds_the_text_layout_weights(dense_ckpt, vlm_ckpt):
    text, vlm = hf.read_tensors(dense_ckpt), hf.read_tensors(vlm_ckpt)
    visual = [k for k in vlm if k.startswith("model.visual.")]
    assert visual
    renamed = {k.replace("model.language_model.", "model.", 1): v for k, v in vlm.items() if k not in visual}
    _assert_same_state(text, renamed)
    _assert_same_state(_state(hf.load_hf_model(dense_ckpt)), _state(hf.load_hf_model(vlm_ckpt)))


def test_vlm_class_gives_the_text_logits(dense_ckpt, vlm_ckpt):
    model = transformers.AutoModelForImageTextToText.from_pretrained(vlm_ckpt, dtype=torch.float32).eval()
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, hf.hf_logits(dense_ckpt, ids), rtol=0, atol=1e-5)


def test_vlm_shards_and_index(vlm_ckpt):
    index = json.loads((vlm_ckpt / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((vlm_ckpt / f).is_file() for f in files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(hf.read_tensors(vlm_ckpt))
    assert not (vlm_ckpt / "model.safetensors").exists()


def test_mtp_tensor_sets(dense_ckpt, vlm_ckpt, moe_ckpt, moe_perexpert_ckpt, next_ckpt):
    """15 dense, 19 MoE with fused experts, 17 + 3 * num_experts with per-expert tensors."""
    assert len(_mtp_names(dense_ckpt)) == 15
    assert _mtp_names(vlm_ckpt) == _mtp_names(dense_ckpt)
    assert len(_mtp_names(moe_ckpt)) == 19
    assert len(_mtp_names(moe_perexpert_ckpt)) == 17 + 3 * 4
    assert len(_mtp_names(next_ckpt)) == 17 + 3 * 4
    t = hf.read_tensors(moe_ckpt)
    assert t["mtp.fc.weight"].shape == (H, 2 * H)
    assert t["mtp.layers.0.mlp.experts.gate_up_proj"].shape == (4, 2 * 32, H)
    assert t["mtp.layers.0.mlp.experts.down_proj"].shape == (4, H, 32)
    trunk_attn = {k.split("layers.3.")[1]: v.shape for k, v in t.items() if k.startswith("model.layers.3.")}
    mtp_layer = {k.split("layers.0.")[1]: v.shape for k, v in t.items() if k.startswith("mtp.layers.0.")}
    assert trunk_attn == mtp_layer


def test_tied_and_untied_heads(tmp_path, dense_ckpt, moe_ckpt):
    assert "lm_head.weight" not in hf.read_tensors(dense_ckpt)
    assert "lm_head.weight" in hf.read_tensors(moe_ckpt)
    untied = hf.make_checkpoint(tmp_path / "untied", "dense", tie=False)
    assert "lm_head.weight" in hf.read_tensors(untied)
    assert not json.loads((untied / "config.json").read_text())["tie_word_embeddings"]


def test_expert_formats_load_identically(moe_ckpt, moe_perexpert_ckpt):
    assert not hf.has_per_expert_tensors(hf.read_tensors(moe_ckpt))
    assert hf.has_per_expert_tensors(hf.read_tensors(moe_perexpert_ckpt))
    _assert_same_state(_state(hf.load_hf_model(moe_ckpt)), _state(hf.load_hf_model(moe_perexpert_ckpt)))
    _assert_same_state(_state(hf.load_hf_mtp(moe_ckpt)), _state(hf.load_hf_mtp(moe_perexpert_ckpt)))


@pytest.mark.parametrize("ckpt", ("dense_ckpt", "moe_ckpt", "next_ckpt"))
def test_mtp_model_loads_the_mtp_tensors_bit_exactly(ckpt, request):
    model_dir = request.getfixturevalue(ckpt)
    raw = hf.fuse_experts(hf.read_tensors(model_dir))
    outer = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "post_norm": "norm"}
    loaded = {k: v for k, v in _state(hf.load_hf_mtp(model_dir)).items() if k.startswith("layers.0.")}
    assert len(loaded) == len([k for k in raw if k.startswith("mtp.")])
    for name, value in loaded.items():
        part = name[len("layers.0.") :]
        head, _, rest = part.partition(".")
        source = f"mtp.layers.0.{rest}" if head == "mtp_block" else f"mtp.{outer[head]}.{rest}"
        assert torch.equal(value, raw[source]), name


def test_checkpoints_are_deterministic(tmp_path):
    a = hf.read_tensors(hf.make_checkpoint(tmp_path / "a", "next", seed=3))
    b = hf.read_tensors(hf.make_checkpoint(tmp_path / "b", "next", seed=3))
    c = hf.read_tensors(hf.make_checkpoint(tmp_path / "c", "next", seed=4))
    _assert_same_state(a, b)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_tokenizer_and_chat_template(dense_ckpt):
    from tokenizers import Tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(dense_ckpt)
    raw = Tokenizer.from_file(str(dense_ckpt / "tokenizer.json"))
    assert raw.get_vocab_size() == hf.VOCAB_SIZE == len(tok)
    ids = hf.special_token_ids()
    messages = [{"role": "user", "content": "Hello, world!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n"
    encoded = raw.encode(text).ids
    assert tok(text)["input_ids"] == encoded
    assert encoded[0] == ids["<|im_start|>"] and ids["<|im_end|>"] in encoded
    assert raw.decode(encoded, skip_special_tokens=False) == text
    generation = json.loads((dense_ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("ckpt", ("dense_ckpt", "moe_ckpt", "next_ckpt"))
def test_greedy_is_not_degenerate(ckpt, request):
    model_dir = request.getfixturevalue(ckpt)
    outputs = [hf.hf_greedy(model_dir, p, 16) for p in PROMPTS]
    assert all(len(set(out)) >= 8 for out in outputs), outputs
    assert len({tuple(out) for out in outputs}) == len(outputs)


@pytest.mark.parametrize("ckpt", ("dense_ckpt", "moe_ckpt", "next_ckpt"))
def test_greedy_matches_transformers_generate(ckpt, request):
    """The no-cache argmax loop equals generate()'s cached greedy path (EOS disabled)."""
    model_dir = request.getfixturevalue(ckpt)
    model = hf.load_hf_model(model_dir)
    prompt = PROMPTS[1]
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    assert out[0, len(prompt) :].tolist() == hf.hf_greedy(model_dir, prompt, 12)


@pytest.mark.parametrize("ckpt", ("dense_ckpt", "vlm_ckpt", "next_ckpt"))
def test_hidden_states_feed_the_logits(ckpt, request):
    model_dir = request.getfixturevalue(ckpt)
    model = hf.load_hf_model(model_dir)
    ids = PROMPTS[2]
    pre, post = hf.hf_hidden_states(model_dir, ids)
    assert pre.shape == post.shape == (len(ids), H)
    assert not torch.allclose(pre / pre.norm(dim=-1, keepdim=True), post / post.norm(dim=-1, keepdim=True), atol=0.05)
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(pre), post, rtol=0, atol=0)
        torch.testing.assert_close(model.lm_head(post), hf.hf_logits(model_dir, ids), rtol=0, atol=1e-6)


@pytest.mark.parametrize("ckpt", ("dense_ckpt", "moe_ckpt", "next_ckpt", "moe_vlm_ckpt"))
def test_mtp_oracle_matches_plain_torch(ckpt, request):
    model_dir = request.getfixturevalue(ckpt)
    ids = PROMPTS[2]
    for hidden in hf.hf_hidden_states(model_dir, ids):
        logits = hf.hf_mtp_logits(model_dir, ids, hidden)
        assert logits.shape == (len(ids) - 1, hf.VOCAB_SIZE)
        torch.testing.assert_close(logits, hf.torch_mtp_logits(model_dir, ids, hidden), rtol=0, atol=1e-5)


def test_mtp_oracle_is_causal_over_rows(dense_ckpt):
    """Row t depends only on tokens 0..t+1 and hidden rows 0..t."""
    ids = PROMPTS[2]
    _, hidden = hf.hf_hidden_states(dense_ckpt, ids)
    full = hf.hf_mtp_logits(dense_ckpt, ids, hidden)
    prefix = hf.hf_mtp_logits(dense_ckpt, ids[:6], hidden[:6])
    torch.testing.assert_close(full[:5], prefix, rtol=0, atol=1e-5)
    bumped = hidden.clone()
    bumped[5] += 1.0
    changed = hf.hf_mtp_logits(dense_ckpt, ids, bumped)
    torch.testing.assert_close(changed[:5], full[:5], rtol=0, atol=1e-5)
    assert not torch.allclose(changed[5], full[5], atol=1e-3)


@pytest.mark.parametrize("ckpt", ("dense_fitted_ckpt", "moe_fitted_ckpt"))
def test_fitted_head_agrees_with_the_trunk_on_its_prompts(ckpt, request):
    """On a fitted prompt's greedy continuation the head predicts the trunk's next pick (the
    first draft of a round is accepted); on an unseen prompt it is about as good as random."""
    model_dir = request.getfixturevalue(ckpt)

    def agreement(prompt):
        ids = prompt + hf.hf_greedy(model_dir, prompt, 32)
        _, post = hf.hf_hidden_states(model_dir, ids)
        picks = hf.hf_logits(model_dir, ids).argmax(-1)[1:]
        return (hf.hf_mtp_logits(model_dir, ids, post).argmax(-1) == picks).float().mean().item()

    assert agreement(list(hf.FIT_PROMPTS[0])) > 0.95
    assert agreement([5, 17, 99, 4, 230]) < 0.3


def test_fitting_keeps_layout_and_trunk(tmp_path):
    fitted = hf.make_checkpoint(tmp_path / "vlm", "moe", layout="vlm_sharded")  # per-expert, sharded
    before = hf.read_tensors(fitted)
    hf.fit_mtp_head(fitted, [list(hf.FIT_PROMPTS[2])], num_new_tokens=8)
    after = hf.read_tensors(fitted)
    assert before.keys() == after.keys() and hf.has_per_expert_tensors(after)
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("mtp."))
    assert not all(torch.equal(before[k], after[k]) for k in before if k.startswith("mtp."))
