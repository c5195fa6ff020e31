"""How many sequences the cache holds: the cache layout of an engine configuration, the bytes of
one sequence's slot, the engine's reserve beside the cache, and `fit_cache`, which resolves
max_num_seqs from the device's memory once the weights are loaded (vLLM's gpu_memory_utilization).

On a GPU, with F = gpu_memory_utilization, `total` its memory and `in_use` what is allocated on it
when the weights are in (the weights, the CUDA context, anything else on the device):

    budget       = F * total - in_use
    max_num_seqs = min(MAX_NUM_SEQS, (budget - reserve.fixed) // (slot + reserve.per_seq))

where `slot` is one sequence's cache (every tensor of nextn.cache.hybrid.tensor_specs: its share of
the attention K/V, the GDN states and step buffers, the draft K/V, and the engine's per-slot
buffers of CacheLayout.extra) and `reserve` what the engine allocates beside the cache, estimated
from the model's shapes (`reserve`). A max_num_seqs given is checked against the same budget. On
the CPU there is no GPU memory to size: max_num_seqs defaults to CPU_MAX_NUM_SEQS (EngineConfig),
checked against the machine's available memory less a tenth, and gpu_memory_utilization does not
apply. Under tensor parallelism every rank sizes its own device and all take the fewest slots.
The prefix cache's bytes (prefix_cache_gb, or PREFIX_CACHE_SHARE of the budget) are set aside
first (`set_aside_prefix`), the same on every rank.

Allocates nothing: the cache is nextn.cache.pool's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from nextn.cache.hybrid import CacheLayout, nbytes_of, tensor_specs
from nextn.cache.pool import Budget, CacheMemoryError, GiB, check_fits, cpu_budget, gpu_budget
from nextn.config import (
    ATTENTION_CHUNK,
    ATTENTION_ROWS,
    PREFILL_CHUNK,
    PREFIX_CACHE_SHARE,
    SCRATCH_SLOTS,
    STEP_ROWS,
    EngineConfig,
)
from nextn.config.model import ModelConfig
from nextn.engine.device_round import round_buffers
from nextn.ops.triton_gdn_chunk import scratch_floats_per_row
from nextn.sample.sampler import sampler_buffers

# graphs' memory beyond the rows of the round they capture (their private pool's slack, the sampler's
# and the proposer's small intermediates): a floor so the graph budget is never zero
GRAPH_RESERVE = 2**30


def cache_layout(
    cfg: ModelConfig,
    max_len: int,
    k: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    num_slots: int = 1,
    scratch: int = 0,
) -> CacheLayout:
    """The cache of num_slots sequences of max_len tokens with up to k drafts a round, and `scratch`
    slots more (nextn.config.SCRATCH_SLOTS): the engine's round and sampler buffers are part of each slot."""
    extra = round_buffers(cfg, k, dtype) + sampler_buffers(cfg.vocab_size, max_len)
    return CacheLayout(
        num_slots + scratch, max_len, k + 1, k > 0, tuple(extra), kv_cache_dtype=kv_cache_dtype, scratch=scratch
    )


def bytes_per_sequence(cfg: ModelConfig, max_len: int, k: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one sequence's slot (every cache tensor is [num_slots, ...]: a slot is an exact share)."""
    return nbytes_of(tensor_specs(cfg, cache_layout(cfg, max_len, k, dtype, kv_cache_dtype), dtype))


class Reserve(NamedTuple):
    """Bytes the engine allocates beside a cache of S sequences: fixed + per_seq * S."""

    fixed: int
    per_seq: int


def activation_bytes_per_row(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """An estimate of what a forward holds per token row at its widest layer: the residual stream,
    its norm, a block's output and the sum (4 rows of H), and the widest block's intermediates:
    - FFN: gate/up, the activation and its product (4 * I; MoE: each routed expert's and the shared
      expert's, and the router's float32 logits);
    - Gated DeltaNet (chunked rule): the q, k, v projection and its conv output, z and o in the
      model dtype; in float32 the l2-normed q and k, the chunk kernels' scratch (u, w, the intra-chunk
      scores, each chunk's first state: nextn.ops.triton_gdn_chunk.scratch_floats_per_row) and the
      gated norm's two rows of value_dim;
    - attention: q with its gate, k, v and the output, twice (rotary and the kernel's copies)."""
    b = dtype.itemsize
    if cfg.num_experts:
        ffn = b * 4 * (cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)
        ffn += 4 * cfg.num_experts
    else:
        ffn = b * 4 * cfg.intermediate_size
    chunk_scratch = scratch_floats_per_row(
        cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    )
    gdn = b * 2 * (cfg.conv_dim + cfg.linear_value_dim) + 4 * (
        2 * cfg.linear_key_dim + chunk_scratch + 2 * cfg.linear_value_dim
    )
    attention = b * 2 * (3 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    return b * 4 * cfg.hidden_size + max(ffn, gdn, attention)


def reserve(cfg: ModelConfig, k: int, dtype: torch.dtype, prefill: str = "chunked", max_len: int = 0) -> Reserve:
    """What the engine allocates beside the cache, estimated from the model's shapes (S sequences,
    R = k + 1 verify rows each):
    - the runner's step and head outputs (nextn.engine.runner.ModelRunner.__init__): float32
      logits [V] and a hidden [H] for each of max(S * R, STEP_ROWS) verify rows, and
      logits and a hidden for each of 2 * S head rows;
    - a round's forward over S * R rows (kept by its CUDA graph): activation_bytes_per_row each,
      and the sampler's float32 work over each row's vocabulary (two [V] rows);
    - an eager prefill forward beside it over PREFILL_CHUNK rows (either mode: a "steps" prefill
      packs an engine step's prompt pieces in one step too), its float32 logits of every row when
      prompt logprobs are asked ([PREFILL_CHUNK, V], and their log-softmax beside them); in steps,
      the step attention's float32 partials of ATTENTION_ROWS rows over max_len's chunks
      (nextn.models.qwen3_5_step: a prefill step's attention runs in blocks of that many rows);
    - GRAPH_RESERVE: the graphs' and the allocator's slack, the kernels' code, cuBLAS workspaces."""
    V, H, b, R = cfg.vocab_size, cfg.hidden_size, dtype.itemsize, k + 1
    step_row = 4 * V + H * b  # float32 logits and a hidden
    act = activation_bytes_per_row(cfg, dtype)
    fixed = STEP_ROWS * step_row + PREFILL_CHUNK * act + GRAPH_RESERVE + 2 * PREFILL_CHUNK * V * 4
    if prefill == "steps":
        chunks = -(-(max_len + 2 * STEP_ROWS) // ATTENTION_CHUNK)
        fixed += ATTENTION_ROWS * cfg.num_attention_heads * chunks * (cfg.head_dim + 2) * 4
    per_seq = R * step_row + 2 * (4 * V + H * b) + R * (act + 2 * 4 * V)
    return Reserve(fixed, per_seq)


def sequences_that_fit(
    cfg: ModelConfig,
    max_len: int,
    k: int,
    nbytes: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    prefill: str = "chunked",
) -> int:
    """How many sequences of max_len tokens, drafting up to k tokens a round, fit in nbytes (what the
    engine may take once the weights are in: F * total - in_use on a GPU) beside the engine's
    reserve: at most MAX_NUM_SEQS, 0 when not one does. Needs the config alone (no device, no weights)."""
    r = reserve(cfg, k, dtype, prefill, max_len)
    return Budget(nbytes, r.fixed, r.per_seq).sequences(bytes_per_sequence(cfg, max_len, k, dtype, kv_cache_dtype))


def memory_budget(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> Budget:
    """What the cache of this configuration may take on its device, read now (after the weights)."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return cpu_budget(device)
    r = reserve(cfg, config.spec.num_speculative_tokens, dtype, config.prefill, config.max_model_len)
    return gpu_budget(device, config.gpu_memory_utilization, r.fixed, r.per_seq)


def fit_cache(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> tuple[EngineConfig, Budget]:
    """config with max_num_seqs resolved (None on a GPU: what fits the budget, the same count on
    every tensor-parallel rank), and the budget the pool checks its cache against. Not one
    sequence fitting is a CacheMemoryError that says what would (a shorter context, more of the GPU)."""
    budget = set_aside_prefix(config, memory_budget(cfg, config, dtype))
    if config.max_num_seqs is not None:
        return config, budget
    k = config.spec.num_speculative_tokens
    slot = bytes_per_sequence(cfg, config.max_model_len, k, dtype, config.kv_cache_dtype)
    num_seqs = _fewest(budget.sequences(slot), config.tensor_parallel_size)
    if num_seqs < 1:  # check_fits says what does fit
        layout = cache_layout(cfg, config.max_model_len, k, dtype, config.kv_cache_dtype, scratch=SCRATCH_SLOTS)
        check_fits(cfg, layout, dtype, budget)
        raise CacheMemoryError("another tensor-parallel rank's memory fits not one sequence (its error says what does)")
    return replace(config, max_num_seqs=num_seqs), budget


def set_aside_prefix(config: EngineConfig, budget: Budget) -> Budget:
    """The budget less what the prefix cache may hold, that in its `prefix`: prefix_cache_gb, else
    PREFIX_CACHE_SHARE of what the budget leaves beside the reserve; under tensor parallelism the
    fewest bytes of any rank (every rank must evict alike: their steps run together)."""
    if not config.enable_prefix_caching:
        return budget
    if config.prefix_cache_gb is not None:
        nbytes = int(config.prefix_cache_gb * GiB)
    else:
        nbytes = int(max(0, budget.nbytes - budget.fixed) * PREFIX_CACHE_SHARE)
    nbytes = _fewest(nbytes, config.tensor_parallel_size)
    return budget._replace(nbytes=budget.nbytes - nbytes, prefix=nbytes)


def _fewest(num_seqs: int, tensor_parallel_size: int) -> int:
    """Under tensor parallelism every rank holds the same slots: the fewest any rank's memory fits."""
    from nextn.parallel.launch import initialized

    if tensor_parallel_size == 1 or not initialized():
        return num_seqs
    import torch.distributed as dist

    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, num_seqs)
    return min(counts)
