"""Released Qwen3.5 text shapes (`PRESETS`) as models with random weights drawn on the device, for
benchmarks and tests of shapes no checkpoint here holds (`nextn bench`, and `LLM(random_weights=...)`
behind generate and serve), and the weight bytes a decoded token reads (the roofline's numerator).
Does not time anything (nextn.bench_measure does).
"""

from __future__ import annotations

import math

import torch

from nextn.cache.pool import GiB, available_bytes
from nextn.config import check_quantization
from nextn.model_config import ModelConfig
from nextn.models.loader import DTYPES, fuse_weights, quantize_model
from nextn.models.qwen3_5 import CausalLM
from nextn.ops.fp8 import compact
from nextn.parallel.shard import shard_tensor

_COMMON = dict(
    vocab_size=248320,
    num_attention_heads=16,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    rope_parameters={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
    mtp_num_hidden_layers=1,
    eos_token_id=248046,
)
# the released text configs (transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults)
PRESETS = {
    "qwen3.5-9b": dict(
        _COMMON,
        model_type="qwen3_5_text",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_key_value_heads=4,
    ),
    "qwen3.5-27b": dict(
        _COMMON,
        model_type="qwen3_5_text",
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_value_heads=48,
    ),
    "qwen3.5-35b-a3b": dict(
        _COMMON,
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        num_hidden_layers=40,
        num_key_value_heads=2,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
}


def preset_config(preset: str) -> ModelConfig:
    """A preset's model config (no weight made); an unknown name is a ValueError listing the presets."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[preset])


@torch.no_grad()
def random_model(
    preset: str, device: str, dtype: str, seed: int = 0, quantization: str | None = None, tp: tuple[int, int] = (0, 1)
) -> CausalLM:
    """A preset's model with random weights drawn on `device` (seconds, even for 35B), scaled so
    activations stay O(1): projections ~ N(0, 1/fan_in), residual outputs shrunk by the depth.
    quantization "fp8": then quantized as a checkpoint loaded with it would be (128x128 blocks).
    tp (rank, size): this rank's shard of the same weights (each whole tensor drawn, then cut)."""
    check_quantization(quantization)
    cfg = preset_config(preset)
    torch_dtype = DTYPES[dtype]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device("meta"):
            whole = CausalLM(cfg, num_mtp_layers=1)
            model = CausalLM(cfg.shard(*tp), num_mtp_layers=1)
    finally:
        torch.set_default_dtype(default)
    _check_fits(preset, model, device, dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for (name, w), p in zip(whole.named_parameters(), model.parameters(), strict=True):
        full = p if tp[1] == 1 else torch.empty(w.shape, device=device, dtype=p.dtype)
        _random_(name, full, gen, cfg)
        if full is not p:
            p.copy_(shard_tensor(name, full, cfg, *tp))
    model.rotary = type(model.rotary)(cfg.rotary_dim, cfg.rope_theta).to(device)
    if quantization == "fp8":
        quantize_model(model)
    return fuse_weights(model.eval())


def _check_fits(preset: str, model: CausalLM, device: str, dtype: str) -> None:
    """The weights' bytes against the device's free memory, before any is drawn: a shape too large for
    it (9B in float32 on a laptop's CPU) is a one-line error, not the kernel's OOM killer."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    free = available_bytes(torch.device(device))
    if nbytes > free:
        hint = "; run it on a GPU (--device cuda)" if torch.device(device).type == "cpu" else ""
        raise ValueError(
            f"the {preset} preset's weights take {nbytes / GiB:.1f} GiB in {dtype}, more than the "
            f"{free / GiB:.1f} GiB free on {device}{hint}"
        )


def _random_(name: str, p: torch.Tensor, gen: torch.Generator, cfg: ModelConfig) -> None:
    """Parameter `name` of the whole model drawn in place."""
    if name.endswith("linear_attn.norm.weight"):
        p.normal_(1.0, 0.05, generator=gen)  # the gated norm's weight sits around 1
    elif name.endswith("norm.weight") or "norm_" in name:
        p.normal_(0.0, 0.05, generator=gen)  # zero-centred norms: (1 + w)
    elif name.endswith("A_log"):
        p.uniform_(0.0, math.log(16.0), generator=gen)
    elif name.endswith("dt_bias"):
        p.normal_(-4.0, 1.0, generator=gen)  # softplus(a + dt_bias) ~ 0.02: slow decay
    elif name.endswith("conv1d.weight"):
        p.normal_(0.0, 0.5, generator=gen)
    elif name.endswith("embed_tokens.weight"):
        p.normal_(0.0, 1.0, generator=gen)
    else:  # projections [.., out, in]
        std = p.shape[-1] ** -0.5
        if name.removesuffix(".weight").endswith(("o_proj", "out_proj", "down_proj")):
            std *= (2 * cfg.num_hidden_layers) ** -0.5  # residual outputs shrunk by the depth
        p.normal_(0.0, std, generator=gen)


def weight_bytes_per_token(model: CausalLM) -> int:
    """Bytes of weights one decoded token reads: every trunk weight but the embedding table (one
    row), the lm_head, and for MoE layers only the experts a token routes to; FP8 weights at a byte
    per weight plus their scales as the step reads them (one per 128x128 block where exact)."""
    cfg = model.cfg
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or name == "model.embed_tokens.weight":
            continue
        nbytes = p.numel() * p.element_size()
        if name.endswith("_scale") and p.dim() == 2 and (scale := compact(p)) is not None:
            nbytes = scale.numel() * scale.element_size()  # FP8 scales as the step reads them
        if ".experts." in name:
            nbytes = nbytes * cfg.num_experts_per_tok // cfg.num_experts
        total += nbytes
    if cfg.tie_word_embeddings:
        total += model.lm_head_weight.numel() * model.lm_head_weight.element_size()
    return total + cfg.hidden_size * model.model.embed_tokens.weight.element_size()
