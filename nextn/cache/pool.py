"""The sequence slots of the cache, allocated once at start, after a check that they fit the
device (an error that says what would fit). Which slot a request gets, and which kept
conversations are evicted, is the scheduler's choice (nextn.engine.scheduler)."""

from __future__ import annotations

from dataclasses import replace

import torch

from nextn.cache.hybrid import KV_BLOCK, CacheLayout, HybridCache, nbytes_of, tensor_specs
from nextn.config import STEP_ROWS
from nextn.model_config import ModelConfig

GiB = 2**30


class CacheMemoryError(ValueError):
    """The cache asked for does not fit the device."""


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:  # Linux: what can be allocated without swapping
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("cannot tell the free memory of this machine (/proc/meminfo has no MemAvailable)")


def check_fits(cfg: ModelConfig, layout: CacheLayout, device: torch.device, dtype: torch.dtype) -> int:
    """Bytes the device keeps free besides the cache; raises CacheMemoryError naming what fits if
    the cache would not leave a tenth of the free memory (at least 1 GiB on a GPU) for
    activations and graphs."""
    need = nbytes_of(tensor_specs(cfg, layout, dtype))
    free = available_bytes(device)
    budget = free - max(free // 10, GiB if device.type == "cuda" else 0)
    if need <= budget:
        return free - need
    S, L = layout.num_slots, layout.max_len
    per_slot = need / S
    longer = replace(layout, max_len=L + KV_BLOCK)  # one more K/V block per slot
    per_token = (nbytes_of(tensor_specs(cfg, longer, dtype)) - need) / (S * KV_BLOCK)  # K/V bytes per position
    max_len = int((budget / S - (per_slot - per_token * layout.capacity)) / per_token) - 2 * STEP_ROWS - KV_BLOCK
    raise CacheMemoryError(
        f"the cache for {S} sequence(s) of {L} tokens needs {need / GiB:.2f} GiB ({per_slot / GiB:.3f} GiB each), "
        f"but {free / GiB:.2f} GiB are free on {device} (a tenth kept back): {max(0, int(budget // per_slot))} "
        f"sequence(s) of {L} tokens fit (--max-num-seqs), or {S} of up to {max(0, max_len)} tokens (--max-model-len)"
    )


class SlotPool:
    def __init__(self, cfg: ModelConfig, layout: CacheLayout, device, dtype: torch.dtype):
        spare = check_fits(cfg, layout, torch.device(device), dtype)
        self.cache = HybridCache(cfg, layout, device, dtype)
        # what captured CUDA graphs may hold (nextn.engine.runner): half of what the cache leaves
        # free, the other half for activations and the allocator's slack
        self.graph_budget = spare // 2

    @property
    def num_slots(self) -> int:
        return self.cache.layout.num_slots

    @property
    def slot_nbytes(self) -> int:
        return self.cache.nbytes // self.num_slots
