"""Tiny random Hugging Face checkpoints of the Qwen3.5 / Qwen3-Next family, written in the real HF
layouts by transformers itself, and transformers-based reference functions (the test oracles).

Owns: the fixture tokenizer (a byte-level BPE trained on a built-in text), the tiny configs, the
random weights (seeded, deliberately far from transformers' near-zero init so greedy output is not
constant), the MTP tensors released checkpoints carry and transformers does not write, the expert
storage formats, the released VLM layout, the two published FP8 layouts (and their dequantized
twin, the model an FP8 checkpoint stands for), and the oracles `hf_logits`, `hf_greedy`,
`hf_hidden_states`, `hf_mtp_logits` (plus `torch_mtp_logits`, a plain-torch cross-check).
Does not know nextn: nothing here imports the engine.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

KINDS = ("dense", "moe", "next")
LAYOUTS = ("text", "vlm_sharded")

# kind -> (text config class, causal LM class, VLM config class or None, tie default)
_CLASSES = {
    "dense": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3_5Config", True),
    "moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeConfig", False),
    "next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", None, False),
}
_VLM_CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def _one_thread(fn):
    """Run `fn` with one intra-op thread (restored after): on these tiny models thread hand-off
    costs more than the math, and on a busy machine it made the oracles about 10x slower."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        num_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(num_threads)

    return wrapper


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

# Qwen's order: the BPE vocabulary first, then the special tokens as added tokens at the end.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VOCAB_SIZE = 352  # 256 byte symbols + 89 merges + 7 special tokens

# A simplified Qwen chat template: im_start/im_end turns, optional generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers' Qwen3.5 pre-tokenizer split (models/qwen3_5/tokenization_qwen3_5.py)
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CORPUS = '''
The quick brown fox jumps over the lazy dog. A model reads the prompt, then writes the answer one
token at a time. The user asks a question and the assistant answers it. Speculative decoding drafts
a few tokens with a small head and verifies them with the large model in one forward pass.
The cache keeps the keys and values of every attention layer, and the state of every linear layer.
When the draft is wrong, the engine rolls the state back and keeps the tokens that were accepted.
Hello, world! How are you today? I am fine, thank you. What is the time? It is ten past three.

def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()


if __name__ == "__main__":
    print({"name": "nextn", "tokens": [1, 2, 3], "ok": True})
'''


@functools.lru_cache(maxsize=1)
def fixture_tokenizer_json() -> str:
    """The fixture tokenizer as tokenizer.json text: byte-level BPE trained on `_CORPUS`, Qwen's
    NFC normaliser, pre-tokenizer and decoder, special tokens appended after the BPE vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"fixture tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tok.to_str()


def special_token_ids() -> dict[str, int]:
    """Special token -> id in the fixture tokenizer."""
    return {t: VOCAB_SIZE - len(SPECIAL_TOKENS) + i for i, t in enumerate(SPECIAL_TOKENS)}


def _write_tokenizer(out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json (chat template, eos) and generation_config.json."""
    ids = special_token_ids()
    (out_dir / "tokenizer.json").write_text(fixture_tokenizer_json())
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation_config = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "transformers_version": transformers.__version__,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2))


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

HIDDEN_SIZE = 64
NUM_HIDDEN_LAYERS = 4


def text_config(kind: str, *, tie: bool | None = None, with_mtp: bool = True):
    """The tiny transformers text config of `kind` (3 GDN layers then 1 attention layer)."""
    cfg_name, _, _, tie_default = _CLASSES[kind]
    ids = special_token_ids()
    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # grouped: 2 value heads per key head
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_default if tie is None else tie,
        eos_token_id=ids["<|endoftext|>"],
        pad_token_id=None,
        bos_token_id=None,
        dtype="float32",
    )
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    if kind != "next":
        # released Qwen3.5 configs carry the VLM's mrope sections; for text they reduce to 1-D RoPE
        rope.update(mrope_interleaved=True, mrope_section=[2, 1, 1])
        if with_mtp:
            kwargs["mtp_num_hidden_layers"] = 1  # Qwen3-Next configs have no such key
    if kind != "dense":
        kwargs.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
        )
    if kind == "next":
        kwargs.update(norm_topk_prob=True, decoder_sparse_step=1)
    return getattr(transformers, cfg_name)(rope_parameters=rope, **kwargs)


def _vlm_config(text_cfg):
    """A Qwen3.5 VLM wrapper config around `text_cfg`, with a tiny vision tower."""
    cfg_name = _CLASSES["dense" if text_cfg.model_type == "qwen3_5_text" else "moe"][2]
    ids = special_token_ids()
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=text_cfg.hidden_size,
        num_position_embeddings=16,
    )
    text = text_cfg.to_dict()
    text.pop("architectures", None)
    cfg = getattr(transformers, cfg_name)(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=text_cfg.tie_word_embeddings,
    )
    cfg.architectures = [_VLM_CLASSES[cfg.model_type]]
    return cfg


# --------------------------------------------------------------------------------------------
# Random weights
# --------------------------------------------------------------------------------------------


def _random_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """A random value for parameter `name`, scaled so every part of the network does something.

    Zero-centred norms (x_hat * (1 + w)) get small values around 0; the GDN output norm, which
    multiplies plainly, gets values around 1; matrices get N(0, 1/fan_in); decays stay moderate.
    """

    def normal(std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    if name.endswith("A_log"):  # decay rate exp(A_log) in [0.1, 2]
        return (torch.rand(shape, generator=gen) * 1.9 + 0.1).log()
    if name.endswith("dt_bias"):
        return normal(0.5)
    if name.endswith("linear_attn.norm.weight"):
        return normal(0.1, mean=1.0)
    if name == "model.norm.weight":  # far from 1, so pre- and post-norm hidden states differ clearly
        return normal(0.5)
    if "norm" in name:
        return normal(0.1)
    if "conv1d" in name:
        return normal(0.4)
    if name.endswith("embed_tokens.weight"):  # small enough that a tied head does not echo its input
        return normal(0.2)
    if len(shape) >= 2:
        return normal(shape[-1] ** -0.5 * (1.0 if len(shape) == 2 else 1.5))
    return normal(0.1)


def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Overwrite every parameter of `module` in place, deterministically from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            param.copy_(_random_tensor(name, param.shape, gen))
    return module


def build_text_model(kind: str, *, seed: int = 0, tie: bool | None = None, with_mtp: bool = True):
    """The random transformers *ForCausalLM of `kind` (float32, eval mode)."""
    cfg = text_config(kind, tie=tie, with_mtp=with_mtp)
    model = getattr(transformers, _CLASSES[kind][1])(cfg)
    return randomize_(model, seed).float().eval()


def _mtp_tensors(model, seed: int) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors as released checkpoints carry them: the fc projection and its two
    input norms, one full-attention decoder layer of the trunk's own class (so dense or MoE like
    the trunk, experts in transformers' fused form here), and the final norm."""
    cfg = copy.deepcopy(model.config)
    cfg.layer_types = ["full_attention"]
    cfg.num_hidden_layers = 1
    layer = type(model.model.layers[-1])(cfg, 0)
    randomize_(layer, seed + 1)
    hidden = cfg.hidden_size
    gen = torch.Generator().manual_seed(seed + 2)
    tensors = {f"mtp.layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.randn(hidden, generator=gen) * 0.1
    return tensors


# --------------------------------------------------------------------------------------------
# Expert storage: fused 3-D (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I],
# transformers' in-memory form) or per expert (`experts.{e}.{gate,up,down}_proj.weight`, what
# transformers 5.24's save_pretrained writes).
# --------------------------------------------------------------------------------------------

_FUSED_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors -> per-expert tensors; everything else unchanged."""
    out = {}
    for name, t in tensors.items():
        m = _FUSED_RE.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
            else:  # rows [gate | up], as transformers concatenates them
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
    return out


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> fused expert tensors; everything else unchanged."""
    out, groups = {}, {}
    for name, t in tensors.items():
        m = _PER_EXPERT_RE.match(name)
        if m is None:
            out[name] = t
        else:
            prefix, e, proj = m.groups()
            groups.setdefault(prefix, {})[(int(e), proj)] = t
    for prefix, parts in groups.items():
        num_experts = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]], dim=0) for e in range(num_experts)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(num_experts)])
    return out


def has_per_expert_tensors(names) -> bool:
    return any(_PER_EXPERT_RE.match(n) for n in names)


# --------------------------------------------------------------------------------------------
# Safetensors I/O
# --------------------------------------------------------------------------------------------


def read_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor in a checkpoint directory (sharded or not)."""
    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B)?\s*", size)
    if m is None:
        raise ValueError(f"bad max_shard_size {size!r}")
    units = {None: 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    return int(m.group(1)) * units[m.group(2)]


def write_tensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_size: int | str | None) -> None:
    """Write `tensors` as model.safetensors, or, with a shard size, as HF shards
    `model-0000i-of-0000N.safetensors` (keys in sorted order) plus model.safetensors.index.json."""
    for old in list(out_dir.glob("*.safetensors")) + list(out_dir.glob("*.safetensors.index.json")):
        old.unlink()
    tensors = {k: tensors[k].detach().contiguous().clone() for k in sorted(tensors)}
    if max_shard_size is None:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    limit = _parse_size(max_shard_size)
    shards, size = [{}], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


@_one_thread
def make_checkpoint(
    out_dir: str | Path,
    kind: str,
    *,
    layout: str = "text",
    seed: int = 0,
    with_mtp: bool = True,
    tie: bool | None = None,
    fused_experts: bool | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write a tiny random checkpoint of `kind` ("dense" | "moe" | "next") into `out_dir`.

    layout "text": what the *ForCausalLM's save_pretrained writes (config model_type
    qwen3_5_text / qwen3_5_moe_text / qwen3_next, weights `model.*`, `lm_head.weight` when untied),
    one model.safetensors unless `max_shard_size` is given.
    layout "vlm_sharded" (dense and moe only): the released Qwen3.5 VLM layout, config model_type
    qwen3_5 / qwen3_5_moe with the text keys under `text_config`, text weights under
    `model.language_model.*`, a tiny random vision tower under `model.visual.*`, `mtp.*` at the
    top level, in sharded files with an index (about 4 shards unless `max_shard_size` is given).
    The same (kind, seed, tie) gives the same text and MTP weights in both layouts.
    tie: None = the kind's default (tied for dense, untied otherwise).
    fused_experts: True = fused 3-D expert tensors, False = per expert, None = what
    save_pretrained writes (per expert in transformers 5.24; released Qwen3.5-MoE checkpoints are
    fused, Qwen3-Next ones per expert); the MTP layer uses the trunk's format.
    with_mtp: add the random `mtp.*` tensors (15 for dense, 19 for MoE with fused experts).
    Also writes the fixture tokenizer, tokenizer_config.json and generation_config.json.
    """
    if kind not in KINDS or layout not in LAYOUTS:
        raise ValueError(f"kind must be in {KINDS} and layout in {LAYOUTS}, got {kind!r}, {layout!r}")
    if layout == "vlm_sharded" and kind == "next":
        raise ValueError("Qwen3-Next has no VLM layout")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_text_model(kind, seed=seed, tie=tie, with_mtp=with_mtp)
    model.save_pretrained(out_dir)  # config.json and transformers' own tensor layout
    tensors = read_tensors(out_dir)
    if fused_experts is None:
        fused_experts = not has_per_expert_tensors(tensors)
    if with_mtp:
        tensors.update(_mtp_tensors(model, seed))
    tensors = fuse_experts(tensors) if fused_experts else split_experts(tensors)
    if layout == "vlm_sharded":
        vlm_cfg = _vlm_config(model.config)
        (out_dir / "config.json").unlink()
        vlm_cfg.save_pretrained(out_dir)
        tensors = _to_vlm_names(tensors)
        tensors.update(_visual_tensors(vlm_cfg, seed))
        if max_shard_size is None:
            max_shard_size = -(-sum(t.numel() * t.element_size() for t in tensors.values()) // 4)
    write_tensors(tensors, out_dir, max_shard_size)
    _write_tokenizer(out_dir)
    return out_dir


def _to_vlm_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Text-layout names -> released VLM names: `model.*` -> `model.language_model.*`."""
    return {
        (f"model.language_model.{k[len('model.') :]}" if k.startswith("model.") else k): v for k, v in tensors.items()
    }


def _visual_tensors(vlm_cfg, seed: int) -> dict[str, torch.Tensor]:
    """`model.visual.*`: a random tiny vision tower of the VLM's own class (ignored by nextn)."""
    name = {"qwen3_5": "Qwen3_5VisionModel", "qwen3_5_moe": "Qwen3_5MoeVisionModel"}[vlm_cfg.model_type]
    tower = getattr(transformers, name)._from_config(vlm_cfg.vision_config)
    randomize_(tower, seed + 3)
    return {f"model.visual.{k}": v.detach().clone() for k, v in tower.state_dict().items()}


def is_vlm_layout(model_dir: str | Path) -> bool:
    return "text_config" in json.loads((Path(model_dir) / "config.json").read_text())


# --------------------------------------------------------------------------------------------
# FP8 checkpoints: the publisher's block-wise layout (quant_method "fp8": e4m3 `*.weight` and a
# float32 `*.weight_scale_inv` per block) and llm-compressor's compressed-tensors FP8 W8A8 dynamic
# (e4m3 `*.weight` and a bf16 `*.weight_scale` [N, 1] per output channel); written from a
# checkpoint's weights by this file's own quantizer (rounded to nearest, scale = amax / 448).
# --------------------------------------------------------------------------------------------

FP8_LAYOUTS = ("block", "channel")
E4M3_MAX = 448.0
# weights the published FP8 checkpoints keep in bf16 besides lm_head: embeddings, norms, the GDN
# conv and its a/b gate projections, router gates, shared-expert gates
_FP8_KEPT = re.compile(
    r"(embed_tokens|norm|conv1d|in_proj_a|in_proj_b|in_proj_ba|mlp\.gate|shared_expert_gate)\.weight$"
)


def is_fp8_target(name: str, t: torch.Tensor, quantize_mtp: bool) -> bool:
    """Whether an FP8 checkpoint stores weight `name` in e4m3: the decoder layers' 2-D projection
    weights (experts per expert); `mtp.*` (fc and its layer) only if quantize_mtp."""
    if t.dim() != 2 or not name.endswith(".weight") or _FP8_KEPT.search(name):
        return False
    return quantize_mtp if name.startswith("mtp.") else ".layers." in name


def _fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scale [ceil(N/bn), ceil(K/bk)]), block by block."""
    bn, bk = block
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.ones(-(-w.shape[0] // bn), -(-w.shape[1] // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            amax = w[rows, cols].float().abs().max()
            if amax > 0:
                scale[i, j] = amax / E4M3_MAX
            q[rows, cols] = (w[rows, cols].float() / scale[i, j]).clamp(-E4M3_MAX, E4M3_MAX).to(q.dtype)
    return q, scale


def _fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], bf16 scale [N, 1]), row by row (the scale rounded to bf16 first)."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _fp8_config(layout: str, block: tuple[int, int]) -> dict:
    if layout == "block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": ["lm_head", "embed_tokens", "in_proj_a", "in_proj_b", "mlp.gate"],
        }
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": dict(fp8, strategy="channel", dynamic=False, observer="minmax"),
                "input_activations": dict(fp8, strategy="token", dynamic=True, observer=None),
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", "re:.*linear_attn.in_proj_[ab]$", "re:.*mlp.gate$", "re:.*shared_expert_gate$"],
        "kv_cache_scheme": None,
    }


@_one_thread
def fp8_checkpoint(
    src: str | Path, out_dir: str | Path, layout: str = "block", *, block=(128, 128), quantize_mtp: bool = False
) -> Path:
    """`src`'s weights in an FP8 layout ("block" | "channel", see above) in `out_dir`, experts per
    expert (as FP8 releases store them), one file; config.json gains the quantization_config, the
    other files are copied. block: weight_block_size of the block layout."""
    if layout not in FP8_LAYOUTS:
        raise ValueError(f"layout must be in {FP8_LAYOUTS}, got {layout!r}")
    cfg = _copy_besides_weights(Path(src), Path(out_dir))
    cfg["quantization_config"] = _fp8_config(layout, tuple(block))
    (Path(out_dir) / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = _to_fp8(split_experts(read_tensors(src)), cfg["quantization_config"], quantize_mtp)
    write_tensors(tensors, Path(out_dir), None)
    return Path(out_dir)


def _copy_besides_weights(src: Path, out_dir: Path) -> dict:
    """Copy a checkpoint's files but its weights (tokenizer, configs) into out_dir; its config.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, out_dir / f.name)
    return json.loads((src / "config.json").read_text())


def _to_fp8(tensors: dict[str, torch.Tensor], quant: dict, quantize_mtp: bool) -> dict[str, torch.Tensor]:
    """The FP8 targets among `tensors` quantized (with their scales) as `quant` (a
    quantization_config of _fp8_config) says; the rest unchanged."""
    out = {}
    for name, t in tensors.items():
        if not is_fp8_target(name, t, quantize_mtp):
            out[name] = t
        elif quant["quant_method"] == "fp8":
            out[name], out[name + "_scale_inv"] = _fp8_block(t, tuple(quant["weight_block_size"]))
        else:
            out[name], out[name + "_scale"] = _fp8_channel(t)
    return out


def fit_fp8_mtp_head(model_dir: str | Path, prompts: list[list[int]], work_dir: str | Path, *, quantize_mtp: bool):
    """fit_mtp_head for an FP8 checkpoint (whose greedy continuations differ from its bf16
    source's): the head is fitted on its dequantized model (which the transformers oracles load,
    in `work_dir`) and written back, in e4m3 if quantize_mtp. Returns the fit's accuracy."""
    model_dir = Path(model_dir)
    fitted = dequantized_checkpoint(model_dir, work_dir)
    accuracy = fit_mtp_head(fitted, prompts)
    quant = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    tensors = {k: v for k, v in read_tensors(model_dir).items() if not k.startswith("mtp.")}
    head = {k: v for k, v in split_experts(read_tensors(fitted)).items() if k.startswith("mtp.")}
    write_tensors({**tensors, **_to_fp8(head, quant, quantize_mtp)}, model_dir, None)
    return accuracy


@_one_thread
def dequantized_checkpoint(src: str | Path, out_dir: str | Path) -> Path:
    """An FP8 checkpoint's model in float32: each e4m3 weight times its scale (products in
    float32), the scales and the quantization_config dropped."""
    src, out_dir = Path(src), Path(out_dir)
    cfg = _copy_besides_weights(src, out_dir)
    quant = cfg.pop("quantization_config")
    tensors = read_tensors(src)
    out = {}
    for name, t in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t
        elif quant["quant_method"] == "fp8":
            bn, bk = quant["weight_block_size"]
            s = tensors[name + "_scale_inv"].float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            out[name] = t.float() * s[: t.shape[0], : t.shape[1]]
        else:
            out[name] = t.float() * tensors[name + "_scale"].float()
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tensors(out, out_dir, None)
    return out_dir


# --------------------------------------------------------------------------------------------
# transformers references (the oracles)
# --------------------------------------------------------------------------------------------


def load_hf_model(model_dir: str | Path):
    """The checkpoint's trunk as a transformers *ForCausalLM (float32, eager attention, eval),
    with `num_mtp_layers`/`mtp_layer_types` set so `MtpModel` can be built from it. The VLM layout
    loads through the text class (transformers maps `model.language_model.*` to `model.*`).
    Cached per directory and file modification times; treat the result as read-only."""
    path = Path(model_dir).resolve()
    stamp = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in path.iterdir()))
    return _load_hf_model(str(path), stamp)


# transformers swaps in flash-linear-attention's (and causal-conv1d's) kernels for these when the
# package is importable, whatever the device; the oracles run on the CPU in float32, so they take
# transformers' own torch code, which each wrapper keeps as __wrapped__
_HUB_KERNEL_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def _torch_only(model: torch.nn.Module) -> None:
    import importlib

    for module_name in {type(m).__module__ for m in model.modules()}:
        module = importlib.import_module(module_name)
        for name in _HUB_KERNEL_FUNCS:
            fn = getattr(module, name, None)
            if fn is not None and hasattr(fn, "__wrapped__"):
                setattr(module, name, fn.__wrapped__)


@functools.lru_cache(maxsize=8)
def _load_hf_model(model_dir: str, _stamp) -> torch.nn.Module:
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    if hasattr(cfg, "text_config"):
        kind = {"qwen3_5": "dense", "qwen3_5_moe": "moe"}[cfg.model_type]
        cls = getattr(transformers, _CLASSES[kind][1])
        model = cls.from_pretrained(model_dir, config=cfg.text_config, **kwargs)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.config.num_mtp_layers = 1
    model.config.mtp_layer_types = ["full_attention"]
    _torch_only(model)
    return model.eval().requires_grad_(False)


@_one_thread
@torch.no_grad()
def hf_logits(model_dir: str | Path, input_ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [T, V] (float32) of transformers' forward over `input_ids`, no cache."""
    model = load_hf_model(model_dir)
    return model(torch.tensor([input_ids]), use_cache=False).logits[0].float()


@_one_thread
@torch.no_grad()
def hf_greedy(model_dir: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation (generated ids only, EOS ignored): each token is the argmax of a fresh
    full-sequence forward over everything so far — the plainest definition, no cache involved."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids.append(int(hf_logits(model_dir, ids)[-1].argmax()))
    return ids[len(prompt_ids) :]


@_one_thread
@torch.no_grad()
def hf_hidden_states(model_dir: str | Path, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The trunk's last hidden states: (pre_norm [T, H] = output of the last decoder layer,
    post_norm [T, H] = after the final norm, what lm_head reads)."""
    model = load_hf_model(model_dir)
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda mod, args, out: seen.update(pre=args[0], post=out))
    try:
        model(torch.tensor([input_ids]), use_cache=False)
    finally:
        hook.remove()
    return seen["pre"][0].float(), seen["post"][0].float()


def load_hf_mtp(model_dir: str | Path):
    """transformers' `MtpModel` for the checkpoint's `mtp.*` tensors (cached like load_hf_model)."""
    from transformers.modeling_layers import MtpModel

    main = load_hf_model(model_dir)
    if getattr(main, "_fixture_mtp", None) is None:
        # MtpModel's key regex also picks up a VLM's model.visual.* and reports them as unexpected
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            # kept outside the module tree so the main model's state_dict stays the trunk's
            main.__dict__["_fixture_mtp"] = MtpModel.from_pretrained(main).eval()
        finally:
            transformers.logging.set_verbosity(verbosity)
    return main._fixture_mtp


@_one_thread
@torch.no_grad()
def hf_mtp_logits(model_dir: str | Path, input_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """Logits [T-1, V] of the checkpoint's MTP head via transformers' `MtpModel`.

    Row t (0 <= t < T-1) consumes the embedding of input_ids[t+1] and hidden[t] at position t+1
    (RoPE), attends causally over rows 0..t (a fresh MTP KV cache holding positions 1..T-1), and
    predicts input_ids[t+2]: fc(cat(norm_e(embed), norm_h(hidden))) -> decoder layer -> mtp.norm
    -> the trunk's lm_head. `hidden` is whatever the caller passes, [T, H] (last row unused) or
    [T-1, H]: e.g. hf_hidden_states' post_norm (the default convention) or pre_norm.
    """
    mtp = load_hf_mtp(model_dir)
    num_rows = len(input_ids) - 1
    position_ids = torch.arange(1, num_rows + 1)[None]
    out = mtp.forward_layer(
        0, hidden[None, :num_rows].float(), position_ids, None, input_ids=torch.tensor([input_ids[1:]])
    )
    return mtp._project_to_logits(out)[0].float()


class MtpReference(torch.nn.Module):
    """The MTP head in plain torch, built from raw `mtp.*` tensors (names without the `mtp.`
    prefix, experts fused): transformers' decoder-layer and RMSNorm classes, an explicit causal
    mask, no MtpModel and no weight-renaming machinery. Shares the trunk's embedding, rotary
    embedding and lm_head (not registered as submodules, so state_dict() is the `mtp.*` set)."""

    def __init__(self, model, tensors: dict[str, torch.Tensor]):
        super().__init__()
        cfg = copy.deepcopy(model.config)
        cfg.layer_types, cfg.num_hidden_layers = ["full_attention"], 1
        norm_cls, hidden = type(model.model.norm), cfg.hidden_size
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = torch.nn.ModuleList([type(model.model.layers[-1])(cfg, 0)])
        self.norm = norm_cls(hidden, eps=cfg.rms_norm_eps)
        self.load_state_dict(tensors, strict=True)
        self._trunk = (model,)  # a tuple keeps the trunk out of parameters() and state_dict()

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T], hidden [B, T, H] -> logits [B, T-1, V]; row t reads token t+1 and
        hidden row t at position t+1, attends to rows 0..t, and predicts token t+2."""
        (model,) = self._trunk
        num_rows = input_ids.shape[1] - 1
        embeds = model.get_input_embeddings()(input_ids[:, 1:])
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden[:, :num_rows])], -1)
        x = self.fc(x)
        position_ids = torch.arange(1, num_rows + 1).expand(input_ids.shape[0], -1)
        try:
            cos_sin = model.model.rotary_emb(x, position_ids)
        except IndexError:  # transformers versions whose Qwen3.5 rotary takes [3, B, T] text positions
            cos_sin = model.model.rotary_emb(x, position_ids[None].expand(3, -1, -1))
        mask = torch.full((num_rows, num_rows), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=cos_sin, attention_mask=mask, position_ids=position_ids)
        x = x[0] if isinstance(x, tuple) else x
        return model.lm_head(self.norm(x))


def _mtp_reference(model_dir: str | Path) -> MtpReference:
    raw = {k[len("mtp.") :]: v for k, v in read_tensors(model_dir).items() if k.startswith("mtp.")}
    return MtpReference(load_hf_model(model_dir), fuse_experts(raw)).eval()


@_one_thread
@torch.no_grad()
def torch_mtp_logits(model_dir: str | Path, input_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The same function as hf_mtp_logits, computed by MtpReference: a cross-check of how
    MtpModel is driven and of the `mtp.*` name mapping."""
    return _mtp_reference(model_dir)(torch.tensor([input_ids]), hidden[None].float())[0].float()


# --------------------------------------------------------------------------------------------
# An MTP head that agrees with the trunk on chosen prompts
# --------------------------------------------------------------------------------------------

# prompts the conftest's *_fitted_ckpt heads are fitted on (a chat turn, code, random ids)
FIT_PROMPTS = (
    [346, 84, 82, 262, 198, 39, 264, 75, 78, 11, 278, 308, 75, 67, 0, 347, 198, 346],
    [321, 276, 341, 282, 334, 325, 281, 261, 316, 324, 259],
    [100, 40, 7, 250, 8, 61],
)


@_one_thread
def fit_mtp_head(
    model_dir: str | Path, prompts: list[list[int]], *, num_new_tokens: int = 32, seed: int = 0, max_steps: int = 400
) -> float:
    """Train the checkpoint's `mtp.*` tensors in place so the head predicts the trunk's greedy
    choices on `prompts` and their greedy continuations (post-norm hidden, the default
    convention); returns the fraction of those rows it gets right (1.0 once memorised).

    A random head agrees with the trunk about 1/V of the time, so speculative decoding never
    accepts a draft. A fitted head accepts the first draft of most rounds on these sequences (and
    only on them: a tiny random trunk is not learnable from a few sequences, and chained drafts,
    which feed the head its own output, stay mostly wrong): exactly the mix of accepted and
    rejected drafts that exercises acceptance and rollback. Layout, shards and expert format kept.
    """
    seqs = [list(p) + hf_greedy(model_dir, p, num_new_tokens) for p in prompts]
    data = []
    for ids in seqs:
        _, post = hf_hidden_states(model_dir, ids)
        targets = hf_logits(model_dir, ids).argmax(-1)[1:]  # row t predicts the trunk's pick at t+1
        data.append((torch.tensor([ids]), post[None], targets))
    head = _mtp_reference(model_dir).train()
    torch.manual_seed(seed)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for step in range(max_steps + 1):
        logits = [head(ids, post)[0] for ids, post, _ in data]
        loss = sum(torch.nn.functional.cross_entropy(lg, t) for lg, (_, _, t) in zip(logits, data, strict=True))
        correct = sum(int((lg.argmax(-1) == t).sum()) for lg, (_, _, t) in zip(logits, data, strict=True))
        accuracy = correct / sum(len(t) for _, _, t in data)
        if accuracy == 1.0 or step == max_steps:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    _replace_mtp_tensors(Path(model_dir), {f"mtp.{k}": v.detach() for k, v in head.state_dict().items()})
    return accuracy


def _replace_mtp_tensors(model_dir: Path, fused: dict[str, torch.Tensor]) -> None:
    """Overwrite the `mtp.*` tensors in whichever files hold them, in the checkpoint's expert format."""
    new = split_experts(fused) if has_per_expert_tensors(read_tensors(model_dir)) else fused
    written = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        mine = {k for k in tensors if k.startswith("mtp.")}
        if mine:
            tensors.update({k: new[k] for k in mine})
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
            written |= mine
    if written != new.keys():
        raise RuntimeError(f"{model_dir}: mtp tensors on disk differ from the head's: {sorted(written ^ new.keys())}")


def tiny_preset(vocab_size: int = 8192) -> dict:
    """A random-weights preset of the 9B's kind at test scale (nextn.models.random_weights.PRESETS)."""
    from nextn.models import random_weights

    return dict(
        random_weights.PRESETS["qwen3.5-9b"],
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=2048,
    )
