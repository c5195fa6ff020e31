"""A GGUF file (llama.cpp's format) of architecture `qwen35`, `qwen35moe` or `qwen3next` -> the
ModelConfig and CausalLM its Hugging Face checkpoint gives, read with the `gguf` package
(llama.cpp's own reader).

Owns: the hyperparameters from the file's `{arch}.*` metadata (`gguf_config`), the map from
llama.cpp's tensor names back to the checkpoint's (`token_embd` -> `model.embed_tokens`,
`blk.N.attn_qkv` -> `...linear_attn.in_proj_qkv`, the NextN block `blk.{n_layers}.nextn.*` ->
`mtp.*`), and the inverse of every change llama.cpp's convert_hf_to_gguf.py makes to a tensor as it
writes it (listed at `_inverse`, each with its source there), by hand because the file holds
llama.cpp's layout and nothing else undoes it. Weight types: F32, F16 and BF16 load as they are;
Q8_0 stays quantized where nextn has its kernel (nextn.ops.q8_0), other quantized types
(Q4_K, Q6_K, IQ*, ...) are dequantized at load by gguf's own dequantizer, said in one log line; a
type gguf cannot dequantize is a one-line error naming it.

Does not read the tokenizer (nextn.gguf_tokenizer does), find the file (nextn.hub does) or build
the model: nextn.models.loader.load_gguf asks this module for the plan and each module tensor and
assembles the model as it does a safetensors checkpoint's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from nextn.config import FULL, LINEAR
from nextn.config.model import ConfigError, ModelConfig
from nextn.gguf_file import GGUFFileError, gguf_reader
from nextn.models.checkpoint import CheckpointError, regroup_next

log = logging.getLogger(__name__)

# llama.cpp's architecture name (general.architecture; gguf-py constants.py MODEL_ARCH_NAMES) -> family
ARCHS = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next"}
# general.file_type (llama.cpp's LlamaFileType) -> the dtype "auto" picks on CUDA
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
_REQUIRED = object()


class GGUFError(CheckpointError):
    """A GGUF file nextn cannot read as a Qwen3.5 / Qwen3-Next model."""


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def open_gguf(path: str | Path):
    """gguf's reader over the file, parsed once a process (nextn.gguf_file: the tokenizer reads the
    same one); a file gguf cannot read is a GGUFError."""
    try:
        return gguf_reader(path)
    except GGUFFileError as e:
        raise GGUFError(str(e)) from None


def _value(reader, key: str, default=_REQUIRED):
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise GGUFError(f"GGUF metadata lacks {key!r}")
        return default
    value = field.contents()
    if isinstance(value, list):  # a per-layer count (head_count_kv of some files): its layers' one value
        values = {v for v in value if v}
        if len(values) != 1:
            raise GGUFError(f"GGUF metadata {key!r} varies by layer ({sorted(values)}); nextn runs one value")
        value = values.pop()
    return value


def gguf_config(source) -> ModelConfig:
    """The ModelConfig of a GGUF file (a path or an open reader), as its config.json would give it.

    Keys are those llama.cpp's converter writes (convert_hf_to_gguf.py: TextModel.set_gguf_parameters,
    Qwen2MoeModel's expert sizes, Qwen3NextModel's ssm_* and full_attention_interval). Its block_count
    counts the NextN layers too (_Qwen35MtpMixin): the trunk is block_count - nextn_predict_layers.
    Which layers are attention, which MoE, and whether the head is tied are read off the tensors."""
    reader = open_gguf(source) if isinstance(source, str | Path) else source
    arch = _value(reader, "general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; nextn runs {sorted(ARCHS)}")
    shapes = tensor_shapes(reader)

    def get(key: str, default=_REQUIRED):
        return _value(reader, f"{arch}.{key}", default)

    n_layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    num_v_heads = int(get("ssm.time_step_rank"))
    num_experts = int(get("expert_count", 0)) if arch != "qwen35" else 0
    if "token_embd.weight" not in shapes:
        raise GGUFError("GGUF file has no token_embd.weight")
    layer_types = tuple(LINEAR if f"blk.{i}.ssm_a" in shapes else FULL for i in range(n_layers))
    first_full = layer_types.index(FULL) if FULL in layer_types else 0
    eos = _eog_ids(reader)
    try:
        return ModelConfig(
            family=ARCHS[arch],
            vocab_size=shapes["token_embd.weight"][0],
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            rms_norm_eps=_float32(get("attention.layer_norm_rms_epsilon", 1e-6)),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=_float32(get("rope.freq_base", 10000.0)),
            partial_rotary_factor=int(get("rope.dimension_count", head_dim)) / head_dim,
            attention_bias=f"blk.{first_full}.attn_q.bias" in shapes,
            max_position_embeddings=int(get("context_length", 32768)),
            linear_num_key_heads=int(get("ssm.group_count")),
            linear_num_value_heads=num_v_heads,
            linear_key_head_dim=int(get("ssm.state_size")),
            linear_value_head_dim=int(get("ssm.inner_size")) // num_v_heads,
            linear_conv_kernel_dim=int(get("ssm.conv_kernel", 4)),
            intermediate_size=int(get("feed_forward_length", 0)),
            num_experts=num_experts,
            num_experts_per_tok=int(get("expert_used_count", 0)) if num_experts else 0,
            moe_intermediate_size=int(get("expert_feed_forward_length", 0)) if num_experts else 0,
            shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)) if num_experts else 0,
            norm_topk_prob=bool(get("expert_weights_norm", True)),
            mlp_only_layers=tuple(
                i for i in range(n_layers) if num_experts and f"blk.{i}.ffn_gate_inp.weight" not in shapes
            ),
            tie_word_embeddings="output.weight" not in shapes,
            eos_token_ids=eos,
            mtp_num_hidden_layers=int(get("nextn_predict_layers", 0)),
            dtype=_FILE_DTYPES.get(int(_value(reader, "general.file_type", -1)), "bfloat16"),
        )
    except ConfigError as e:
        raise GGUFError(f"GGUF metadata: {e}") from None


# llama.cpp's end-of-generation tokens by text (src/llama-vocab.cpp, the special_eog_ids it adds):
# the ones of this family's vocabularies
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


def _eog_ids(reader) -> tuple[int, ...]:
    """The tokens that end a reply: tokenizer.ggml's eos (eot, eom) ids, then the vocabulary's
    end-of-turn tokens by text, as llama.cpp takes them (Qwen's <|im_end|> and <|endoftext|>: what
    config.json's and generation_config.json's eos_token_id list together)."""
    ids = [
        int(v)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (v := _value(reader, f"tokenizer.ggml.{key}", None)) is not None
    ]
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is not None:
        ids += [i for i, text in enumerate(field.contents()) if text in _EOG_TEXTS]
    return tuple(dict.fromkeys(ids))


def tensor_shapes(reader) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in PyTorch's order (GGUF lists a tensor's dims reversed, ggml's `ne`)."""
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


# --------------------------------------------------------------------------------------------
# Names: module key -> the GGUF tensors it is made of (llama.cpp: gguf-py tensor_mapping.py,
# constants.py TENSOR_NAMES; the NextN block: convert_hf_to_gguf.py _Qwen35MtpMixin, which writes
# `mtp.layers.0.*` as block n_layers and `mtp.{fc, pre_fc_norm_*, norm}` as its `nextn.*`)
# --------------------------------------------------------------------------------------------

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_NEXTN = {
    "mtp.fc.weight": "nextn.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "mtp.norm.weight": "nextn.shared_head_norm.weight",
}
_BLOCK = re.compile(r"^(?:model\.layers\.(\d+)|mtp\.layers\.0)\.(.+)$")


def sources(key: str, cfg: ModelConfig, shapes: dict) -> list[str]:
    """The GGUF tensors module key `key` is made of (in the order they are joined)."""
    if key in _TOP:
        return [_TOP[key]]
    n = cfg.num_hidden_layers
    if key in _NEXTN:
        return [f"blk.{n}.{_NEXTN[key]}"]
    m = _BLOCK.match(key)
    if m is None:
        raise GGUFError(f"nextn's tensor {key} has no GGUF name")
    block, rest = (int(m[1]) if m[1] is not None else n), m[2]
    pre = f"blk.{block}."
    if rest == "mlp.experts.gate_up_proj":  # one packed tensor, or gate and up apart (convert splits them)
        fused = pre + "ffn_gate_up_exps.weight"
        return [fused] if fused in shapes else [pre + "ffn_gate_exps.weight", pre + "ffn_up_exps.weight"]
    if rest == "linear_attn.in_proj_qkvz.weight":  # Qwen3NextModel.modify_tensors splits it in two
        return [pre + "attn_qkv.weight", pre + "attn_gate.weight"]
    stem, dot, suffix = rest.rpartition(".")
    if rest in _LAYER:
        return [pre + _LAYER[rest]]
    if stem in _LAYER:  # attention weights and biases
        return [pre + _LAYER[stem] + dot + suffix]
    raise GGUFError(f"nextn's tensor {key} has no GGUF name")


# --------------------------------------------------------------------------------------------
# Transforms: the inverse of what convert_hf_to_gguf.py does to a tensor
# --------------------------------------------------------------------------------------------


def _float32(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _swap_heads(t: torch.Tensor, dim: int, a: int, b: int, head_dim: int) -> torch.Tensor:
    """Along `dim` (a * b * head_dim long), blocks of head_dim ordered [a, b] -> ordered [b, a]."""
    dim %= t.dim()
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], a, b, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


Inverse = Callable[..., torch.Tensor]


def _inverse(key: str, cfg: ModelConfig, arch: str) -> tuple[Inverse, Inverse | None]:
    """(the function that turns the GGUF tensor(s), joined, back into the checkpoint's; the one that
    does it to Q8_0 bytes uint8 [..., N, K / 32 * 34], or None where the change is not a move of
    whole rows or whole 32-column blocks: a row move is the same function, a block move permutes
    the blocks).

    The changes convert_hf_to_gguf.py makes, undone here:
    - Qwen3NextModel.modify_tensors (Qwen3.5 inherits it through _LinearAttentionVReorderBase):
      `A_log` -> -exp(A_log) (undone: log(-a)); `conv1d.weight` [D, 1, W] squeezed to [D, W];
      `dt_bias` renamed `dt_proj.bias` (ssm_dt.bias); every `*norm.weight` but `linear_attn.norm`
      stored +1 (ggml's RMSNorm multiplies by w, the checkpoint's by 1 + w; undone: -1); Qwen3-Next's
      `in_proj_qkvz` (rows [q k v z] per key head) split into attn_qkv (rows [q all | k all | v all])
      and attn_gate (z all): nextn's own row order for in_proj_qkvz (nextn.models.loader.regroup_next),
      so the two are joined as they are; `in_proj_ba` kept as in the checkpoint (ssm_ba).
    - _LinearAttentionVReorderBase.modify_tensors (qwen35 / qwen35moe, num_v_heads != num_k_heads):
      V heads reordered from grouped by key head [k0: v0..v(r-1), k1: ...] to tiled
      [v0 of every k, v1 of every k, ...] in the rows of in_proj_qkv's V part, in_proj_z,
      in_proj_a and in_proj_b, in A_log and dt_bias, in conv1d's V channels and in out_proj's
      columns (undone by the reverse swap).
    - ModelBase.prepare_tensors: every tensor squeezed (shared_expert_gate [1, H] -> [H]; undone by
      the reshape to the module's shape after this), norms and 1-D tensors in F32.
    - Qwen2MoeModel.modify_tensors: experts stacked [E, ...] and gate_up_proj split into
      ffn_gate_exps and ffn_up_exps (joined again along the rows).
    """
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    r, dk, dv = nv // max(1, nk), cfg.linear_key_head_dim, cfg.linear_value_head_dim
    untile = arch in ("qwen35", "qwen35moe") and nk != nv and ".linear_attn." in key

    def heads(t, dim, head_dim):  # tiled -> grouped V heads (_reorder_v_heads with its two counts swapped)
        return _swap_heads(t, dim, r, nk, head_dim) if untile else t

    if key.endswith(("gate_up_proj", "linear_attn.in_proj_qkvz.weight")):
        join = lambda *ts: torch.cat(ts, dim=-2)  # noqa: E731
        return join, join
    if key.endswith("linear_attn.in_proj_ba.weight"):  # the checkpoint's rows, regrouped as the loader does
        regroup = lambda t: regroup_next(key, t, cfg)  # noqa: E731
        return regroup, regroup
    if (key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight")) or key.startswith(
        "mtp.pre_fc_norm_"
    ):  # the RMSNorms stored around 0 (the NextN block's enorm and hnorm too: _Qwen35MtpMixin renames them *norm)
        return (lambda t: t.float() - 1), None
    if key.endswith("linear_attn.in_proj_qkv.weight"):
        q = 2 * nk * dk
        qkv = lambda t: torch.cat([t[:q], heads(t[q:], 0, dv)])  # noqa: E731
        return qkv, qkv
    if key.endswith("linear_attn.in_proj_z.weight"):
        z = lambda t: heads(t, 0, dv)  # noqa: E731
        return z, z
    if key.endswith(("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight")):
        ab = lambda t: heads(t, 0, 1)  # noqa: E731
        return ab, ab
    if key.endswith("linear_attn.A_log"):
        return (lambda t: heads(torch.log(-t.float()), 0, 1)), None
    if key.endswith("linear_attn.dt_bias"):
        return (lambda t: heads(t, 0, 1)), None
    if key.endswith("linear_attn.conv1d.weight"):
        q = 2 * nk * dk
        return (lambda t: torch.cat([t[:q], heads(t[q:], 0, dv)]).unsqueeze(1)), None
    if key.endswith("linear_attn.out_proj.weight"):  # V heads in the columns: whole blocks when dv % 32 == 0
        if not untile:
            return (lambda t: t), (lambda t: t)
        return (lambda t: heads(t, 1, dv)), (_column_blocks(lambda b: heads(b, 1, dv // 32)) if dv % 32 == 0 else None)
    return (lambda t: t), (lambda t: t)


def _column_blocks(move: Callable[[torch.Tensor], torch.Tensor]) -> Inverse:
    """A move of whole 32-column blocks (`move` of a tensor [..., N, K / 32, 34] along dim 1) as a
    function of Q8_0 bytes [..., N, K / 32 * 34]."""

    def on_bytes(raw: torch.Tensor) -> torch.Tensor:
        *lead, n, row_bytes = raw.shape
        return move(raw.reshape(*lead, n, row_bytes // 34, 34)).reshape(raw.shape)

    return on_bytes


# --------------------------------------------------------------------------------------------
# Tensor data
# --------------------------------------------------------------------------------------------


def _float(tensor) -> torch.Tensor:
    """A GGUF tensor's values in PyTorch's dim order: F32 / F16 as stored, BF16 reinterpreted,
    anything else dequantized by gguf (float32)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    data = tensor.data
    if tensor.tensor_type in (T.F32, T.F16):
        return torch.from_numpy(np.array(data))  # a copy: the reader maps the file read-only
    if tensor.tensor_type == T.BF16:
        raw = np.array(data).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16)
    try:
        return torch.from_numpy(dequantize(data, tensor.tensor_type))
    except NotImplementedError:
        raise GGUFError(
            f"tensor {tensor.name} is {tensor.tensor_type.name}, which gguf {_gguf_version()} cannot dequantize"
        ) from None


def _check_types(tensors) -> None:
    """Every tensor's type is one gguf dequantizes (or F32 / F16 / BF16), checked before any is read."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    for t in tensors:
        if t.tensor_type in (T.F32, T.F16, T.BF16):
            continue
        block_bytes = GGML_QUANT_SIZES.get(t.tensor_type, (0, 0))[1]
        try:
            dequantize(np.zeros((1, block_bytes), dtype=np.uint8), t.tensor_type)
        except (NotImplementedError, ValueError):
            raise GGUFError(
                f"tensor {t.name} is {t.tensor_type.name}, which gguf {_gguf_version()} cannot dequantize; "
                "nextn loads F32, F16, BF16, Q8_0 and the types gguf dequantizes"
            ) from None


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


# --------------------------------------------------------------------------------------------
# What the loader (nextn.models.loader.load_gguf) asks of a file
# --------------------------------------------------------------------------------------------


def plan_tensors(reader, cfg: ModelConfig, expected) -> dict[str, list[str]]:
    """Each module tensor (`expected`: the model's keys) -> the GGUF tensors it is made of; a file
    tensor no module takes, or one a module needs and the file lacks, is an error naming it; every
    tensor's type is checked readable before any is read."""
    shapes = tensor_shapes(reader)
    plan = {key: sources(key, cfg, shapes) for key in expected}
    used = {name for names in plan.values() for name in names}
    unknown = sorted(set(shapes) - used)
    if unknown:
        raise GGUFError(f"unknown tensor(s) in the GGUF file: {unknown[:8]}")
    missing = sorted(used - set(shapes))
    if missing:
        raise GGUFError(f"missing tensor(s) in the GGUF file: {missing[:8]}")
    _check_types(reader.tensors)
    return plan


def is_q8_0(reader, key: str, names: list[str], cfg: ModelConfig) -> bool:
    """Whether module tensor `key` can stay Q8_0: every GGUF tensor it is made of is Q8_0, and the
    converter moved whole rows or whole 32-column blocks only (so its blocks, moved back, are
    nextn.ops.q8_0's)."""
    from gguf import GGMLQuantizationType as T

    types = {t.name: t.tensor_type for t in reader.tensors}
    arch = _value(reader, "general.architecture")
    return all(types[n] == T.Q8_0 for n in names) and _inverse(key, cfg, arch)[1] is not None


def module_tensor(reader, key: str, names: list[str], cfg: ModelConfig, blocks: bool = False) -> torch.Tensor:
    """Module tensor `key` from its GGUF tensors, the converter's changes undone: float values
    (F32 / F16 / BF16 as stored, other types dequantized), or with `blocks` (is_q8_0) the Q8_0
    bytes uint8 [..., N, K / 32 * 34] with their rows (or whole blocks) moved back."""
    by_name = {t.name: t for t in reader.tensors if t.name in names}
    fn, on_blocks = _inverse(key, cfg, _value(reader, "general.architecture"))
    if blocks:
        return on_blocks(*(torch.from_numpy(np.array(by_name[n].data)) for n in names))
    return fn(*(_float(by_name[n]) for n in names))


def log_types(reader, kept: int) -> None:
    """One line naming the quantized types the file holds and what becomes of them (`kept`: the Q8_0
    tensors that stay Q8_0); nothing when every tensor is F32, F16 or BF16."""
    from gguf import GGMLQuantizationType as T

    counts: dict[str, int] = {}
    for t in reader.tensors:
        if t.tensor_type not in (T.F32, T.F16, T.BF16):
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    if counts.get("Q8_0", 0) > kept:
        counts["Q8_0"] -= kept
    else:
        counts.pop("Q8_0", None)
    parts = [f"{kept} Q8_0 tensors kept in Q8_0"] if kept else []
    if counts:
        listed = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
        parts.append(f"{listed} dequantized at load to the model's dtype (gguf.quants)")
    if parts:
        log.warning("GGUF weights: %s", "; ".join(parts))
