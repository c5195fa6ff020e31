"""The memory of the one-shot all-reduce (nextn.ops.triton_allreduce), shared between the ranks of
one host through CUDA IPC: each rank allocates its buffer (two parities) and flags, exports them
(torch.multiprocessing.reductions.reduce_tensor gives a picklable handle), and maps every peer's.

A decode step's all-reduces move a few kilobytes each; NCCL's all-gather plus torch's adds spends
~20 us on one (two H200s), most of it fixed cost. Here one all-reduce is two small kernels that
read the peers' memory over NVLink directly.

`setup()` runs once per process group (a collective: every rank calls it), before any CUDA graph is
captured, and `release()` before the group is destroyed; the mapped tensors stay alive in between
(captured graphs hold their addresses). What this module does not decide: whether to use IPC at all
(nextn.parallel.comm) or which rank runs where (nextn.parallel.launch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from nextn.ops.triton_allreduce import Peers, alloc

# a parity's bytes: a 64-row batch of hidden 8192 in float32 (2 MiB) fits in one call; a larger
# message (a prefill) takes several
MAX_BYTES = 4 << 20


def setup(max_bytes: int = MAX_BYTES) -> Peers:
    """This rank's Peers: its own buffer, flags and counter, and every peer's buffer and flags mapped
    here. A collective over the default group; an error (never a quiet fallback) if a step fails."""
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    buffer, flags, counter = alloc(size, max_bytes, device)
    torch.cuda.synchronize(device)  # zeroed before a peer can map them (and write our flags)
    exported: list = [None] * size
    dist.all_gather_object(exported, (reduce_tensor(buffer), reduce_tensor(flags)))
    buffers, flag_list = [], []
    for s, ((rebuild_b, args_b), (rebuild_f, args_f)) in enumerate(exported):
        if s == rank:  # a process cannot open its own IPC handle
            buffers.append(buffer)
            flag_list.append(flags)
            continue
        peer_buffer, peer_flags = _open(rebuild_b, args_b, device), _open(rebuild_f, args_f, device)
        buffers.append(peer_buffer)
        flag_list.append(peer_flags)
    torch.cuda.synchronize(device)
    dist.barrier()  # every rank has mapped every peer before any kernel writes a peer's flags
    return Peers(rank, tuple(buffers), tuple(flag_list), counter)


def _open(rebuild, args: tuple, device: torch.device) -> torch.Tensor:
    """A peer's exported tensor, mapped into THIS rank's device context: torch would open the handle
    on the exporting device (a context of its own in this process, whose pointers Triton kernels
    launched here cannot use: "cannot be accessed from Triton", H200 run 39). Opened here, the
    mapping's peer access is enabled by CUDA (cudaIpcMemLazyEnablePeerAccess)."""
    args = list(args)
    args[6] = device.index  # rebuild_cuda_tensor's storage_device
    return rebuild(*args)


def release(peers: Peers) -> None:
    """Before this rank drops its last reference to peers (the caller's): wait for its kernels, which
    may still read the peers' memory. torch's IPC reference counts keep a rank's own memory alive
    while a peer still maps it, and ipc_collect frees what no peer maps any more."""
    torch.cuda.synchronize(peers.counter.device)
