"""Hugging Face checkpoint directory -> CausalLM with every tensor checked, streamed to the device.

Takes the checkpoint's plan (nextn.models.checkpoint: every shard's header checked, each key's slot in
the model, experts packed, FP8 scales), checks its names and shapes against the model built on the
meta device (a missing, unknown or mis-shaped tensor is an error naming it) before any data is read;
then reads the tensors one by one, each cast and moved to the device as it is read, so host memory
holds about one tensor at a time. A progress bar counts the shards (shown at log level info).

As the tensors arrive:
- per-expert MoE weights are written expert by expert into the device's packed tensor;
- Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` (rows grouped per key head) -> rows regrouped as
  [q all | k all | v all | z all] and [b all | a all], the Qwen3.5 order;
- at load, once: the projections one step kernel reads together become row blocks of one tensor
  (`FUSED`), each module keeping its own name as a view, so the fused Triton step reads them
  with one GEMM (`fused_weight`) and nothing rewrites the model afterwards.

Tensor parallelism (tp_size > 1): each rank loads its part only (nextn.parallel.shard): a tensor is
read whole (regrouped first, for Qwen3-Next), cut, and the whole copy dropped before the next one,
so a rank holds its shard plus one checkpoint tensor at a time; per-expert tensors are cut before
they are packed.

FP8 weights (nextn.ops.fp8): a checkpoint with a `quantization_config` (nextn.config.model.QuantConfig)
stores some weights as e4m3 beside a scale tensor (`*.weight_scale_inv` per block, or
`*.weight_scale` per channel); those modules become QuantLinear / QuantExperts and their scales are
converted to nextn's layout as they stream in; the modules a checkpoint keeps in bf16 stay so. With
`quantization="fp8"` a bf16 checkpoint's decoder-layer projections are quantized as they stream in
(128x128 blocks), except the few a published FP8 checkpoint keeps (`KEEP_BF16`); lm_head, the
embeddings and the MTP head stay in the checkpoint's dtype. `quantization="q8_0"` quantizes the same
weights into GGUF's Q8_0 (nextn.ops.q8_0: int8 with an fp16 scale per row and 32 columns), held by the
same modules in that format (nextn.ops.fp8.Format, `weight_format`).

GGUF files (llama.cpp's, `load_gguf`): nextn.models.gguf gives the hyperparameters, the tensors each
module tensor is made of and their values with the converter's changes undone; the Q8_0 weights of
the projections FP8 would quantize stay Q8_0 (QuantLinear / QuantExperts holding nextn.ops.q8_0's
layout), the rest load in the model's dtype. `model_config` is either kind's ModelConfig.

Does not parse the files' headers or map checkpoint keys to module names: nextn.models.checkpoint
(and nextn.models.gguf) do.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from nextn.config import check_quantization, resolve_device, resolve_dtype
from nextn.config.model import ModelConfig, QuantConfig
from nextn.layers.ffn import MLP, Experts, QuantExperts
from nextn.layers.linear import Linear, QuantLinear
from nextn.models import gguf
from nextn.models.checkpoint import (
    CheckpointError,
    CheckpointPlan,
    Slot,
    count_mtp_layers,
    plan_checkpoint,
    regroup_next,
    safetensor_files,
)
from nextn.models.qwen3_5 import CausalLM
from nextn.ops.fp8 import (
    E4M3,
    FORMATS,
    FP8,
    Q8_0,
    Format,
    QuantWeight,
    block_scale,
    channel_scale,
    quantize,
    scale_shape,
)
from nextn.ops.q8_0 import q8_0_quantize

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Linear children of one module whose weights one step GEMM reads, in row order
FUSED = (
    ("q_proj", "k_proj", "v_proj"),  # attention
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # Qwen3.5 GDN
    ("in_proj_qkvz", "in_proj_ba"),  # Qwen3-Next GDN
)
# Linear modules of the decoder layers that quantization="fp8" leaves in bf16, as the published FP8
# checkpoints do: the GDN gate projections (one row per value head) and the shared-expert gate
KEEP_BF16 = ("in_proj_a", "in_proj_b", "in_proj_ba", "shared_expert_gate")


def at_load_config(quantization: str) -> QuantConfig:
    """The QuantConfig of `quantization=` applied to a bf16 checkpoint at load: "fp8" (128x128
    blocks) or "q8_0" (a scale per row and 32 columns)."""
    fmt = FORMATS[quantization]
    return QuantConfig(fmt.name, (fmt.block if fmt == FP8 else 1, fmt.block), at_load=True)


def weight_format(quant: QuantConfig | None) -> Format:
    """The format of a model's quantized weights: Q8_0 for method "q8_0", else FP8."""
    return FORMATS[quant.method] if quant is not None and quant.method in FORMATS else FP8


def quantized_at_load(model: CausalLM, fmt: Format = FP8, gguf: bool = False) -> frozenset[str]:
    """The module weights quantization="fp8" quantizes: the decoder layers' Linear weights and
    experts, but KEEP_BF16 (lm_head, the embeddings, norms, routers and mtp.* are not among them).
    Q8_0 (fmt) quantizes those whose rows are whole blocks of 32 (as llama.cpp keeps the others in
    a float type); an expert stack, and an MLP's three projections, whole or not at all (the MoE
    kernels read a shared expert in one format). gguf: also the lm_head (untied), the MTP layer's
    projections and the GDN gate projections (in_proj_b / a / ba), as llama.cpp's converter stores a
    GGUF file's (load_gguf keeps those the file has in Q8_0 so; a published FP8 checkpoint keeps them
    in bf16); the gate projections then fuse with the GDN input projection into one GEMM."""
    out, kept = set(), set()
    layers = ("model.layers.", "mtp.") if gguf else ("model.layers.",)
    keep = ("shared_expert_gate",) if gguf else KEEP_BF16  # (the MoE router kernel reads that gate in bf16)
    for name, m in model.named_modules():  # (a module before its children)
        if gguf and name == "lm_head" and _whole_blocks(fmt, m.weight):
            out.add("lm_head.weight")
        if not name.startswith(layers):
            continue
        if isinstance(m, MLP) and not _whole_blocks(fmt, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight):
            kept |= {f"{name}.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
        if isinstance(m, Experts) and _whole_blocks(fmt, m.gate_up_proj, m.down_proj):
            out |= {f"{name}.gate_up_proj", f"{name}.down_proj"}
        elif isinstance(m, Linear) and not name.endswith(keep) and name not in kept and _whole_blocks(fmt, m.weight):
            out.add(f"{name}.weight")
    return frozenset(out)


def _whole_blocks(fmt: Format, *weights: torch.Tensor) -> bool:
    """Whether each weight's rows are whole blocks of the format (FP8 takes a partial last block)."""
    return fmt == FP8 or all(w.shape[-1] % fmt.block == 0 for w in weights)


def quantize_at_load(plan: CheckpointPlan, model: CausalLM, fmt: Format = FP8) -> CheckpointPlan:
    """The plan of a bf16 checkpoint loaded with quantization="fp8" (or "q8_0", fmt): quantized_at_load's
    weights quantized as they stream in, their scales beside them."""
    fp8 = quantized_at_load(model, fmt) & plan.shapes.keys()
    shapes = dict(plan.shapes)
    for name in fp8:
        *lead, n, k = shapes[name]
        shapes[name + "_scale"] = (*lead, *scale_shape(n, k, fmt.block))
    keys = {
        path: {key: slot._replace(quantize=slot.name in fp8) for key, slot in slots.items()}
        for path, slots in plan.keys.items()
    }
    return CheckpointPlan(shapes, keys, fp8, plan.tp)


def use_quant_modules(model: CausalLM, fp8: frozenset[str], fmt: Format = FP8, gguf: bool = False) -> None:
    """Swap the modules whose weights are quantized (FP8, or fmt) for QuantLinear / QuantExperts (on the
    meta device; a bias is kept). Embeddings, norms and routers stay in the model's dtype, and so does
    lm_head but with gguf (a GGUF file's Q8_0 lm_head: quantized_at_load's gguf)."""
    for prefix in sorted({name.rpartition(".")[0] for name in fp8}):
        module = model.get_submodule(prefix)
        with torch.device("meta"):
            if isinstance(module, Linear) and (gguf or prefix != "lm_head"):
                new = QuantLinear(module.in_features, module.out_features, fmt=fmt)
                new.bias = module.bias
            elif isinstance(module, Experts) and {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"} <= fp8:
                num, rows, hidden = module.gate_up_proj.shape
                new = QuantExperts(num, hidden, rows // 2, fmt=fmt)
            else:
                raise CheckpointError(f"the checkpoint quantizes {prefix}, which nextn keeps in the model's dtype")
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent), child, new)


def quantize_weight(name: str, w: torch.Tensor, fmt: Format = FP8) -> QuantWeight:
    """Module weight `name` ([N, K], or packed experts [E, N, K]) quantized in 128x128 blocks as a
    published checkpoint stores it: expert by expert, gate and up rows of gate_up_proj apart; Q8_0
    (fmt) as GGUF does, row by row."""
    if fmt != FP8:
        return q8_0_quantize(w)
    if w.dim() == 2:
        return quantize(w)
    parts = w.chunk(2, dim=1) if name.endswith("gate_up_proj") else (w,)
    qs = [quantize(part) for part in parts]  # each expert's matrix alone (quantize takes a stack)
    return QuantWeight(torch.cat([q.weight for q in qs], dim=1), torch.cat([q.scale for q in qs], dim=2))


@torch.no_grad()
def quantize_model(model: CausalLM, quantization: str = "fp8") -> CausalLM:
    """quantization="fp8" (or "q8_0") applied to a model in memory: what loading its checkpoint with
    that quantization gives. Before fuse_weights."""
    quant = at_load_config(quantization)
    fmt = weight_format(quant)
    fp8 = quantized_at_load(model, fmt)
    weights = {name: model.get_parameter(name) for name in fp8}
    use_quant_modules(model, fp8, fmt)
    for name in sorted(fp8):
        w = weights.pop(name)  # the last reference: each bf16 weight is freed once quantized
        q = quantize_weight(name, w, fmt)
        prefix, _, attr = name.rpartition(".")
        module = model.get_submodule(prefix)
        setattr(module, attr, torch.nn.Parameter(q.weight, requires_grad=False))
        setattr(module, attr + "_scale", torch.nn.Parameter(q.scale, requires_grad=False))
        del w
    model.cfg = replace(model.cfg, quantization=quant)
    return model


def fuse_weights(model: CausalLM) -> CausalLM:
    """Make each FUSED group's weights row blocks of one tensor (the modules keep views of it): one
    tensor per run of modules of one kind, bf16, FP8 or Q8_0 (whose scales are fused as column blocks)."""
    with torch.no_grad():
        for module in model.modules():
            for names in FUSED:
                if not all(hasattr(module, n) for n in names):
                    continue
                for run in _runs([getattr(module, n) for n in names]):
                    fused = torch.cat([m.weight.detach() for m in run]).contiguous()
                    scales = None
                    if isinstance(run[0], QuantLinear):
                        scales = torch.cat([m.weight_scale.detach() for m in run], dim=1).contiguous()
                    start = 0
                    for m in run:
                        n = m.weight.shape[0]
                        m.weight = torch.nn.Parameter(fused[start : start + n], requires_grad=False)
                        if scales is not None:
                            m.weight_scale = torch.nn.Parameter(scales[:, start : start + n], requires_grad=False)
                        start += n
    return model


def _runs(linears: list) -> list[list]:
    """Consecutive linears of one kind (Linear, or QuantLinear of one format: their weights' dtype)."""
    runs: list[list] = []
    for m in linears:
        if runs and m.weight.dtype == runs[-1][0].weight.dtype:
            runs[-1].append(m)
        else:
            runs.append([m])
    return runs


def fused_runs(*linears) -> list[torch.Tensor | QuantWeight]:
    """The tensors whose consecutive row blocks the linears' weights are (`fuse_weights` made them),
    one per run of one kind: a tensor for Linear modules, a QuantWeight (FP8 or Q8_0; scales as
    column blocks) for QuantLinear ones."""
    out: list[torch.Tensor | QuantWeight] = []
    for run in _runs(list(linears)):
        weight = _joined([m.weight for m in run], dim=0)
        fp8 = isinstance(run[0], QuantLinear)
        out.append(QuantWeight(weight, _joined([m.weight_scale for m in run], dim=1)) if fp8 else weight)
    return out


def fused_weight(*linears) -> torch.Tensor | QuantWeight:
    """fused_runs of linears of one kind: the one tensor (or QuantWeight) they are row blocks of."""
    runs = fused_runs(*linears)
    if len(runs) > 1:
        raise ValueError("a fused group holds both FP8 and unquantized weights: take fused_runs")
    return runs[0]


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The tensor whose consecutive blocks along `dim` the parts are (one storage, same strides)."""
    first, size = parts[0], 0
    for t in parts:
        if (
            t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or t.storage_offset() != first.storage_offset() + size * first.stride(dim)
            or t.stride() != first.stride()
            or t.stride(-1) != 1
        ):
            raise ValueError("the model's weights are not fused: load it with nextn.models.loader (fuse_weights)")
        size += t.shape[dim]
    shape = list(first.shape)
    shape[dim] = size
    return first.as_strided(shape, first.stride())


def load_model(
    model_dir: str | Path,
    device: str = "cpu",
    dtype: str = "float32",
    quantization: str | None = None,
    tp: tuple[int, int] = (0, 1),
) -> CausalLM:
    """The checkpoint's model (a directory, or a GGUF file) on `device` in `dtype` (either may be "auto": see
    nextn.config.resolve_device and resolve_dtype), every tensor checked against the config before
    any is read. FP8 weights of an FP8 checkpoint stay FP8; quantization "fp8" (or "q8_0") quantizes a
    bf16 checkpoint's at load (an FP8 checkpoint loads as it is). tp (rank, size): this rank's share of
    the model under tensor parallelism (its config is `ModelConfig.shard(rank, size)`)."""
    check_quantization(quantization)
    model_dir = Path(model_dir)
    if gguf.is_gguf(model_dir):  # a llama.cpp file: its own reader (nextn.models.gguf)
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device, gguf.gguf_config(model_dir).dtype)
        return load_gguf(model_dir, device, dtype, quantization, tp)
    cfg = ModelConfig.from_hf(model_dir)
    if quantization is not None and cfg.quantization is None:
        cfg = replace(cfg, quantization=at_load_config(quantization))
    fmt = weight_format(cfg.quantization)
    shard_cfg = cfg.shard(*tp)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device, cfg.dtype)
    files = safetensor_files(model_dir)
    plan = plan_checkpoint(files, cfg, tp)
    num_mtp = count_mtp_layers(plan.shapes)
    if num_mtp > 1:
        raise CheckpointError(f"checkpoint has {num_mtp} MTP layers; nextn runs one (mtp.layers.0)")
    if num_mtp == 0 and cfg.mtp_num_hidden_layers > 0:
        log.warning(
            "%s declares an MTP layer but has no mtp.* tensors (dropped by a conversion?); speculative decoding is off",
            model_dir,
        )
    with torch.device("meta"):
        model = CausalLM(shard_cfg, num_mtp_layers=num_mtp)
    if cfg.quantization is not None and cfg.quantization.at_load:
        plan = quantize_at_load(plan, model, fmt)
    use_quant_modules(model, plan.fp8, fmt)
    check_tensors(model, plan.shapes)
    t0 = time.perf_counter()
    state = stream_tensors(plan, cfg, torch.device(device), DTYPES[dtype])
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = type(model.rotary)(cfg.rotary_dim, cfg.rope_theta).to(device)
    fp8 = f", {len(plan.fp8)} weights in FP8 ({cfg.quantization.method})" if plan.fp8 else ""
    log.info("loaded %s on %s as %s%s in %.1f s", model_dir, device, dtype, fp8, time.perf_counter() - t0)
    return fuse_weights(model.eval())


def stream_tensors(plan: CheckpointPlan, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> dict:
    """The module tensors on `device` in `dtype` (FP8 weights in e4m3, their scales in float32; Q8_0
    in int8 and float16), read one at a time: host memory holds one tensor (and its cast) while the
    device fills up."""
    fmt = weight_format(cfg.quantization)
    packed = {slot.name for k in plan.keys.values() for slot in k.values() if slot.e is not None}
    packed |= {name + "_scale" for name in packed & plan.fp8}
    state = {
        name: torch.empty(plan.shapes[name], device=device, dtype=_dtype(name, plan, dtype, fmt)) for name in packed
    }
    for path in tqdm(plan.keys, desc="loading", unit="shard", disable=not log.isEnabledFor(logging.INFO)):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key, slot in plan.keys[path].items():
                    _place(state, slot, f.get_tensor(key), cfg, device, dtype, plan.tp)  # no name keeps it after
        except SafetensorError as e:
            raise CheckpointError(f"{path}: {e}") from None
    return state


def _dtype(name: str, plan: CheckpointPlan, dtype: torch.dtype, fmt: Format) -> torch.dtype:
    if name in plan.fp8:
        return fmt.values
    return fmt.scale if name.removesuffix("_scale") in plan.fp8 else dtype


def _place(state: dict, slot: Slot, t: torch.Tensor, cfg: ModelConfig, device, dtype, tp=(0, 1)) -> None:
    """One checkpoint tensor into the state: cast (FP8 weights kept e4m3, scales converted to
    nextn's layout, quantized if asked; a rank's part cut) and moved, or copied into its expert's rows."""
    if slot.quantize:  # from the checkpoint's own values (quantize computes in float32)
        q = quantize_weight(slot.name, regroup_next(slot.name, t, cfg).to(device), weight_format(cfg.quantization))
        _put(state, slot, q.weight)
        _put(state, slot._replace(name=slot.name + "_scale"), q.scale, columns=True)
        return
    target = E4M3 if t.dtype == E4M3 else dtype
    if slot.scale is not None:
        kind, rows, n, k = slot.scale
        t, target = block_scale(t, n, rows) if kind == "block" else channel_scale(t, n, k), torch.float32
    t = regroup_next(slot.name, t, cfg)
    if slot.split is not None:
        t = slot.split.take(t, *tp)
    _put(state, slot, t.to(device=device, dtype=target), columns=slot.scale is not None)


def _put(state: dict, slot: Slot, t: torch.Tensor, columns: bool = False) -> None:
    if slot.e is None:
        state[slot.name] = t
    elif columns:  # scales [K blocks, rows]: the expert's rows are columns
        state[slot.name][slot.e, :, slot.row : slot.row + t.shape[-1]].copy_(t)
    else:
        state[slot.name][slot.e, slot.row : slot.row + t.shape[0]].copy_(t)


def check_tensors(model: CausalLM, shapes: dict[str, tuple[int, ...]]) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    unknown = sorted(set(shapes) - set(expected))
    if unknown:
        raise CheckpointError(f"unknown tensor(s) in checkpoint: {unknown[:8]}")
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise CheckpointError(f"missing tensor(s) in checkpoint: {missing[:8]}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(shapes[name])}, expected {shape}")


def model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (its config.json) or of a GGUF file (its metadata)."""
    return gguf.gguf_config(path) if gguf.is_gguf(path) else ModelConfig.from_hf(path)


def load_gguf(path: Path, device: str, dtype: str, quantization: str | None = None, tp: tuple[int, int] = (0, 1)):
    """A GGUF file's model on `device` in `dtype` (nextn.models.gguf reads and maps its tensors): the
    Q8_0 weights of the projections nextn's quantized kernels read (quantized_at_load's) stay Q8_0
    (QuantLinear / QuantExperts holding nextn.ops.q8_0's layout), every other tensor in `dtype`.
    quantization "fp8" or "q8_0": a file of F32 / F16 / BF16 weights quantized at load (quantize_model)."""
    from nextn.ops.q8_0 import q8_0_from_blocks

    if tp[1] > 1:
        raise CheckpointError(f"{path}: tensor parallelism does not load GGUF files; give the safetensors checkpoint")
    reader = gguf.open_gguf(path)
    cfg = gguf.gguf_config(reader)
    if cfg.mtp_num_hidden_layers > 1:
        raise CheckpointError(f"{path} has {cfg.mtp_num_hidden_layers} NextN layers; nextn runs one")
    with torch.device("meta"):
        model = CausalLM(cfg, num_mtp_layers=cfg.mtp_num_hidden_layers)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    plan = gguf.plan_tensors(reader, cfg, expected)
    q8 = _whole_modules(
        model, {key for key in quantized_at_load(model, Q8_0, gguf=True) if gguf.is_q8_0(reader, key, plan[key], cfg)}
    )
    if q8 and quantization is not None:
        raise CheckpointError(f"{path} holds Q8_0 weights: load it without quantization={quantization!r}")
    gguf.log_types(reader, sum(len(plan[key]) for key in q8))
    use_quant_modules(model, q8, Q8_0, gguf=True)
    t0 = time.perf_counter()
    for key, names in tqdm(plan.items(), desc="loading", unit="tensor", disable=not log.isEnabledFor(logging.INFO)):
        t = gguf.module_tensor(reader, key, names, cfg, blocks=key in q8)
        if key in q8:  # the converter's row moves undone on the blocks, then nextn's Q8_0 layout
            w = q8_0_from_blocks(t)
            _check_gguf_shape(key, names, w.weight, expected[key])
            _assign(model, key, w.weight.to(device))
            _assign(model, key + "_scale", w.scale.to(device))
        else:
            _check_gguf_shape(key, names, t, expected[key])
            _assign(model, key, t.reshape(expected[key]).to(device=device, dtype=DTYPES[dtype]))
    model.rotary = type(model.rotary)(cfg.rotary_dim, cfg.rope_theta).to(device)
    if q8:
        model.cfg = replace(cfg, quantization=QuantConfig(Q8_0.name, (1, Q8_0.block)))
    if quantization is not None:
        model = quantize_model(model, quantization)
    log.info("loaded %s on %s as %s in %.1f s", path, device, dtype, time.perf_counter() - t0)
    return fuse_weights(model.eval())


def _whole_modules(model: CausalLM, q8: set[str]) -> frozenset[str]:
    """q8 without the weights of an MLP or an expert stack some of whose weights are not in it: the
    MoE kernels read a shared expert, and an expert stack, in one format (quantized_at_load's rule)."""
    out = set(q8)
    for name, m in model.named_modules():
        members = ()
        if isinstance(m, MLP):
            members = tuple(f"{name}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj"))
        elif isinstance(m, Experts):
            members = (f"{name}.gate_up_proj", f"{name}.down_proj")
        if not set(members) <= q8:
            out -= set(members)
    return frozenset(out)


def _check_gguf_shape(key: str, names: list[str], t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """t holds module tensor `key`'s values (the converter squeezes unit dims: a reshape restores them)."""
    if t.numel() != math.prod(shape) or (t.dim() == len(shape) and tuple(t.shape) != shape):
        raise CheckpointError(f"GGUF {' + '.join(names)} of shape {tuple(t.shape)} cannot be nextn's {key} {shape}")


def _assign(model: CausalLM, key: str, t: torch.Tensor) -> None:
    prefix, _, attr = key.rpartition(".")
    setattr(model.get_submodule(prefix), attr, torch.nn.Parameter(t, requires_grad=False))
