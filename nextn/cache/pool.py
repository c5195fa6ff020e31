"""The sequence slots of the cache, allocated once at start, after a check that they fit the
memory budget (an error that says what would fit), and that budget: on a GPU what
gpu_memory_utilization of its total memory leaves once the weights are in, on the CPU the
machine's available memory less a tenth; less, beside the cache, the engine's reserve for its own
buffers, activations and graphs (estimated from the model's shapes by nextn.engine.memory, which
also sizes max_num_seqs with it). Which slot a request gets, and which kept conversations are
evicted, is the scheduler's choice (nextn.engine.scheduler)."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from nextn.cache.hybrid import KV_BLOCK, CacheLayout, HybridCache, nbytes_of, tensor_specs
from nextn.config import MAX_NUM_SEQS, SCRATCH_SLOTS, STEP_ROWS
from nextn.config.model import ModelConfig

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


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of a CUDA device, after torch's cached but unused blocks went back
    (else they would count as in use)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total, free


class Budget(NamedTuple):
    """The memory the engine may still take, `nbytes`, of which `fixed + per_seq * S` stays
    beside a cache of S sequences for the engine's buffers, activations and graphs."""

    nbytes: int
    fixed: int = 0
    per_seq: int = 0
    where: str = ""  # what nbytes is a part of, for messages: "0.9 of the GPU's 79.1 GiB"
    in_use: int | None = None  # a GPU's bytes in use when it was read (the weights, the CUDA context, ...)
    tensors: int | None = None  # of in_use, the bytes of torch's live tensors (the rest: context, libraries, kernels)
    gpu: bool = False  # sized by gpu_memory_utilization (the flag an error can name)
    prefix: int = 0  # bytes set aside for the prefix cache (not in nbytes)

    def cache_bytes(self, num_seqs: int) -> int:
        """What a cache of num_seqs sequences may take."""
        return self.nbytes - self.fixed - self.per_seq * num_seqs

    def sequences(self, slot_nbytes: float) -> int:
        """How many sequences' slots of slot_nbytes fit beside the reserve and the SCRATCH_SLOTS (at most
        MAX_NUM_SEQS; 0: none)."""
        room = self.nbytes - self.fixed - SCRATCH_SLOTS * slot_nbytes
        return max(0, min(MAX_NUM_SEQS, int(room // (slot_nbytes + self.per_seq))))

    def describe(self) -> str:
        """Where the budget comes from, with what was in use and what the prefix cache holds: for an error."""
        where = self.where
        if self.in_use is not None and self.tensors is not None:
            where += (
                f" (less {self.in_use / GiB:.2f} GiB in use: {self.tensors / GiB:.2f} GiB of tensors, the weights "
                f"among them, and {(self.in_use - self.tensors) / GiB:.2f} GiB beside them: the CUDA context, "
                "libraries' workspaces, kernels' local memory)"
            )
        elif self.in_use is not None:
            where += f" (less {self.in_use / GiB:.2f} GiB in use: the weights, the CUDA context, ...)"
        if self.prefix:
            where += f", less {self.prefix / GiB:.2f} GiB for the prefix cache (--prefix-cache-gb)"
        return where

    def summary(self) -> str:
        """Where the budget comes from: for the start-up line."""
        return self.where if self.gpu else f"{self.where}; gpu_memory_utilization sizes GPUs only"


def gpu_budget(device: torch.device, utilization: float, fixed: int, per_seq: int) -> Budget:
    """gpu_memory_utilization of the GPU's total memory less what is in use on it now."""
    total, free = device_memory(device)
    where = f"{utilization:g} of the GPU's {total / GiB:.1f} GiB"
    in_use = total - free
    return Budget(int(utilization * total) - in_use, fixed, per_seq, where, in_use, tensor_bytes(device), gpu=True)


def tensor_bytes(device: torch.device) -> int:
    """Bytes of torch's live tensors on a CUDA device (what its allocator hands out, not what it caches)."""
    return torch.cuda.memory_allocated(device)


def cpu_budget(device: torch.device) -> Budget:
    """The machine's available memory, a tenth kept back."""
    free = available_bytes(device)
    return Budget(free - free // 10, where=f"{free / GiB:.2f} GiB free on {device} (a tenth kept back)")


def check_fits(cfg: ModelConfig, layout: CacheLayout, dtype: torch.dtype, budget: Budget) -> None:
    """Raises CacheMemoryError naming what fits (slots, or the context) if the cache would not fit
    the budget beside the reserve."""
    need = nbytes_of(tensor_specs(cfg, layout, dtype))
    S, L, slots = layout.sequences, layout.max_len, layout.num_slots  # (slots: the scratch ones too)
    room = budget.cache_bytes(S)
    if need <= room:
        return
    per_slot = need / slots
    longer = replace(layout, max_len=L + KV_BLOCK)  # one more K/V block per slot
    per_token = (nbytes_of(tensor_specs(cfg, longer, dtype)) - need) / (slots * KV_BLOCK)  # K/V bytes per position
    max_len = int((room / slots - (per_slot - per_token * layout.capacity)) / per_token) - 2 * STEP_ROWS - KV_BLOCK
    reserve = budget.fixed + budget.per_seq * S
    kept = f" beside a {reserve / GiB:.2f} GiB reserve for activations and graphs" if reserve else ""
    shorter = f", or {S} of up to {max_len} tokens (--max-model-len)" if max_len >= 2 else ""  # (no context fits)
    scratch = f" (and {layout.scratch} scratch slot)" if layout.scratch else ""
    raise CacheMemoryError(
        f"the cache for {S} sequence(s){scratch} of {L} tokens needs {need / GiB:.2f} GiB "
        f"({per_slot / GiB:.3f} GiB each), "
        f"but {budget.describe()} leaves {max(0, room) / GiB:.2f} GiB for it{kept}: {budget.sequences(per_slot)} "
        f"sequence(s) of {L} tokens fit (--max-num-seqs){shorter}"
        + (", or raise --gpu-memory-utilization" if budget.gpu else "")
    )


class SlotPool:
    def __init__(self, cfg: ModelConfig, layout: CacheLayout, device, dtype: torch.dtype, budget: Budget):
        check_fits(cfg, layout, dtype, budget)
        self.cache, self.budget = HybridCache(cfg, layout, device, dtype), budget
        # what captured CUDA graphs may hold (nextn.engine.runner): half of what the budget leaves
        # beside the cache, the other half for activations and the allocator's slack
        self.graph_budget = max(0, budget.nbytes - self.cache.nbytes) // 2

    @property
    def num_slots(self) -> int:
        """Every slot, the scratch ones (no request's: nextn.config.SCRATCH_SLOTS) last."""
        return self.cache.layout.num_slots

    @property
    def sequences(self) -> int:
        """The slots requests may hold."""
        return self.cache.layout.sequences

    @property
    def scratch_slots(self) -> list[int]:
        return list(range(self.sequences, self.num_slots))

    @property
    def slot_nbytes(self) -> int:
        return self.cache.nbytes // self.num_slots

    def describe(self) -> str:
        """The start-up line: the slots, their size, and the budget they were checked against."""
        layout = self.cache.layout
        scratch = f" with {layout.scratch} scratch slot" if layout.scratch else ""
        return (
            f"cache: {layout.sequences} sequences of {layout.max_len} tokens ({self.slot_nbytes / GiB:.3f} GiB each, "
            f"{self.cache.nbytes / GiB:.2f} GiB total{scratch}; {self.budget.summary()})"
        )
