"""A Hugging Face checkpoint's layout, read from its files' headers without loading a tensor: which
tensor of which shard goes where in the model, with which scales.

Lists the safetensors files (single file or sharded with an index) and reads every shard's header,
checked against the file's size (a truncated shard, or a header whose shapes disagree with its byte
offsets, is a one-line error naming the file). Maps checkpoint keys onto the module's names (an
identity map after the trunk prefix; the vision tower is skipped) and packs per-expert MoE weights
`experts.{e}.{gate,up,down}_proj` into fused 3-D `experts.gate_up_proj`, `experts.down_proj` (what
transformers 5 stores): each per-expert tensor's slot is its expert's rows of the packed tensor.
FP8 checkpoints (a `quantization_config`, nextn.config.model.QuantConfig): each scale tensor
(`*.weight_scale_inv` per block, `*.weight_scale` per channel) is checked against its e4m3 weight
and planned in nextn's layout (nextn.ops.fp8). Under tensor parallelism each shape is the rank's
part (nextn.parallel.shard). Qwen3-Next's GDN projections, grouped per key head in the checkpoint,
take the Qwen3.5 row order (`regroup_next`, the loader's and the GGUF reader's).

Does not read tensor data, build the model or know its modules: nextn.models.loader checks the plan
against the model, streams the tensors in, regroups Qwen3-Next's projections, quantizes at load and
fuses.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import NamedTuple

import torch

from nextn.config.model import ModelConfig, QuantConfig
from nextn.ops.fp8 import scale_shape
from nextn.parallel.shard import Split, split_of

log = logging.getLogger(__name__)

# a config's dtype as safetensors names it (its weight matrices are expected in it)
_HEADER_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}

_PER_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_IGNORED = ("model.visual.", "visual.", "model.vision_tower.")
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


class TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F8_E4M3", ...


def read_header(path: Path) -> dict[str, TensorInfo]:
    """A shard's tensor names, shapes and dtypes, its header checked against the file: every
    tensor's byte range must hold its shape and dtype, and the file must hold every byte range."""
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
        shapes[name], data_end = TensorInfo(shape, dtype), max(data_end, end)
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


class Slot(NamedTuple):
    """Where a checkpoint tensor goes: module tensor `name`, or for a per-expert tensor expert e's
    rows [row, row + n) of the packed tensor `name` (for its scales: those columns). `scale`
    (kind "block" | "channel", rows per block, the weight's N, K): a checkpoint scale, converted to
    nextn's layout; `quantize`: a bf16 weight quantized as it arrives (quantization="fp8");
    `split`: the part a rank keeps under tensor parallelism."""

    name: str
    e: int | None = None
    row: int = 0
    scale: tuple[str, int, int, int] | None = None
    quantize: bool = False
    split: Split | None = None


class CheckpointPlan(NamedTuple):
    """What the shards hold, read from their headers: the module tensors' shapes (experts packed,
    FP8 scales in nextn's layout; a rank's parts under tensor parallelism), per shard each
    checkpoint key's slot, the module weights held in FP8 (a module's `weight` or a packed expert
    tensor; its scales are `name + "_scale"`), and the (rank, size) the shapes are cut for."""

    shapes: dict[str, tuple[int, ...]]
    keys: dict[Path, dict[str, Slot]]
    fp8: frozenset[str] = frozenset()
    tp: tuple[int, int] = (0, 1)


def warn_dtype_mismatch(found: dict[str, tuple[Path, TensorInfo]], config_dtype: str | None) -> list[str]:
    """Log a warning per shard whose weight matrices (2-D and up, not FP8 or scales) are stored in
    another dtype than config.json's `dtype` / `torch_dtype` says: a header that calls bf16 bytes
    F16 loads without error and the model emits garbage. Returns the warnings."""
    expected = _HEADER_DTYPE.get(config_dtype or "")
    if expected is None:
        return []
    other: dict[Path, dict[str, int]] = {}
    for key, (path, info) in found.items():
        if len(info.shape) >= 2 and info.dtype in _HEADER_DTYPE.values() and info.dtype != expected:
            if not key.endswith(("_scale", "_scale_inv")):
                counts = other.setdefault(path, {})
                counts[info.dtype] = counts.get(info.dtype, 0) + 1
    warnings = []
    for path, counts in other.items():
        listed = ", ".join(f"{n} {dtype}" for dtype, n in sorted(counts.items()))
        warnings.append(
            f"{path}: {listed} weight tensors, but config.json says {config_dtype} ({expected}): if the bytes "
            f"are {config_dtype}, the header misnames them and the model's output will be garbage"
        )
        log.warning(warnings[-1])
    return warnings


def plan_checkpoint(files: list[Path], cfg: ModelConfig, tp: tuple[int, int] = (0, 1)) -> CheckpointPlan:
    """cfg: the whole model's; tp (rank, size): the part of each tensor this rank loads."""
    found = {key: (path, info) for path in files for key, info in read_header(path).items()}
    warn_dtype_mismatch(found, cfg.dtype)
    size = tp[1]

    def local(name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], Split | None]:
        split = split_of(name, shape, cfg) if size > 1 else None
        return (shape if split is None else split.local_shape(shape, size)), split

    quant = cfg.quantization if cfg.quantization is not None and not cfg.quantization.at_load else None
    scales = _scale_keys(found, quant)  # scale key -> its weight's key
    shapes: dict[str, tuple[int, ...]] = {}
    keys: dict[Path, dict[str, Slot]] = {path: {} for path in files}
    experts: dict[str, dict[str, dict[int, tuple[int, ...]]]] = {}  # pre -> proj -> e -> shape
    per_expert: list[tuple[Path, str, re.Match]] = []
    fp8 = set()
    for key, (path, info) in found.items():
        name = _module_key(scales.get(key, key), cfg)  # a scale goes where its weight goes
        if name is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue  # the vision tower; the copy of the embeddings some tied exports store
        m = _PER_EXPERT.match(name)
        if m:
            if key not in scales:
                experts.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["e"])] = local(name, info.shape)[0]
            per_expert.append((path, key, m))
        elif key in scales:
            n, k = found[scales[key]][1].shape
            keys[path][key], shapes[name + "_scale"] = (
                Slot(name + "_scale", scale=_scale_kind(quant, n, k)),
                scale_shape(n, k),
            )
        else:
            shapes[name], split = local(name, info.shape)
            keys[path][key] = Slot(name, split=split)
            if info.dtype == "F8_E4M3":
                fp8.add(name)
    for pre, projs in experts.items():
        shapes.update(_pack_experts(pre, projs))
    packed_dtypes: dict[str, set[str]] = {}
    for path, key, m in per_expert:
        packed = f"{m['pre']}.down_proj" if m["proj"] == "down_proj" else f"{m['pre']}.gate_up_proj"
        row = experts[m["pre"]]["gate_proj"][0][0] if m["proj"] == "up_proj" else 0
        if key in scales:
            n, k = found[scales[key]][1].shape
            keys[path][key] = Slot(packed + "_scale", int(m["e"]), row, _scale_kind(quant, n, k))
        else:
            keys[path][key] = Slot(packed, int(m["e"]), row, split=local(_module_key(key, cfg), found[key][1].shape)[1])
            packed_dtypes.setdefault(packed, set()).add(found[key][1].dtype)
    for packed, dtypes in packed_dtypes.items():
        if "F8_E4M3" in dtypes:
            if len(dtypes) > 1:
                raise CheckpointError(f"the experts of {packed} mix dtypes {sorted(dtypes)}")
            *lead, n, k = shapes[packed]
            shapes[packed + "_scale"] = (*lead, *scale_shape(n, k))
            fp8.add(packed)
    return CheckpointPlan(shapes, keys, frozenset(fp8), tp)


def _scale_keys(found: dict[str, tuple[Path, TensorInfo]], quant: QuantConfig | None) -> dict[str, str]:
    """The checkpoint's FP8 scale tensors -> their weights' keys, checked: each scale has an e4m3
    weight and the shape its method gives that weight; each e4m3 weight has its scale."""
    if quant is None:
        odd = sorted(k for k, (_, info) in found.items() if info.dtype == "F8_E4M3" or k.endswith(_SCALE_NAMES))
        if odd:
            raise CheckpointError(
                f"tensor {odd[0]} is FP8 (e4m3 or a scale) but config.json has no quantization_config"
            )
        return {}
    suffix = "." + quant.scale_suffix
    out = {}
    for key, (_, info) in found.items():
        if not key.endswith(suffix):
            continue
        weight_key = key.removesuffix(suffix) + ".weight"
        if weight_key not in found:
            raise CheckpointError(f"scale tensor {key} has no weight {weight_key}")
        weight = found[weight_key][1]
        if weight.dtype != "F8_E4M3":
            raise CheckpointError(f"scale tensor {key}: its weight {weight_key} is {weight.dtype}, not F8_E4M3")
        expected = _scale_shapes(weight.shape, quant)
        if len(weight.shape) != 2 or info.shape not in expected:
            raise CheckpointError(
                f"tensor {key} has shape {list(info.shape)}, expected {list(expected[0])} "
                f"(the {quant.method} scales of the e4m3 weight {weight_key} {list(weight.shape)})"
            )
        out[key] = weight_key
    for key, (_, info) in found.items():
        if info.dtype == "F8_E4M3" and key.removesuffix(".weight") + suffix not in out:
            scale = key.removesuffix(".weight") + suffix
            raise CheckpointError(f"missing tensor {scale}: the {quant.method} scales of the e4m3 weight {key}")
    return out


_SCALE_NAMES = (".weight_scale_inv", ".weight_scale")


def _scale_shapes(weight_shape: tuple[int, ...], quant: QuantConfig) -> list[tuple[int, ...]]:
    """The checkpoint shapes a weight's scales may have (the first is the usual one)."""
    n, k = weight_shape[-2:]
    if quant.method == "fp8":
        rows, cols = quant.weight_block_size
        return [(-(-n // rows), -(-k // cols))]
    return [(n, 1), (n,), (1,), ()]  # per channel, or per tensor


def _scale_kind(quant: QuantConfig, n: int, k: int) -> tuple[str, int, int, int]:
    return ("block", quant.weight_block_size[0], n, k) if quant.method == "fp8" else ("channel", 0, n, k)


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


def regroup_next(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Qwen3-Next's GDN projections, grouped per key head in the checkpoint, in the Qwen3.5 row order
    (a weight's rows; the columns of its scales in nextn's layout)."""
    base = name.removesuffix("_scale")
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // max(1, nk)
    if base.endswith("linear_attn.in_proj_qkvz.weight"):
        sizes = [dk, dk, r * dv, r * dv]
    elif base.endswith("linear_attn.in_proj_ba.weight"):
        sizes = [r, r]
    else:
        return t
    parts = torch.arange(nk * sum(sizes)).view(nk, -1).split(sizes, dim=1)
    return t.index_select(-1 if name.endswith("_scale") else 0, torch.cat([p.reshape(-1) for p in parts]))


def count_mtp_layers(names) -> int:
    layers = {int(m[1]) for n in names if (m := re.match(r"^mtp\.layers\.(\d+)\.", n))}
    return max(layers) + 1 if layers else 0
