"""The processes of tensor parallelism: nextn starts one per rank itself. The calling process
becomes rank 0 (it keeps the terminal, the server's socket, the caller's Python objects) and spawns
ranks 1..N-1, each with a pipe from rank 0; all join one process group: NCCL on CUDA (rank r on
cuda:r), gloo on the CPU (each rank takes its share of rank 0's threads).

NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is set before any communicator exists (in this
process, and so in every spawned one), and nothing here allocates symmetric memory. Once the group
exists, every rank sets up the fused step's all-reduce (nextn.parallel.comm.setup_all_reduce: CUDA
IPC buffers on CUDA) and frees it before leaving the group.

A follower runs `target(conn, *args)` and exits when it returns; rank 0's `Ranks` sends it
messages, reads its replies (noticing a rank that died) and, on close, stops it and leaves the
group. A process that already belongs to a group (a follower, or a program started by torchrun)
starts nothing: `initialized()`.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nextn.parallel import comm

STOP = None  # the message that ends a follower


class RankError(ValueError):
    """Another rank failed (its own error, in one line, when it could say it)."""


_POLL_S = 1.0


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def rank_device(device: str) -> str:
    """This rank's device: cuda:<rank> for "cuda", the CPU for "cpu"."""
    return f"cuda:{rank()}" if device == "cuda" and initialized() else device


def check_ranks(size: int, device: str) -> None:
    """One-line errors for a tensor_parallel_size the machine cannot run."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if device.startswith("cuda:"):
        raise ValueError(f"tensor parallelism puts rank r on cuda:r: give device cuda, not {device}")
    if device == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; torch sees {torch.cuda.device_count()}")
    if initialized() and dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size {size} in a process group of {dist.get_world_size()} ranks")


class Ranks:
    """Rank 0's handle on the ranks it started: their processes and a pipe to each."""

    def __init__(self, processes: list, conns: list):
        self.processes, self.conns = processes, conns
        self.closed = False
        # rank 0 (this process) takes its share of the CPU threads on gloo; all of them again on close
        self.threads = torch.get_num_threads()

    def send(self, message) -> None:
        for conn in self.conns:
            conn.send(message)

    def receive(self) -> list:
        """One message from each follower, in rank order (an error if one has exited)."""
        out = []
        for r, (p, conn) in enumerate(zip(self.processes, self.conns, strict=True), start=1):
            while not conn.poll(_POLL_S):
                if not p.is_alive():
                    raise RankError(f"tensor-parallel rank {r} exited (code {p.exitcode})")
            out.append(conn.recv())
        return out

    def close(self, timeout: float = 30.0) -> None:
        """Stop the followers (waiting up to `timeout` s for each) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(STOP)
            except OSError:  # the follower is gone already
                pass
        # every rank leaves the group at once, its CUDA graphs reset first (LLM.close, Bench.close)
        if initialized():
            comm.close_all_reduce()
            dist.destroy_process_group()
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
        torch.set_num_threads(self.threads)


def start(size: int, device: str, target: Callable, *args) -> Ranks:
    """Spawn ranks 1..size-1 running target(conn, *args) and join the group as rank 0."""
    check_ranks(size, device)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NCCL's own setting, inherited by the spawned ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = _Group(size, port, device, max(1, torch.get_num_threads() // size))
    ctx = mp.get_context("spawn")
    processes, conns = [], []
    for r in range(1, size):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(
            target=_follower,
            args=(r, group, theirs, target, args),
            daemon=True,
            name=f"nextn-rank{r}",
        )
        p.start()
        theirs.close()
        processes.append(p)
        conns.append(ours)
    ranks = Ranks(processes, conns)
    atexit.register(ranks.close)  # before multiprocessing's own exit handler kills the followers
    try:
        _join(0, group)
    except BaseException:
        ranks.close(timeout=5.0)
        raise
    return ranks


@dataclass(frozen=True)
class _Group:
    """Where the ranks meet and what each takes: sent to every follower."""

    size: int  # the ranks
    port: int  # rank 0's, on 127.0.0.1
    device: str  # "cuda" (rank r on cuda:r) or "cpu"
    threads: int  # each rank's CPU threads on gloo


def _join(r: int, group: _Group) -> None:
    cuda = group.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(r)
    else:
        torch.set_num_threads(group.threads)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{group.port}",
        rank=r,
        world_size=group.size,
        timeout=timedelta(minutes=10),  # a collective waits this long for a rank (then fails)
    )
    comm.setup_all_reduce()  # the fused step's all-reduce: CUDA IPC or the group's own (logged)


def _follower(r: int, group: _Group, conn, target: Callable, args) -> None:
    logging.getLogger("nextn").setLevel(logging.ERROR)  # rank 0 logs for every rank; errors still show
    _join(r, group)
    try:
        target(conn, *args)
    finally:
        conn.close()
        comm.close_all_reduce()
        dist.destroy_process_group()
