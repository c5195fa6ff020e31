"""Hugging Face checkpoint directory -> CausalLM with every tensor checked, streamed to the device.

Reads safetensors (single file or sharded with an index): first every shard's header, checked
against the file's size (a truncated shard, or a header whose shapes disagree with its byte offsets,
is a one-line error naming the file), then the names and shapes against the model built on the meta
device (a missing, unknown or mis-shaped tensor is an error naming it) before any data is read;
then the tensors one by one, each cast and moved to the device as it is read, so host memory holds
about one tensor at a time. A progress bar counts the shards (shown at log level info).

Maps checkpoint keys onto the module's names (an identity map after the trunk prefix, plus the
packing table below). Packing table:
- per-expert MoE weights `experts.{e}.{gate,up,down}_proj` -> fused 3-D `experts.gate_up_proj`,
  `experts.down_proj` (what transformers 5 stores), written expert by expert into the device tensor;
- Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` (rows grouped per key head) -> rows regrouped as
  [q all | k all | v all | z all] and [b all | a all], the Qwen3.5 order;
- at load, once: the projections one step kernel reads together become row blocks of one tensor
  (`FUSED`), each module keeping its own name as a view, so the fused Triton step reads them
  with one GEMM (`fused_weight`) and nothing rewrites the model afterwards.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from nextn.config import ModelConfig, resolve_device, resolve_dtype
from nextn.models.qwen3_5 import CausalLM

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PER_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_IGNORED = ("model.visual.", "visual.", "model.vision_tower.")
# Linear children of one module whose weights one step GEMM reads, in row order
FUSED = (
    ("q_proj", "k_proj", "v_proj"),  # attention
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # Qwen3.5 GDN
    ("in_proj_qkvz", "in_proj_ba"),  # Qwen3-Next GDN
)
# bytes per element of the safetensors dtypes
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint's files or tensors do not match its config (or their own headers)."""


def safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a weight_map)") from None
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: shard(s) listed in the index are missing: {missing}")
    return files


def read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """A shard's tensor names and shapes, its header checked against the file: every tensor's byte
    range must hold its shape and dtype, and the file must hold every byte range."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else size
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes, short of its own header); download it again")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    shapes, data_end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name}") from None
        if dtype not in _ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}, which nextn does not load")
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if end - begin != nbytes:
            raise CheckpointError(
                f"{path}: corrupt header: tensor {name} of shape {list(shape)} {dtype} needs {nbytes} bytes, "
                f"its offsets give {end - begin}"
            )
        shapes[name], data_end = shape, max(data_end, end)
    if data_end > size - 8 - n:
        raise CheckpointError(
            f"{path}: truncated (its tensors need {data_end} bytes of data, the file holds {size - 8 - n}); "
            "download it again"
        )
    return shapes


def _module_key(ckpt_key: str, cfg: ModelConfig) -> str | None:
    """Checkpoint key -> module key; None for tensors nextn ignores (vision tower)."""
    if ckpt_key.startswith(_IGNORED):
        return None
    if ckpt_key.startswith(cfg.weight_prefix):
        return "model." + ckpt_key[len(cfg.weight_prefix) :]
    return ckpt_key  # lm_head.*, mtp.*, or unknown (caught by the name check)


class _Expert(NamedTuple):
    """Where a per-expert tensor goes in its packed 3-D tensor: rows [row, row + rows) of expert e."""

    packed: str
    e: int
    row: int


class CheckpointPlan(NamedTuple):
    """What the shards hold, read from their headers: the module tensors' shapes (experts packed)
    and, per shard, each checkpoint key's module name or packed-expert slot."""

    shapes: dict[str, tuple[int, ...]]
    keys: dict[Path, dict[str, str | _Expert]]


def plan_checkpoint(files: list[Path], cfg: ModelConfig) -> CheckpointPlan:
    shapes: dict[str, tuple[int, ...]] = {}
    keys: dict[Path, dict[str, str | _Expert]] = {}
    experts: dict[str, dict[str, dict[int, tuple[int, ...]]]] = {}  # pre -> proj -> e -> shape
    per_expert: list[tuple[Path, str, re.Match]] = []
    for path in files:
        keys[path] = {}
        for key, shape in read_header(path).items():
            name = _module_key(key, cfg)
            if name is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue  # the vision tower; the copy of the embeddings some tied exports store
            m = _PER_EXPERT.match(name)
            if m:
                experts.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["e"])] = shape
                per_expert.append((path, key, m))
            else:
                keys[path][key], shapes[name] = name, shape
    for pre, projs in experts.items():
        shapes.update(_pack_experts(pre, projs))
    for path, key, m in per_expert:
        packed = f"{m['pre']}.down_proj" if m["proj"] == "down_proj" else f"{m['pre']}.gate_up_proj"
        row = experts[m["pre"]]["gate_proj"][0][0] if m["proj"] == "up_proj" else 0
        keys[path][key] = _Expert(packed, int(m["e"]), row)
    return CheckpointPlan(shapes, keys)


def _pack_experts(pre: str, projs: dict[str, dict[int, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    """The packed shapes of one layer's per-expert tensors, checked complete and uniform."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if proj not in projs:
            raise CheckpointError(f"missing tensor: {pre}.*.{proj}.weight")
    num = len(projs["down_proj"])
    for proj, by_e in projs.items():
        if sorted(by_e) != list(range(num)):
            raise CheckpointError(f"{pre}.*.{proj}: experts {sorted(by_e)} are not 0..{num - 1}")
        odd = [e for e, shape in by_e.items() if shape != by_e[0]]
        if odd:
            raise CheckpointError(f"{pre}.{odd[0]}.{proj}.weight has shape {by_e[odd[0]]}, expert 0's {by_e[0]}")
    gate, up, down = (projs[p][0] for p in ("gate_proj", "up_proj", "down_proj"))
    return {f"{pre}.gate_up_proj": (num, gate[0] + up[0], *gate[1:]), f"{pre}.down_proj": (num, *down)}


def _regroup_next(name: str, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Qwen3-Next's GDN projections, grouped per key head in the checkpoint, in the Qwen3.5 row order."""
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // max(1, nk)
    if name.endswith("linear_attn.in_proj_qkvz.weight"):
        parts = w.view(nk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
    elif name.endswith("linear_attn.in_proj_ba.weight"):
        parts = w.view(nk, 2 * r, -1).split([r, r], dim=1)
    else:
        return w
    return torch.cat([p.reshape(-1, w.shape[-1]) for p in parts])


def fuse_weights(model: CausalLM) -> CausalLM:
    """Make each FUSED group's weights row blocks of one tensor (the modules keep views of it)."""
    with torch.no_grad():
        for module in model.modules():
            for names in FUSED:
                if not all(hasattr(module, n) for n in names):
                    continue
                linears = [getattr(module, n) for n in names]
                fused = torch.cat([m.weight.detach() for m in linears]).contiguous()
                start = 0
                for m in linears:
                    n = m.weight.shape[0]
                    m.weight = torch.nn.Parameter(fused[start : start + n], requires_grad=False)
                    start += n
    return model


def fused_weight(*linears) -> torch.Tensor:
    """The tensor whose consecutive row blocks the linears' weights are (`fuse_weights` made it)."""
    first = linears[0].weight
    rows = 0
    for m in linears:
        w = m.weight
        if (
            w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or w.storage_offset() != first.storage_offset() + rows * first.shape[1]
            or not w.is_contiguous()
        ):
            raise ValueError("the model's weights are not fused: load it with nextn.models.loader (fuse_weights)")
        rows += w.shape[0]
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


def count_mtp_layers(names) -> int:
    layers = {int(m[1]) for n in names if (m := re.match(r"^mtp\.layers\.(\d+)\.", n))}
    return max(layers) + 1 if layers else 0


def load_model(model_dir: str | Path, device: str = "cpu", dtype: str = "float32") -> CausalLM:
    """The checkpoint's model on `device` in `dtype` (either may be "auto": see
    nextn.config.resolve_device and resolve_dtype), every tensor checked against the config before
    any is read."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf(model_dir)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device, cfg.dtype)
    files = safetensor_files(model_dir)
    plan = plan_checkpoint(files, cfg)
    num_mtp = count_mtp_layers(plan.shapes)
    if num_mtp > 1:
        raise CheckpointError(f"checkpoint has {num_mtp} MTP layers; nextn runs one (mtp.layers.0)")
    if num_mtp == 0 and cfg.mtp_num_hidden_layers > 0:
        log.warning(
            "%s declares an MTP layer but has no mtp.* tensors (dropped by a conversion?); speculative decoding is off",
            model_dir,
        )
    with torch.device("meta"):
        model = CausalLM(cfg, num_mtp_layers=num_mtp)
    check_tensors(model, plan.shapes)
    t0 = time.perf_counter()
    state = stream_tensors(plan, cfg, torch.device(device), DTYPES[dtype])
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = type(model.rotary)(cfg.rotary_dim, cfg.rope_theta).to(device)
    log.info("loaded %s on %s as %s in %.1f s", model_dir, device, dtype, time.perf_counter() - t0)
    return fuse_weights(model.eval())


def stream_tensors(plan: CheckpointPlan, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> dict:
    """The module tensors on `device` in `dtype`, read one at a time: host memory holds one tensor
    (and its cast) while the device fills up."""
    state = {
        name: torch.empty(plan.shapes[name], device=device, dtype=dtype)
        for k in plan.keys.values()
        for name in {slot.packed for slot in k.values() if isinstance(slot, _Expert)}
    }
    for path in tqdm(plan.keys, desc="loading", unit="shard", disable=not log.isEnabledFor(logging.INFO)):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key, slot in plan.keys[path].items():
                    _place(state, slot, f.get_tensor(key), cfg, device, dtype)  # no name keeps it after
        except SafetensorError as e:
            raise CheckpointError(f"{path}: {e}") from None
    return state


def _place(state: dict, slot: str | _Expert, t: torch.Tensor, cfg: ModelConfig, device, dtype) -> None:
    """One checkpoint tensor into the state: cast and moved, or copied into its expert's rows."""
    if isinstance(slot, _Expert):
        state[slot.packed][slot.e, slot.row : slot.row + t.shape[0]].copy_(t)
    else:
        state[slot] = _regroup_next(slot, t, cfg).to(device=device, dtype=dtype)


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
