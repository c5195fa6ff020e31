"""The collectives of a tensor-parallel forward, shared by the reference modules and the fused step:
the all-reduce that ends each row-parallel block, the vocabulary-parallel embedding lookup and the
logits gather. With cfg.tp_size == 1 each is the plain single-device operation.

Exactness: `all_reduce` gathers the ranks' partial sums (the collective moves bytes and adds
nothing) and adds them here in rank order. So a row's sum is the same on every rank, run to run,
and whatever the number of rows in the step: batch-invariant, which greedy
spec == plain needs (a verify row must equal the decode of the same token bitwise). NCCL's own
all-reduce gives none of this past two ranks (its ring splits a message into chunks by its size, so
an element's order of addition follows the row count), and no NCCL_ALGO / NCCL_PROTO setting is
needed for exactness here. Gathered logits are bitwise the same on every rank, so every rank's
sampler draws the same tokens. Collectives run on the default process group (nextn.parallel.launch
makes one process per rank, all of them tensor-parallel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nextn.config import ModelConfig

# torch >= 2.13 names the concatenating all-gather all_gather_single (all_gather_into_tensor before)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather(x: torch.Tensor, size: int) -> torch.Tensor:
    """Every rank's x, stacked in rank order: [size, *x.shape]."""
    out = x.new_empty(size * x.shape[0], *x.shape[1:])
    _all_gather(out, x.contiguous())
    return out.view(size, *x.shape)


def all_reduce(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The sum of the ranks' x (partial sums of a row-parallel block) in rank order, ((x0 + x1) + x2)
    + ..., each addition in x's dtype: the same bits on every rank and for every row count. (With two
    ranks that one bf16 / fp16 addition is the float32 sum rounded once: float32 carries more than
    twice their bits, so the double rounding is exact.)"""
    if cfg.tp_size == 1:
        return x
    parts = gather(x, cfg.tp_size)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def embed(ids: torch.Tensor, weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Embeddings of ids [...] from this rank's rows of the table [ceil(V / N), H]: each rank looks
    up the ids it holds (zeros for the others), and the sum over ranks is exact (one term is not zero)."""
    if cfg.tp_size == 1:
        return F.embedding(ids, weight)
    rows = weight.shape[0]
    local = ids - cfg.tp_rank * rows
    held = (local >= 0) & (local < rows)
    x = F.embedding(local.clamp(0, rows - 1), weight).masked_fill(~held[..., None], 0)
    return all_reduce(x, cfg)


def gather_vocab(local: torch.Tensor, cfg: ModelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [M, V] (into out if given) from every rank's [M, ceil(V / N)] over its vocabulary rows."""
    if cfg.tp_size == 1:
        return local if out is None else out.copy_(local)
    parts = gather(local, cfg.tp_size)  # [N, M, rows]
    whole = parts.permute(1, 0, 2).reshape(local.shape[0], -1)[:, : cfg.vocab_size]
    return whole.contiguous() if out is None else out.copy_(whole)


def broadcast_object(obj):
    """Rank 0's obj (picklable), on every rank: a choice made once (e.g. measured) that all must share."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
