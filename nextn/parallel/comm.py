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

The fused step ends a block with `all_reduce_add` (the residual plus the all-reduce), which runs over
one of two transports, chosen once per process group by `setup_all_reduce` and logged:
- "ipc": a one-shot all-reduce over CUDA IPC (nextn.parallel.ipc, nextn.ops.triton_allreduce), when
  the group is NCCL's (CUDA), of 2..8 ranks on one host, and every pair of their GPUs has peer
  access; if that setup then fails, the error is raised (no quiet fallback to NCCL);
- "nccl" otherwise on CUDA (the gather above), and "gloo" on the CPU.
Both give the same bits (the same additions in the same order), so the choice changes speed only.
The reference modules keep the gather path.
"""

from __future__ import annotations

import logging
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nextn.config.model import ModelConfig

log = logging.getLogger("nextn")

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


# the transport of all_reduce_add in this process group: None before setup_all_reduce, else
# "ipc", "nccl" or "gloo" (a bench reports it); _peers: the IPC memory when "ipc"
backend: str | None = None
_peers = None


def setup_all_reduce() -> str:
    """Choose the transport of all_reduce_add for this process group, set it up and log it: a
    collective (every rank calls it once, after init_process_group, before any CUDA graph)."""
    global backend, _peers
    if backend is not None:
        return backend
    reason = _why_not_ipc()
    if reason is None:
        from nextn.parallel import ipc

        try:
            _peers = ipc.setup()
        except Exception as e:
            raise RuntimeError(f"tensor parallelism: the all-reduce over CUDA IPC could not be set up: {e}") from e
        backend = "ipc"
        log.info("tensor parallelism: all-reduce over CUDA IPC (one-shot)")
    else:
        backend = dist.get_backend()
        log.info("tensor parallelism: all-reduce over %s (%s)", backend.upper(), reason)
    return backend


def _why_not_ipc() -> str | None:
    """None when the IPC all-reduce applies (an NCCL group of 2..8 ranks on one host whose GPUs all
    have peer access to each other), else why not. The same answer on every rank."""
    size = dist.get_world_size()
    if dist.get_backend() != "nccl":
        return "not CUDA"
    where: list = [None] * size
    dist.all_gather_object(where, (socket.gethostname(), torch.cuda.current_device()))
    if not 2 <= size <= 8:
        return f"{size} ranks, not 2..8"
    if len({host for host, _ in where}) > 1:
        return "ranks on several hosts"
    devices = [d for _, d in where]
    if not all(torch.cuda.can_device_access_peer(a, b) for a in devices for b in devices if a != b):
        return "no peer access between the GPUs"
    return None


def close_all_reduce() -> None:
    """Before this rank leaves the process group: drop the IPC memory (after its kernels finish)."""
    global backend, _peers
    if _peers is not None:
        from nextn.parallel import ipc

        ipc.release(_peers)
        _peers = None
        torch.cuda.ipc_collect()
    backend = None


def all_reduce_add(x: torch.Tensor, residual: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """residual + all_reduce(x, cfg), the end of a row-parallel block in the fused step, bitwise
    the same over either transport. A group made outside nextn.parallel.launch (torchrun) chooses
    its transport on the first call (which must come before any CUDA graph capture)."""
    if cfg.tp_size == 1:
        return residual + x
    if backend is None:
        setup_all_reduce()
    if _peers is not None:
        from nextn.ops.triton_allreduce import all_reduce_add as one_shot

        return one_shot(x, residual, _peers)
    return residual + all_reduce(x, cfg)


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
