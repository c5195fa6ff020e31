"""A one-shot all-reduce plus residual over memory every rank can read (CUDA IPC peers, set up by
nextn.parallel.ipc): `residual + ((x_0 + x_1) + x_2) + ...`, the ranks' partial sums x_r added in
rank order, each addition rounded to the dtype, then the residual added in float32 and rounded once:
bitwise what `x + comm.all_reduce(partial)` computes (`reference`), on every rank, for any row count.

Two launches per call, so the protocol also runs on the CPU interpreter one rank after another:
- `_publish`: program p copies its chunks of x into this rank's buffer at parity c % 2 (c = this
  call's number, counted per program), then, after a block barrier, writes c into flag [rank, p] of
  every rank (itself included) with a system-scope release: the copy is visible to whoever sees c.
- `_reduce`: program p waits until its own flags [s, p] reach c for every rank s (acquire), then
  reads its chunks from every rank's buffer at parity c % 2 and adds them in rank order.
Flags are pushed to the readers (a posted remote write) and polled locally, which is cheaper than
polling peers' memory. Two parities make reuse safe: a rank starts call c + 2 (overwriting parity
c % 2) only after its reduce of call c + 1 saw every peer publish c + 1, and a peer publishes c + 1
only after its reduce of call c (the last reads of that parity) has finished. Every call runs all
PROGRAMS programs (some with no chunk), so every program's counter is the same call number, and
the grid is small enough for every program to be resident at once (a spinning program never keeps a
peer's program off the GPU). Every rank must make the same sequence of calls with the same sizes
(every rank runs the same engine); otherwise a reduce waits forever.

What this module does not know: how the peers' memory was shared (nextn.parallel.ipc).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nextn.ops.triton_utils import HAVE_TRITON, next_pow2

PROGRAMS = 64  # every call's grid: resident at once on any GPU nextn runs (H200: 132 SMs)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _publish(x_ptr, n, buf_ptr, flags, counter_ptr, max_elems, rank, N: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        c = tl.load(counter_ptr + pid) + 1
        tl.store(counter_ptr + pid, c)
        dst = buf_ptr + (c % 2) * max_elems
        for start in range(pid * BLOCK, n, P * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
        tl.debug_barrier()  # every thread's stores before the release below
        for s in tl.static_range(N):
            tl.atomic_xchg(flags[s] + rank * P + pid, c, sem="release", scope="sys")

    @triton.jit
    def _reduce(res_ptr, out_ptr, n, bufs, flag_ptr, counter_ptr, max_elems, N: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        c = tl.load(counter_ptr + pid)
        for s in tl.static_range(N):
            while tl.atomic_add(flag_ptr + s * P + pid, 0, sem="acquire", scope="sys") < c:
                pass
        tl.debug_barrier()  # no thread reads before the acquire above
        base = (c % 2) * max_elems
        dtype = res_ptr.dtype.element_ty
        for start in range(pid * BLOCK, n, P * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            # volatile: peer memory, rewritten every other call, never served from a stale cache line
            total = tl.load(bufs[0] + base + offs, mask=mask, volatile=True)
            for s in tl.static_range(1, N):
                part = tl.load(bufs[s] + base + offs, mask=mask, volatile=True)
                total = (total.to(tl.float32) + part.to(tl.float32)).to(dtype)
            res = tl.load(res_ptr + offs, mask=mask)
            tl.store(out_ptr + offs, (res.to(tl.float32) + total.to(tl.float32)).to(dtype), mask=mask)


@dataclass(frozen=True)
class Peers:
    """One rank's view of the shared memory. buffers[s] and flags[s] are rank s's (mapped into this
    process for s != rank); counter is this rank's own."""

    rank: int
    buffers: tuple[torch.Tensor, ...]  # [size] x [2 * max_bytes] uint8: two parities of max_bytes
    flags: tuple[torch.Tensor, ...]  # [size] x [size * PROGRAMS] int64: flags[s][r * PROGRAMS + p]
    counter: torch.Tensor  # [PROGRAMS] int64: the calls each program has made

    @property
    def max_bytes(self) -> int:
        return self.buffers[0].numel() // 2


def alloc(size: int, max_bytes: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's zeroed (buffer, flags, counter) for a group of `size` ranks."""
    buffer = torch.zeros(2 * max_bytes, dtype=torch.uint8, device=device)
    flags = torch.zeros(size * PROGRAMS, dtype=torch.int64, device=device)
    return buffer, flags, torch.zeros(PROGRAMS, dtype=torch.int64, device=device)


def pieces(n: int, dtype: torch.dtype, peers: Peers) -> list[tuple[int, int]]:
    """(start, stop) of the calls a message of n elements takes: at most a parity's worth each."""
    step = peers.max_bytes // dtype.itemsize
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _block(n: int) -> int:
    return min(2048, max(128, next_pow2(triton.cdiv(n, PROGRAMS))))


def publish(x: torch.Tensor, peers: Peers) -> None:
    """This rank's partial sums x (flat, contiguous, at most a parity) into its buffer; flags raised."""
    n, buf = x.numel(), peers.buffers[peers.rank].view(x.dtype)
    _publish[(PROGRAMS,)](
        x, n, buf, peers.flags, peers.counter, buf.numel() // 2, peers.rank, N=len(peers.flags), BLOCK=_block(n)
    )


def reduce(residual: torch.Tensor, peers: Peers, out: torch.Tensor) -> torch.Tensor:
    """out = residual + the ranks' published sums (flat, contiguous, the size publish had)."""
    n, size = residual.numel(), len(peers.buffers)
    bufs = tuple(b.view(residual.dtype) for b in peers.buffers)
    flags = peers.flags[peers.rank]
    _reduce[(PROGRAMS,)](residual, out, n, bufs, flags, peers.counter, bufs[0].numel() // 2, N=size, BLOCK=_block(n))
    return out


def all_reduce_add(x: torch.Tensor, residual: torch.Tensor, peers: Peers) -> torch.Tensor:
    """residual + the sum over ranks of x (each rank's partial sums, x.shape == residual.shape):
    one publish + reduce per piece of at most a parity. No host synchronisation (CUDA graphs)."""
    if x.dtype not in DTYPES or residual.dtype != x.dtype or x.shape != residual.shape:
        raise ValueError(f"all-reduce of {x.dtype} {tuple(x.shape)} onto {residual.dtype} {tuple(residual.shape)}")
    flat, res = x.contiguous().view(-1), residual.contiguous().view(-1)
    out = torch.empty_like(res)
    for lo, hi in pieces(flat.numel(), x.dtype, peers):
        publish(flat[lo:hi], peers)
        reduce(res[lo:hi], peers, out[lo:hi])
    return out.view(residual.shape)


def reference(parts: list[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
    """What every rank must get: the partial sums added in rank order in their dtype, then the
    residual (nextn.parallel.comm.all_reduce and the step's `x + ...`)."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return residual + total
