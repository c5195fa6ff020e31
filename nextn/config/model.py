"""The checkpoint's model: its hyperparameters (ModelConfig.from_hf reads config.json and
generation_config.json) and how it stores FP8 weights (QuantConfig). Validation happens here, once;
nothing else reads a checkpoint's config files. Knows nothing of how the engine runs the model
(nextn.config: EngineConfig, SpecConfig).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from nextn.config import FULL, LINEAR

# model_type -> family. The VLM wrappers keep their text keys under `text_config`.
_FAMILIES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}


class ConfigError(ValueError):
    """A checkpoint's config.json cannot describe a model nextn runs."""


_LOADABLE = "nextn loads FP8 checkpoints: quant_method 'fp8' (block-wise e4m3) or 'compressed-tensors' FP8"


@dataclass(frozen=True)
class QuantConfig:
    """FP8 weights (e4m3 with float32 scales, nextn.ops.fp8): how a checkpoint stores them (its
    config.json `quantization_config`), or `quantization="fp8"` applied at load (`at_load`); method
    "q8_0": GGUF's Q8_0 (nextn.ops.q8_0), made at load (weight_block_size (1, 32)).

    method "fp8": the publisher's block-wise layout, a `*.weight_scale_inv` per weight_block_size
    block (rows x 128 columns); "compressed-tensors": llm-compressor's FP8, a `*.weight_scale` per
    output channel (or per tensor). Either way activations stay in the model's dtype: the weights
    are dequantized (the reference path) or read by the step kernels, never the activations
    quantized ("dynamic" activation schemes only, which then cost nothing).
    """

    method: str
    weight_block_size: tuple[int, int] | None = None  # method "fp8": (rows, columns) per scale
    at_load: bool = False

    @property
    def scale_suffix(self) -> str:
        """The checkpoint's name of a weight's scale tensor, beside `weight`."""
        return "weight_scale_inv" if self.method == "fp8" else "weight_scale"

    @classmethod
    def from_hf(cls, raw: dict) -> QuantConfig:
        """config.json's `quantization_config`, validated: an error names what nextn does not load."""
        if not isinstance(raw, dict):
            raise ConfigError(f"quantization_config must be a JSON object, got {raw!r}")
        method = raw.get("quant_method")
        if method == "fp8":
            return cls._block_wise(raw)
        if method == "compressed-tensors":
            return cls._compressed_tensors(raw)
        raise ConfigError(
            f"quantization method {method!r} (config.json quantization_config) is not supported; {_LOADABLE}"
        )

    @classmethod
    def _block_wise(cls, raw: dict) -> QuantConfig:
        if raw.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"quant_method 'fp8' with fmt {raw['fmt']!r} is not supported; nextn reads e4m3")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(
                f"quant_method 'fp8' with activation_scheme {raw['activation_scheme']!r} (static activation "
                "scales) is not supported; nextn loads activation_scheme 'dynamic'"
            )
        block = raw.get("weight_block_size")
        if block is None:
            raise ConfigError("quant_method 'fp8' without weight_block_size (per-tensor scales) is not supported")
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) for b in block)):
            raise ConfigError(f"quant_method 'fp8': weight_block_size must be two integers, got {block!r}")
        if block[0] < 1 or block[1] != 128:
            raise ConfigError(
                f"quant_method 'fp8' with weight_block_size {list(block)}: nextn reads blocks of 128 columns"
            )
        return cls("fp8", (block[0], block[1]))

    @classmethod
    def _compressed_tensors(cls, raw: dict) -> QuantConfig:
        what = "compressed-tensors"
        if raw.get("format") not in ("float-quantized", "naive-quantized"):
            raise ConfigError(f"{what} format {raw.get('format')!r} is not supported; {_LOADABLE}")
        if raw.get("kv_cache_scheme"):
            raise ConfigError(f"{what} kv_cache_scheme (a quantized KV cache) is not supported")
        groups = raw.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ConfigError(f"{what} quantization_config has no config_groups")
        for name, group in groups.items():
            w = group.get("weights") or {}
            if (w.get("num_bits"), w.get("type")) != (8, "float"):
                raise ConfigError(
                    f"{what} group {name!r}: {w.get('num_bits')}-bit {w.get('type')} weights are not supported; "
                    f"{_LOADABLE}"
                )
            if w.get("strategy") not in ("channel", "tensor") or w.get("dynamic"):
                raise ConfigError(
                    f"{what} group {name!r}: weight strategy {w.get('strategy')!r} is not supported "
                    "(nextn reads per-channel or per-tensor FP8 scales)"
                )
            act = group.get("input_activations")
            if act and not act.get("dynamic"):
                raise ConfigError(
                    f"{what} group {name!r}: static input activation scales are not supported "
                    "(nextn loads FP8 W8A8 dynamic, or weight-only FP8)"
                )
        return cls("compressed-tensors")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "qwen3_5" | "qwen3_5_moe" | "qwen3_next"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    attention_bias: bool
    max_position_embeddings: int
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # FFN: dense size, and MoE sizes (num_experts == 0 for dense models)
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    # number of MTP layers the config declares (Qwen3-Next declares none: the loader detects them)
    mtp_num_hidden_layers: int = 0
    # where the trunk's weights live in the checkpoint
    weight_prefix: str = "model."
    # the checkpoint's own dtype (config.json `dtype` / `torch_dtype`), what dtype "auto" picks on CUDA
    dtype: str | None = None
    # FP8 weights: the checkpoint's quantization_config, or quantization="fp8" at load
    quantization: QuantConfig | None = None
    # tensor parallelism (nextn.parallel): with tp_size > 1 this is rank tp_rank's share of the model
    # (`shard`): the attention and GDN head counts and the FFN sizes above are the rank's; vocab_size
    # stays the whole vocabulary (the embedding and lm_head hold ceil(V / tp_size) rows each)
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        if bad:
            raise ConfigError(f"unknown layer_types {bad}; expected {LINEAR!r} or {FULL!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and <= head_dim")

    def shard(self, rank: int, size: int) -> ModelConfig:
        """Rank `rank`'s share of this model under tensor parallelism over `size` ranks: its heads
        and FFN columns (nextn.parallel.shard). An error names the first count size does not divide."""
        if self.tp_size != 1:
            raise ValueError("this config is already one rank's share")
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of tensor_parallel_size {size}")
        if size == 1:
            return self
        if self.quantization is not None:
            raise ConfigError(
                f"tensor parallelism does not shard quantized ({self.quantization.method}) weights yet; "
                "load the bf16 checkpoint without quantization"
            )
        if self.attention_bias:
            raise ConfigError("tensor parallelism does not shard attention biases")
        counts = {
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
        }
        for name, n in counts.items():
            if n % size:
                raise ConfigError(f"tensor_parallel_size {size} does not divide {name} {n}")
        return replace(self, **{k: n // size for k, n in counts.items()}, tp_rank=rank, tp_size=size)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has a sparse MoE FFN (the MTP layer uses the trunk's kind)."""
        if self.num_experts == 0 or layer_idx in self.mlp_only_layers:
            return False
        return (layer_idx + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json")
        return cls.from_dict(_read_json(path), generation_config=read_generation_config(Path(model_dir)))

    @classmethod
    def from_dict(cls, raw: dict, generation_config: dict | None = None) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in _FAMILIES:
            raise ConfigError(f"unsupported model_type {model_type!r}; nextn runs {sorted(_FAMILIES)}")
        family = _FAMILIES[model_type]
        text = raw.get("text_config") or raw
        wrapped = "text_config" in raw
        prefix = "model.language_model." if wrapped else "model."

        def need(key):  # a size or count the model cannot do without: a positive integer
            if key not in text:
                raise ConfigError(f"config.json lacks {key!r}")
            value = text[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config.json's {key!r} must be a positive integer, got {value!r}")
            return value

        n_layers = need("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        num_heads = need("num_attention_heads")
        head_dim = text.get("head_dim") or need("hidden_size") // num_heads
        eos = _eos_ids(text.get("eos_token_id", raw.get("eos_token_id")))
        if generation_config:
            eos = tuple(dict.fromkeys(eos + _eos_ids(generation_config.get("eos_token_id"))))
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        quant = raw.get("quantization_config", text.get("quantization_config"))
        return cls(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            num_attention_heads=num_heads,
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            attention_bias=bool(text.get("attention_bias", False)),
            max_position_embeddings=text.get("max_position_embeddings", 32768),
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            intermediate_size=text.get("intermediate_size", 0),
            num_experts=text.get("num_experts", 0) if family != "qwen3_5" else 0,
            num_experts_per_tok=text.get("num_experts_per_tok", 0),
            moe_intermediate_size=text.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=text.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            tie_word_embeddings=bool(tie),
            eos_token_ids=eos,
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            weight_prefix=prefix,
            dtype=raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype"),
            quantization=None if quant is None else QuantConfig.from_hf(quant),
        )


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def read_generation_config(model_dir: Path) -> dict | None:
    """The checkpoint's generation_config.json (eos ids, the publisher's sampling defaults), if any."""
    path = model_dir / "generation_config.json"
    return _read_json(path) if path.is_file() else None
