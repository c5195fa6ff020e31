"""Writing what training produces: a Hugging Face checkpoint directory (config.json, safetensors
shards each under a size limit with model.safetensors.index.json, tokenizer files) and the
resumable training state (fp32 weights, optimizer, step, data position, elapsed time).

A checkpoint is written to a temporary sibling and renamed into place, so a run killed while
saving leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from nextn.train.tokenizer import TOKENIZER_FILES

STATE_FILE = "state.pt"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shard_tensors(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in key order; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> None:
    """`model-0000i-of-0000N.safetensors` shards plus model.safetensors.index.json."""
    shards = shard_tensors(tensors, max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_checkpoint(
    model: torch.nn.Module,
    hf_config: dict,
    tokenizer_dir: Path,
    out_dir: Path,
    dtype: str,
    max_shard_bytes: int,
) -> None:
    """The model's state_dict (keys are the checkpoint's keys) as a HF checkpoint in `out_dir`."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in model.state_dict().items()}
    write_safetensors(tensors, tmp, max_shard_bytes)
    (tmp / "config.json").write_text(json.dumps({**hf_config, "dtype": dtype}, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, tmp / name)
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def save_state(run_dir: Path, state: dict) -> None:
    tmp = run_dir / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(run_dir / STATE_FILE)


def load_state(run_dir: Path) -> dict | None:
    path = run_dir / STATE_FILE
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None
