"""Would split rows make the sampler's softmax and the greedy argmax fast at the released vocabulary?

Run 111 (bench/results/profile_round_qwen3.5-35b-a3b_run111.json) found a sampled K = 3 round on the
35B-A3B shape spending 247 us in 4 calls of torch's softmax over 248,320 columns (one thread block a
row: 1 MB of float32 streams through one SM), and a greedy round 34.7 us in 4 argmax calls. nextn's
one-launch sampling kernels (nextn.sample.triton_sample) hold a row in one program and stop at 32,768
columns. This probe times, before anything is built into the sampler, two launches a call that
split every row into CHUNK-column chunks:
- softmax: `_chunk_stats` stores each chunk's max m_c and sum of exp(x - m_c); `_chunk_write`
  combines its row's chunk statistics in chunk order (M = max m_c, S = sum s_c * exp(m_c - M), the
  same tree of the same C values whatever the row count) and writes exp(x - M) / S for its chunk;
- argmax: `_chunk_argmax` stores each chunk's max and its first index; `_row_argmax` takes the
  first chunk holding the row's max (ties: the lowest index, as torch.argmax).
Each row's result depends on its own values only, so a verify row equals the decode row bitwise.
Against torch's softmax the values differ by rounding (reported); the argmax must equal torch's.
Timed in CUDA graphs of 50 calls over 4 copies of the logits (`linear_tune.graph_us`), rows 1, 4, 7, 9.

    python bench/wide_softmax_probe.py --out wide_softmax_probe.json
    TRITON_INTERPRET=1 python bench/wide_softmax_probe.py --check   # CPU: invariance and agreement
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's nextn, run from anywhere

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

V = 248_320  # the released Qwen3.5 / Qwen3-Next vocabulary
CHUNK = 8192  # columns a program reads (32 KB of float32)
ROWS = (1, 4, 7, 9)


@triton.jit
def _chunk_stats(x_ptr, stats_ptr, V, C, CHUNK: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - m), axis=0)
    tl.store(stats_ptr + (row * C + c) * 2, m)
    tl.store(stats_ptr + (row * C + c) * 2 + 1, s)


@triton.jit
def _chunk_write(x_ptr, stats_ptr, out_ptr, V, C, CHUNK: tl.constexpr, C_BLOCK: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    offs_c = tl.arange(0, C_BLOCK)
    mask_c = offs_c < C
    m = tl.load(stats_ptr + (row * C + offs_c) * 2, mask=mask_c, other=float("-inf"))
    s = tl.load(stats_ptr + (row * C + offs_c) * 2 + 1, mask=mask_c, other=0.0)
    big = tl.max(m, axis=0)
    total = tl.sum(tl.where(mask_c, s * tl.exp(m - big), 0.0), axis=0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    at = row.to(tl.int64) * V + offs
    x = tl.load(x_ptr + at, mask=offs < V, other=float("-inf")).to(tl.float32)
    tl.store(out_ptr + at, tl.exp(x - big) / total, mask=offs < V)


@triton.jit
def _chunk_argmax(x_ptr, part_ptr, idx_ptr, V, C, CHUNK: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(part_ptr + row * C + c, best)
    tl.store(idx_ptr + row * C + c, c * CHUNK + at)


@triton.jit
def _row_argmax(part_ptr, idx_ptr, out_ptr, C, C_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs_c = tl.arange(0, C_BLOCK)
    part = tl.load(part_ptr + row * C + offs_c, mask=offs_c < C, other=float("-inf"))
    _, first = tl.max(part, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * C + first).to(tl.int64))


def softmax(x: torch.Tensor, out: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of float32 x [M, V] into out, in two launches (see the docstring)."""
    M, n = x.shape
    C = triton.cdiv(n, CHUNK)
    _chunk_stats[(M, C)](x, stats, n, C, CHUNK=CHUNK, num_warps=8)
    _chunk_write[(M, C)](x, stats, out, n, C, CHUNK=CHUNK, C_BLOCK=triton.next_power_of_2(C), num_warps=8)
    return out


def argmax(x: torch.Tensor, out: torch.Tensor, part: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of float32 x [M, V] (ties: the lowest index) into out [M] int64."""
    M, n = x.shape
    C = triton.cdiv(n, CHUNK)
    _chunk_argmax[(M, C)](x, part, idx, n, C, CHUNK=CHUNK, num_warps=8)
    _row_argmax[(M,)](part, idx, out, C, C_BLOCK=triton.next_power_of_2(C), num_warps=1)
    return out


def buffers(M: int, n: int, device) -> dict:
    C = triton.cdiv(n, CHUNK)
    return dict(
        out=torch.empty(M, n, device=device),
        stats=torch.empty(M * C * 2, device=device),
        part=torch.empty(M * C, device=device),
        idx=torch.empty(M * C, dtype=torch.int32, device=device),
        arg=torch.empty(M, dtype=torch.int64, device=device),
    )


def check(n: int = 3 * CHUNK + 123) -> int:
    """Each row alone equals the same row among others bitwise; close to torch; argmax == torch's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, n, generator=gen) * 4
    x[2, 7] = x[2, CHUNK + 9] = x[2].max() + 1  # a tie across chunks: the lower index wins
    b = buffers(5, n, x.device)
    probs = softmax(x, b["out"], b["stats"]).clone()
    arg = argmax(x, b["arg"], b["part"], b["idx"]).clone()
    failures = []
    for t in range(5):
        one = buffers(1, n, x.device)
        if not torch.equal(softmax(x[t : t + 1], one["out"], one["stats"])[0], probs[t]):
            failures.append(f"softmax row {t} alone differs")
        if argmax(x[t : t + 1], one["arg"], one["part"], one["idx"])[0] != arg[t]:
            failures.append(f"argmax row {t} alone differs")
    want = torch.softmax(x, dim=-1)
    err = ((probs - want).abs() / want.amax(dim=-1, keepdim=True)).max().item()  # float32 sums of ~10^4 terms
    if err > 5e-5:
        failures.append(f"softmax differs from torch's by {err:.3g} of the row's largest probability")
    if not torch.equal(arg, torch.argmax(x, dim=-1)):
        failures.append(f"argmax {arg.tolist()} != torch's {torch.argmax(x, dim=-1).tolist()}")
    print(
        "\n".join(failures)
        or f"ok: rows invariant, softmax within {err:.3g} of torch's (of a row's largest), argmax equal"
    )
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true", help="CPU: invariance and agreement (a small width)")
    args = ap.parse_args()
    if args.check:
        return check()
    from nextn.ops.linear_tune import graph_us

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "V": V, "chunk": CHUNK, "rows": {}}
    for M in ROWS:
        xs = [torch.randn(M, V, generator=gen, device=device) * 4 for _ in range(4)]
        b = buffers(M, V, device)
        want = torch.softmax(xs[0], dim=-1)
        got = softmax(xs[0], b["out"], b["stats"]).clone()  # b["out"] is rewritten by the timing below
        entry = report["rows"][M] = {
            "torch_softmax_us": graph_us(lambda i, xs=xs: torch.softmax(xs[i], dim=-1), 4, 50),
            "split_softmax_us": graph_us(lambda i, xs=xs, b=b: softmax(xs[i], b["out"], b["stats"]), 4, 50),
            "softmax_max_abs_diff": (got - want).abs().max().item(),  # probabilities: at most 1
            "torch_argmax_us": graph_us(lambda i, xs=xs: torch.argmax(xs[i], dim=-1), 4, 50),
            "split_argmax_us": graph_us(lambda i, xs=xs, b=b: argmax(xs[i], b["arg"], b["part"], b["idx"]), 4, 50),
            "argmax_equal": bool(torch.equal(argmax(xs[0], b["arg"], b["part"], b["idx"]), xs[0].argmax(-1))),
        }
        print(
            f"rows {M}: softmax torch {entry['torch_softmax_us']:.1f} us, split {entry['split_softmax_us']:.1f} "
            f"(max |diff| {entry['softmax_max_abs_diff']:.2e}); argmax torch {entry['torch_argmax_us']:.1f}, "
            f"split {entry['split_argmax_us']:.1f} (equal: {entry['argmax_equal']})"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
