"""Hugging Face checkpoint directory -> CausalLM with every tensor checked.

Reads safetensors (single file or sharded with an index), maps checkpoint keys onto the module's
names (an identity map after the trunk prefix, plus the packing table below), and fails with an
error naming the tensor when one is missing, unknown or mis-shaped.

Packing table:
- per-expert MoE weights `experts.{e}.{gate,up,down}_proj` -> fused 3-D `experts.gate_up_proj`,
  `experts.down_proj` (what transformers 5 stores);
- Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` (rows grouped per key head) -> rows regrouped as
  [q all | k all | v all | z all] and [b all | a all], the Qwen3.5 order;
- at load, once: the projections one step kernel reads together become row blocks of one tensor
  (`FUSED`), each module keeping its own name as a view, so the fused Triton step reads them
  with one GEMM (`fused_weight`) and nothing rewrites the model afterwards.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from nextn.config import ModelConfig
from nextn.models.qwen3_5 import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PER_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_IGNORED = ("model.visual.", "visual.", "model.vision_tower.")
# Linear children of one module whose weights one step GEMM reads, in row order
FUSED = (
    ("q_proj", "k_proj", "v_proj"),  # attention
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # Qwen3.5 GDN
    ("in_proj_qkvz", "in_proj_ba"),  # Qwen3-Next GDN
)


class CheckpointError(ValueError):
    """A checkpoint's tensors do not match its config."""


def safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: shard(s) listed in the index are missing: {missing}")
    return files


def _module_key(ckpt_key: str, cfg: ModelConfig) -> str | None:
    """Checkpoint key -> module key; None for tensors nextn ignores (vision tower)."""
    if ckpt_key.startswith(_IGNORED):
        return None
    if ckpt_key.startswith(cfg.weight_prefix):
        return "model." + ckpt_key[len(cfg.weight_prefix) :]
    return ckpt_key  # lm_head.*, mtp.*, or unknown (caught by the name check)


def read_checkpoint(model_dir: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors the model uses, under module names, per-expert weights packed to 3-D."""
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for path in safetensor_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = _module_key(key, cfg)
                if name is None:
                    continue
                m = _PER_EXPERT.match(name)
                if m:
                    experts.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["e"])] = f.get_tensor(key)
                else:
                    tensors[name] = _regroup_next(name, f.get_tensor(key), cfg)
    for pre, projs in experts.items():
        tensors.update(_pack_experts(pre, projs))
    return tensors


def _pack_experts(pre: str, projs: dict[str, dict[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if proj not in projs:
            raise CheckpointError(f"missing tensor: {pre}.*.{proj}.weight")
    ids = sorted(projs["down_proj"])
    for proj, by_e in projs.items():
        if sorted(by_e) != list(range(len(ids))):
            raise CheckpointError(f"{pre}.*.{proj}: experts {sorted(by_e)} are not 0..{len(ids) - 1}")
    gate_up = torch.stack([torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], 0) for e in ids])
    down = torch.stack([projs["down_proj"][e] for e in ids])
    return {f"{pre}.gate_up_proj": gate_up, f"{pre}.down_proj": down}


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
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf(model_dir)
    tensors = read_checkpoint(model_dir, cfg)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied exports store the copy too
    num_mtp = count_mtp_layers(tensors)
    if num_mtp > 1:
        raise CheckpointError(f"checkpoint has {num_mtp} MTP layers; nextn runs one (mtp.layers.0)")
    if num_mtp == 0 and cfg.mtp_num_hidden_layers > 0:
        print(
            f"nextn: {model_dir} declares an MTP layer but has no mtp.* tensors "
            "(dropped by a conversion?); speculative decoding is off",
            file=sys.stderr,
        )
    with torch.device("meta"):
        model = CausalLM(cfg, num_mtp_layers=num_mtp)
    check_tensors(model, tensors)
    torch_dtype = DTYPES[dtype]
    state = {k: t.to(device=device, dtype=torch_dtype) for k, t in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = type(model.rotary)(cfg.rotary_dim, cfg.rope_theta).to(device)
    return fuse_weights(model.eval())


def check_tensors(model: CausalLM, tensors: dict[str, torch.Tensor]) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise CheckpointError(f"unknown tensor(s) in checkpoint: {unknown[:8]}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"missing tensor(s) in checkpoint: {missing[:8]}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
