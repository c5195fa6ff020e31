"""A gated greedy draft step in one launch: for each of n rows of head logits [B, V] (V up to the
full 248k vocabulary, or a draft vocabulary's Vd), the argmax (ties: the lowest index, torch.argmax's
pick), the head's probability of it, and the p_min gate's update. Drafting a K-long chain runs this
K times, so the step's small torch ops (softmax, gather, compare, and, add: six or more launches
per draft on a model whose whole round is ~0.6 ms of launches) collapse into one.

Row i's vocabulary is split into up to MAX_SPLITS runs of whole BLOCK_V tiles, a program each (one
program reading a row alone waits its tile loads one after another: 58 us a draft at the 80B's
151,936 ids, run 157, a quarter of its head step's 224 us; torch's argmax over the 9B's 248,320
took 8.7 us, run 19). Each
keeps its run's running max, first index of it and sum(exp(l - max)) (rescaled as the max grows,
in float32) and stores them; the row's last program to arrive (an arrival counter, left zero
again) combines the runs in a fixed layout: the max, the lowest index holding it (runs are in index
order), and sum_s sum_s * exp(max_s - max). The pick's probability is exp(l_max - max) / sum exp(l
- max) = 1 / sum. torch.softmax sums in another order, so the two probabilities differ by rounding
only; the gate compares it with >= p_min, so a draft within rounding of p_min may be cut by one and
kept by the other. Output is the same either way: a cut never changes greedy output, only how many
drafts the verify counts. The split depends on V and BLOCK_V alone, so a row's bits do not depend
on how many rows a call drafts. Logits are assumed finite or -inf (torch.argmax picks a NaN; this
kernel does not).

`run_if` (a device scalar, nextn.engine.runner.ModelRunner.when): when 0, every program returns
before reading or writing anything (the chain was cut for every member: the step is skipped).
Reference: nextn.ops.draft.greedy_draft_reference (the reference engine's path, and the test oracle).
"""

from __future__ import annotations

import torch

from nextn.ops.draft import DraftGate
from nextn.ops.triton_utils import HAVE_TRITON, arrival_counters, next_pow2

MAX_SPLITS = 64  # programs a row's vocabulary is split over, at most (whole BLOCK_V tiles each)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _greedy_draft_kernel(
        logits_ptr,  # [B, V] float32 or bf16
        stride_l,
        V,
        ids_ptr,  # long, flat: row i's token goes to ids[at[i]] (HAS_AT; else ids[i])
        at_ptr,  # long [n]
        rows_ptr,  # long [n]: row i's logits row and gate member
        d2t_ptr,  # long [V]: each column's target id (a draft vocabulary)
        live_ptr,  # bool [B]
        counted_ptr,  # long [B]
        steps_ptr,  # long [1]
        flag_ptr,  # [] run_if
        part_ptr,  # float32 [3, n, SPLITS]: each run's max, first index of it (int32 bits) and sum
        count_ptr,  # int32 [n] arrival counters, zero between launches
        p_min,
        HAS_AT: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        HAS_D2T: tl.constexpr,
        GATED: tl.constexpr,
        FIRST: tl.constexpr,
        HAS_STEPS: tl.constexpr,
        HAS_FLAG: tl.constexpr,
        BLOCK_V: tl.constexpr,
        TILES: tl.constexpr,  # BLOCK_V tiles a run
        SPLITS: tl.constexpr,  # runs a row
        SPLITS_POW2: tl.constexpr,
    ):
        i = tl.program_id(0)
        s = tl.program_id(1)
        if HAS_FLAG:  # before any store or arrival: a skipped call leaves the counters zero
            if tl.load(flag_ptr).to(tl.int32) == 0:
                return
        b = i.to(tl.int64)
        if HAS_ROWS:
            b = tl.load(rows_ptr + i)
        row = logits_ptr + b * stride_l
        offs = tl.arange(0, BLOCK_V)
        best = tl.full((), float("-inf"), tl.float32)
        pick = tl.zeros((), tl.int32)
        total = tl.zeros((), tl.float32)
        for t in tl.static_range(TILES):
            v0 = (s * TILES + t) * BLOCK_V
            x = tl.load(row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
            m, j = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            new = tl.maximum(best, m)
            shift = tl.where(new == float("-inf"), 0.0, new)  # all -inf so far: every term 0, not NaN
            total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), axis=0)
            pick = tl.where(m > best, v0 + j, pick)  # strictly greater: an earlier tile keeps a tie
            best = new
        n = tl.num_programs(0)
        part = part_ptr + i * SPLITS + s
        tl.store(part, best)
        tl.store(part + n * SPLITS, pick.to(tl.float32, bitcast=True))
        tl.store(part + 2 * n * SPLITS, total)
        tl.debug_barrier()  # the run's partials are written before the counter moves
        if tl.atomic_add(count_ptr + i, 1, sem="acq_rel") == SPLITS - 1:  # the row's last run: combine
            runs = tl.arange(0, SPLITS_POW2)
            valid = runs < SPLITS
            base = part_ptr + i * SPLITS + runs
            ms = tl.load(base, mask=valid, other=float("-inf"), cache_modifier=".cg")
            js = tl.load(base + n * SPLITS, mask=valid, other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
            sums = tl.load(base + 2 * n * SPLITS, mask=valid, other=0.0, cache_modifier=".cg")
            best = tl.max(ms, axis=0)
            pick = tl.min(tl.where(ms == best, js, V), axis=0)  # the lowest index holding the max
            total = tl.sum(sums * tl.exp(ms - tl.where(best == float("-inf"), 0.0, best)), axis=0)
            tl.store(count_ptr + i, 0)
            token = pick.to(tl.int64)
            if HAS_D2T:
                token = tl.load(d2t_ptr + pick)
            if HAS_AT:
                tl.store(ids_ptr + tl.load(at_ptr + i), token)
            else:
                tl.store(ids_ptr + i, token)
            if GATED:
                passed = (1.0 / total) >= p_min
                if FIRST:
                    live = passed
                    counted = live.to(tl.int64)
                else:
                    live = (tl.load(live_ptr + b) != 0) & passed
                    counted = tl.load(counted_ptr + b) + live.to(tl.int64)
                tl.store(live_ptr + b, live)
                tl.store(counted_ptr + b, counted)
                if HAS_STEPS:
                    tl.store(steps_ptr, tl.load(steps_ptr) + 1, mask=i == 0)


def greedy_draft(
    logits: torch.Tensor,  # [B, V or Vd]
    ids: torch.Tensor,  # long, flat (e.g. the round's verify_ids [S * R]): drafts written at ids[at]
    at: torch.Tensor | None,  # long [n] (None: ids[i], n the rows of logits)
    rows: torch.Tensor | None = None,  # long [n]: each draft's logits row and gate member (None: 0..n-1)
    d2t: torch.Tensor | None = None,  # long [Vd]: a draft vocabulary's target ids (None: the pick is the id)
    gate: DraftGate | None = None,
    run_if: torch.Tensor | None = None,  # [] device flag: 0 skips the call (see the module docstring)
    block_v: int = 4096,
    max_splits: int = MAX_SPLITS,
) -> None:
    """Drafts i = 0..n-1: ids[at[i]] = (d2t of) argmax logits[rows[i]], and the gate's update."""
    n, V = at.numel() if at is not None else logits.shape[0], logits.shape[1]
    block_v = min(block_v, next_pow2(V))
    num_tiles = -(-V // block_v)
    tiles = -(-num_tiles // max_splits)
    splits = -(-num_tiles // tiles)
    if logits.stride(1) != 1 or gate is not None and gate.first and rows is not None:
        raise ValueError("greedy_draft: logits rows contiguous; a first draft covers every member")
    dummy = ids
    part = torch.empty(3 * n * splits, device=logits.device, dtype=torch.float32)
    _greedy_draft_kernel[(n, splits)](
        logits,
        logits.stride(0),
        V,
        ids,
        at if at is not None else dummy,
        rows if rows is not None else dummy,
        d2t if d2t is not None else dummy,
        gate.live if gate is not None else dummy,
        gate.counted if gate is not None else dummy,
        gate.head_steps if gate is not None and gate.head_steps is not None else dummy,
        run_if if run_if is not None else dummy,
        part,
        arrival_counters(logits.device, n),
        gate.p_min if gate is not None else 0.0,
        HAS_AT=at is not None,
        HAS_ROWS=rows is not None,
        HAS_D2T=d2t is not None,
        GATED=gate is not None,
        FIRST=gate is not None and gate.first,
        HAS_STEPS=gate is not None and gate.head_steps is not None,
        HAS_FLAG=run_if is not None,
        BLOCK_V=block_v,
        TILES=tiles,
        SPLITS=splits,
        SPLITS_POW2=next_pow2(splits),
        num_warps=4,
    )


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.argmax(logits, -1) for finite (or -inf) float rows [n, V] (ties: the lowest index), into
    out [n] long: `greedy_draft` without a gate, a row split over up to MAX_SPLITS programs (a
    greedy round's pick: torch's one reduction launch over the 9B's 248,320 ids took 8.6 us, run 170)."""
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy_draft(logits, out, None)
    return out
