"""Hugging Face checkpoint directory -> CausalLM with every tensor checked.

Reads safetensors (single file or sharded with an index), maps checkpoint keys onto the module's
names (an identity map after the trunk prefix, plus one packing rule for per-expert MoE weights),
and fails with an error naming the tensor when one is missing, unknown or mis-shaped.
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
                    tensors[name] = f.get_tensor(key)
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
        print(f"nextn: {model_dir} declares an MTP layer but has no mtp.* tensors "
              "(dropped by a conversion?); speculative decoding is off", file=sys.stderr)
    with torch.device("meta"):
        model = CausalLM(cfg, num_mtp_layers=num_mtp)
    check_tensors(model, tensors)
    torch_dtype = DTYPES[dtype]
    state = {k: t.to(device=device, dtype=torch_dtype) for k, t in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = type(model.rotary)(cfg.rotary_dim, cfg.rope_theta).to(device)
    return model.eval()


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
