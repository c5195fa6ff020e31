"""The one-shot all-reduce (nextn.ops.triton_allreduce, over CUDA IPC by nextn.parallel.ipc) gives
bitwise what the gather path gives, `residual + ((x_0 + x_1) + x_2)` in the dtype.

Simulated ranks (one process, plain tensors as the peers' memory; Triton's interpreter on the CPU):
every rank publishes, then reduces, one rank running a call ahead of the others as the protocol
allows, so a buffer parity read at the wrong call shows up as wrong sums. Real ranks (two GPUs):
the IPC path equals the NCCL gather path, eager and replayed from a CUDA graph, on both ranks.
"""

from __future__ import annotations

import types

import pytest
import torch
import triton_interp  # noqa: F401  (before triton: the CPU interpreter, with GPU rounding)

pytest.importorskip("triton")

from nextn.ops import triton_allreduce as A  # noqa: E402
from nextn.parallel import comm, launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TWO_GPUS = torch.cuda.device_count() >= 2


def _ranks(size: int, max_bytes: int) -> list[A.Peers]:
    """size simulated ranks sharing one another's (plain) buffers and flags."""
    mem = [A.alloc(size, max_bytes, DEVICE) for _ in range(size)]
    buffers, flags = tuple(m[0] for m in mem), tuple(m[1] for m in mem)
    return [A.Peers(r, buffers, flags, mem[r][2]) for r in range(size)]


def _calls(sizes, size: int, dtype, gen):
    """Per call: the ranks' partial sums and the residual, [n] each."""
    rand = lambda n: (torch.randn(n, generator=gen) * 4).to(dtype).to(DEVICE)  # noqa: E731
    return [([rand(n) for _ in range(size)], rand(n)) for n in sizes]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_shot_equals_rank_order_sum(size, dtype, monkeypatch):
    monkeypatch.setattr(A, "PROGRAMS", 4)  # the interpreter runs programs one by one: a small grid
    peers = _ranks(size, max_bytes=1 << 16)
    # sizes off the chunk grid; 20000 loops each program over several chunks; 40000 takes 2-3 pieces
    calls = _calls([1, 300, 1000, 20000, 40000, 7], size, dtype, torch.Generator().manual_seed(size))
    # every call's pieces in order: (the ranks' parts, residual, the ranks' outputs) slices
    work = []
    for parts, res in calls:
        out = [torch.full_like(res, float("nan")) for _ in range(size)]
        for lo, hi in A.pieces(res.numel(), dtype, peers[0]):
            work.append(([p[lo:hi] for p in parts], res[lo:hi], [o[lo:hi] for o in out]))
    assert len(work) > len(calls)  # some call took several pieces
    # rank 0 reduces a piece and publishes the next before the others reduce it: a rank may run
    # one call ahead, so a publish into the parity still being read would corrupt their sums
    for r in range(size):
        A.publish(work[0][0][r], peers[r])
    for i, (_, res, out) in enumerate(work):
        for r in range(size):
            A.reduce(res, peers[r], out[r])
            if i + 1 < len(work):
                A.publish(work[i + 1][0][r], peers[r])
    for parts, res, out in work:
        want = A.reference(parts, res)
        for r in range(size):
            assert torch.equal(out[r], want), f"rank {r}, {res.numel()} elements"
    n = len(work)
    for r in range(size):  # every program counted every call, and raised its flag on every rank
        assert peers[r].counter.tolist() == [n] * A.PROGRAMS
        assert peers[r].flags[r].tolist() == [n] * (size * A.PROGRAMS)


def test_rank_order_reference_is_the_gather_path():
    """The kernels' reference is comm.all_reduce's arithmetic (what the step did before)."""
    gen = torch.Generator().manual_seed(0)
    parts = [(torch.randn(64, generator=gen) * 100).to(torch.bfloat16) for _ in range(3)]
    res = torch.randn(64, generator=gen).to(torch.bfloat16)
    total = (parts[0].float() + parts[1].float()).to(torch.bfloat16)
    total = (total.float() + parts[2].float()).to(torch.bfloat16)
    assert torch.equal(A.reference(parts, res), (res.float() + total.float()).to(torch.bfloat16))


# --- two real ranks -------------------------------------------------------------------------------


def _transports(seed: int) -> dict:
    """On each rank: its transport, and over many calls whether all_reduce_add (eager and replayed
    from a CUDA graph) equals the gather path bitwise, with a checksum of the outputs."""
    rank, cfg = launch.rank(), types.SimpleNamespace(tp_size=2)
    out = {"backend": comm.backend, "mismatches": [], "sums": []}
    if DEVICE != "cuda":
        return out
    device = torch.device("cuda", rank)
    gen = torch.Generator(device=device).manual_seed(seed + rank)  # partial sums differ per rank
    shared = torch.Generator(device=device).manual_seed(seed)  # the residual is the same everywhere

    def check(tag, got, x, res):
        want = res + comm.all_reduce(x, cfg)
        if not torch.equal(got, want):
            out["mismatches"].append(tag)
        out["sums"].append(got.float().sum().item())

    # decode (1 row), verify (9 rows), a batch (64), and a prefill beyond a parity (several pieces)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 9, 64, 1, 3000):
            for i in range(20 if rows < 3000 else 2):
                x = torch.randn(rows, 5120, generator=gen, device=device).to(dtype)
                res = torch.randn(rows, 5120, generator=shared, device=device).to(dtype)
                check(f"eager {dtype} {rows} rows #{i}", comm.all_reduce_add(x, res, cfg), x, res)
    # captured: two all-reduces per "layer", as a step graph holds them, replayed with new inputs
    x = torch.empty(9, 5120, device=device, dtype=torch.bfloat16)
    res = torch.empty_like(x)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        comm.all_reduce_add(x, comm.all_reduce_add(x, res, cfg), cfg)  # warm up (compile) off the graph
        with torch.cuda.graph(graph, stream=side):
            mid = comm.all_reduce_add(x, res, cfg)
            end = comm.all_reduce_add(x, mid, cfg)
    torch.cuda.current_stream(device).wait_stream(side)
    for i in range(10):
        x.copy_(torch.randn(x.shape, generator=gen, device=device))
        res.copy_(torch.randn(x.shape, generator=shared, device=device))
        graph.replay()
        check(f"graph replay #{i}", end, x, res + comm.all_reduce(x, cfg))  # end = (res + sum) + sum
    graph.reset()
    torch.cuda.synchronize(device)
    return out


def test_two_ranks_choose_their_transport_and_ipc_equals_gather():
    threads = torch.get_num_threads()
    ranks = launch.start(2, DEVICE, _follower, 7)
    try:
        mine, theirs = _transports(7), ranks.receive()[0]
    finally:
        ranks.close()
    assert torch.get_num_threads() == threads  # rank 0 gets back the threads it shared with rank 1
    if DEVICE == "cpu":
        assert mine["backend"] == theirs["backend"] == "gloo"
        return
    peer = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
    assert mine["backend"] == theirs["backend"] == ("ipc" if peer else "nccl")
    assert mine["mismatches"] == [] and theirs["mismatches"] == []
    assert mine["sums"] == theirs["sums"]  # the same bits on both ranks
    assert comm.backend is None  # freed with the group


def _follower(conn, seed):
    conn.send(_transports(seed))
