"""Released Qwen3.5 text shapes (`PRESETS`) as models with random weights drawn on the device, for
benchmarks and tests of shapes no checkpoint here holds (`nextn bench`, and `LLM(random_weights=...)`
behind generate and serve), and the weight bytes a decoded token reads (the roofline's numerator).
Does not time anything (nextn.bench.measure does).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import NamedTuple

import torch

from nextn.cache.pool import GiB, available_bytes
from nextn.config import DEFAULT_GPU_MEMORY_UTILIZATION, check_quantization
from nextn.config.model import ModelConfig
from nextn.engine.memory import bytes_per_sequence, sequences_that_fit
from nextn.models.loader import (
    DTYPES,
    at_load_config,
    fuse_weights,
    quantize_weight,
    quantized_at_load,
    use_quant_modules,
    weight_format,
)
from nextn.models.qwen3_5 import CausalLM
from nextn.ops.fp8 import FP8, compact
from nextn.parallel.shard import shard_tensor

log = logging.getLogger(__name__)

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


def _experts(num: int, top_k: int, width: int) -> dict:
    """An MoE preset's experts: num of them, top_k routed a token, each and the shared expert `width` wide."""
    return dict(
        num_experts=num, num_experts_per_tok=top_k, moe_intermediate_size=width, shared_expert_intermediate_size=width
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
        **_experts(256, 8, 512),
    ),
    # Qwen/Qwen3.5-122B-A10B. Sources: THUDM/slime scripts/models/qwen3.5-122B-A10B.sh (48 layers, hidden
    # 3072, 32 attention heads over 2 kv heads of 256, 256 experts, 8 routed, expert and shared expert
    # 1024 wide, vocab 248,320, rope base 1e7, rotary 0.25, untied); Vultr's model page (48 layers,
    # 32 heads, hidden 3,072, 8 routed + 1 shared of 256). Not found in a source reachable here: the
    # Gated DeltaNet heads (16 key, 64 value, 128 wide): the model card's figures as remembered, and
    # what makes the parameter count 122.1B (tests/test_fp8_moe.py checks it against the published
    # 122.11B); check them against the checkpoint's config.json before quoting a figure of this shape.
    "qwen3.5-122b-a10b": dict(
        _COMMON,
        model_type="qwen3_5_moe_text",
        hidden_size=3072,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=2,
        linear_num_value_heads=64,
        **_experts(256, 8, 1024),
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct(-FP8) config.json, as transcribed in public tests of other
    # engines, and transformers' Qwen3NextConfig defaults ("Qwen3-Next-80B-A3B style"); THUDM/slime
    # scripts/models/qwen3-next-80B-A3B.sh agrees on every size (it gives rope base 1e7 where the
    # config.json has 5e6: the config's value here). Qwen3.5's attention and GDN sizes (_COMMON's),
    # its own vocabulary; 512 experts, 10 routed + 1 shared, every layer MoE (intermediate_size 5120
    # is the config's, unused: no dense layer); no mtp_num_hidden_layers key (the release ships one
    # MTP layer as mtp.* tensors, which the preset draws).
    "qwen3-next-80b-a3b": dict(
        {key: v for key, v in _COMMON.items() if key != "mtp_num_hidden_layers"},
        model_type="qwen3_next",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        full_attention_interval=4,
        num_key_value_heads=2,
        **_experts(512, 10, 512),
        rope_parameters={"rope_theta": 5_000_000.0, "partial_rotary_factor": 0.25},
        bos_token_id=151643,
        eos_token_id=151645,
    ),
}


def preset_config(preset: str) -> ModelConfig:
    """A preset's model config (no weight made); an unknown name is a ValueError listing the presets."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[preset])


class CacheQuery(NamedTuple):
    """The cache the fit line sizes beside the weights: sequences of max_len tokens drafting k a round."""

    max_len: int = 8192
    k: int = 3
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION


class FitPlan(NamedTuple):
    """What a preset's weights leave on a device, computed before any is drawn (nextn.engine.memory's
    arithmetic for the cache)."""

    preset: str
    device: str
    dtype: str
    quant: str  # "" (the model's dtype), or the quantized weights' format: "fp8", "q8_0"
    weight_bytes: int  # every parameter as drawn (FP8: e4m3 bytes and their float32 scales; Q8_0 34 per 32)
    free_bytes: int  # the device's free memory now
    budget_bytes: int  # what the engine may take beside the weights (a GPU: utilization of its total)
    sequence_bytes: int  # one sequence's cache at the query's context
    num_seqs: int  # sequences of that context that fit beside the engine's reserve (0: none)
    query: CacheQuery

    def line(self) -> str:
        """The plan in one line."""
        kind = f"{self.dtype} with {self.quant.upper()} weights" if self.quant else self.dtype
        q = self.query
        return (
            f"fit: the {self.preset} preset in {kind}: weights {self.weight_bytes / GiB:.1f} GiB of "
            f"{self.free_bytes / GiB:.1f} GiB free on {self.device}; a sequence of {q.max_len} tokens at K={q.k} "
            f"(kv {q.kv_cache_dtype}) caches {self.sequence_bytes / GiB:.3f} GiB; {self.num_seqs} sequences fit"
        )


def plan_fit(model: CausalLM, preset: str, device: str, dtype: str, query: CacheQuery) -> FitPlan:
    """The fit of `model` (its meta-device parameters: their dtypes and shapes as they will be drawn)
    on `device` beside a cache of query's sequences. A GPU's budget is the query's utilization of its
    total memory less what is in use and the weights; the CPU's, its free memory less a tenth and the
    weights (as the engine sizes them: nextn.engine.memory)."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dev = torch.device(device)
    free = available_bytes(dev)
    if dev.type == "cuda":
        total = torch.cuda.mem_get_info(dev)[1]
        budget = int(query.gpu_memory_utilization * total) - (total - free) - nbytes
    else:
        budget = free - free // 10 - nbytes
    torch_dtype = DTYPES[dtype]
    slot = bytes_per_sequence(model.cfg, query.max_len, query.k, torch_dtype, query.kv_cache_dtype)
    num_seqs = sequences_that_fit(model.cfg, query.max_len, query.k, max(0, budget), torch_dtype, query.kv_cache_dtype)
    quant = model.cfg.quantization.method if model.cfg.quantization is not None else ""
    return FitPlan(preset, device, dtype, quant, nbytes, free, budget, slot, num_seqs, query)


@torch.no_grad()
def random_model(
    preset: str,
    device: str,
    dtype: str,
    seed: int = 0,
    quantization: str | None = None,
    tp: tuple[int, int] = (0, 1),
    cache: CacheQuery | None = None,
) -> CausalLM:
    """A preset's model with random weights drawn on `device` (seconds, even for 35B), scaled so
    activations stay O(1): projections ~ N(0, 1/fan_in), residual outputs shrunk by the depth.
    quantization "fp8" (or "q8_0"): the weights a checkpoint loaded with it quantizes (nextn.models.loader.
    quantized_at_load) are drawn straight into 128x128-block e4m3 (Q8_0) a few experts at a time (float32 chunks of
    at most FP8_DRAW_BYTES), never as a whole copy in the model's dtype: the 122B's FP8 weights fit an
    H200, its bf16 ones do not. tp (rank, size): this rank's shard of the same weights (each whole
    tensor drawn, then cut; not with FP8, which tensor parallelism does not shard). Before any weight
    is drawn the fit (FitPlan: weights, a sequence's cache at `cache`'s context, the sequences that
    fit) is logged in one line (cache: the context it sizes; default CacheQuery()), and weights larger
    than the device's free memory are a ValueError."""
    check_quantization(quantization)
    cfg = preset_config(preset)
    if quantization is not None:
        cfg = replace(cfg, quantization=at_load_config(quantization))
        cfg.shard(*tp)  # FP8 under tensor parallelism: the loader's one-line error
    torch_dtype = DTYPES[dtype]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device("meta"):
            whole = CausalLM(cfg, num_mtp_layers=1)
            model = CausalLM(cfg.shard(*tp), num_mtp_layers=1)
    finally:
        torch.set_default_dtype(default)
    fp8 = quantized_at_load(model, weight_format(cfg.quantization)) if quantization is not None else frozenset()
    use_quant_modules(model, fp8, weight_format(cfg.quantization))
    plan = plan_fit(model, preset, device, dtype, cache or CacheQuery())
    _check_fits(plan)
    log.info(plan.line())
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    wholes = dict(whole.named_parameters())
    for name, p in model.named_parameters():
        if name in fp8:
            _random_fp8_(name, model, gen, cfg)
        elif not name.endswith("_scale") or name.removesuffix("_scale") not in fp8:
            full = p if tp[1] == 1 else torch.empty(wholes[name].shape, device=device, dtype=p.dtype)
            _random_(name, full, gen, cfg)
            if full is not p:
                p.copy_(shard_tensor(name, full, cfg, *tp))
    model.rotary = type(model.rotary)(cfg.rotary_dim, cfg.rope_theta).to(device)
    return fuse_weights(model.eval())


def _check_fits(plan: FitPlan) -> None:
    """The weights' bytes against the device's free memory, before any is drawn: a shape too large for
    it (9B in float32 on a laptop's CPU) is a one-line error, not the kernel's OOM killer."""
    if plan.weight_bytes > plan.free_bytes:
        hint = "; run it on a GPU (--device cuda)" if torch.device(plan.device).type == "cpu" else ""
        quant = f" with {plan.quant.upper()} weights" if plan.quant else ""
        raise ValueError(
            f"the {plan.preset} preset's weights take {plan.weight_bytes / GiB:.1f} GiB in {plan.dtype}{quant}, "
            f"more than the {plan.free_bytes / GiB:.1f} GiB free on {plan.device}{hint}"
        )


FP8_DRAW_BYTES = 2**28  # the float32 chunk an FP8 weight is drawn in, before it is quantized


def _random_fp8_(name: str, model: CausalLM, gen: torch.Generator, cfg: ModelConfig) -> None:
    """FP8 weight `name` ([N, K] or an expert stack [E, N, K]) and its scales drawn as _random_ draws
    the weight, in float32 chunks of whole experts, each quantized as the loader quantizes a
    checkpoint's weight (quantize_weight: 128x128 blocks, an expert's gate and up rows apart; or Q8_0)."""
    prefix, _, attr = name.rpartition(".")
    module = model.get_submodule(prefix)
    weight, scale = getattr(module, attr), getattr(module, f"{attr}_scale")
    stack, scales = (weight, scale) if weight.dim() == 3 else (weight[None], scale[None])
    n, k = stack.shape[-2:]
    step = max(1, FP8_DRAW_BYTES // (4 * n * k))
    for e in range(0, stack.shape[0], step):
        chunk = torch.empty(min(step, stack.shape[0] - e), n, k, device=weight.device, dtype=torch.float32)
        _random_(name, chunk, gen, cfg)
        q = quantize_weight(name, chunk, weight_format(cfg.quantization))
        stack[e : e + len(chunk)].copy_(q.weight)
        scales[e : e + len(chunk)].copy_(q.scale)


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


def weight_bytes(model: CausalLM) -> int:
    """Bytes of every parameter the model holds (the MTP head's included; FP8: e4m3 and the scales)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def weight_bytes_per_token(model: CausalLM, experts_read: list[float] | None = None) -> float:
    """Bytes of weights one decoded token reads: every trunk weight but the embedding table (one
    row), the lm_head, and of each MoE layer's experts only those the step reads: experts_read[i]
    for the i-th MoE layer (the distinct experts a step's rows route to, nextn.bench.roofline;
    default top-k each, a one-row decode step's). FP8 weights at a byte per weight plus their scales
    as the step reads them (one per 128x128 block where exact); Q8_0 at GGUF's 34 bytes per 32."""
    cfg = model.cfg
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    if experts_read is None:
        experts_read = [cfg.num_experts_per_tok] * len(moe_layers)
    if len(experts_read) != len(moe_layers):
        raise ValueError(f"experts_read has {len(experts_read)} counts for {len(moe_layers)} MoE layers")
    read = dict(zip(moe_layers, experts_read, strict=True))
    total = 0.0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or name == "model.embed_tokens.weight":
            continue
        nbytes = p.numel() * p.element_size()
        if name.endswith("_scale") and p.dtype == FP8.scale and p.dim() == 2 and (scale := compact(p)) is not None:
            nbytes = scale.numel() * scale.element_size()  # FP8 scales as the step reads them
        if ".experts." in name:  # model.layers.{i}.mlp.experts.*: a stack of num_experts alike
            nbytes = nbytes // cfg.num_experts * read[int(name.split(".")[2])]
        total += nbytes
    if cfg.tie_word_embeddings:
        total += model.lm_head_weight.numel() * model.lm_head_weight.element_size()
    return total + cfg.hidden_size * model.model.embed_tokens.weight.element_size()
