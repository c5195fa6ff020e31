"""A gated greedy draft step in one launch: for each of n rows of head logits [B, V] (V up to the
full 248k vocabulary, or a draft vocabulary's Vd), the argmax (ties: the lowest index, torch.argmax's
pick), the head's probability of it, and the p_min gate's update. Drafting a K-long chain runs this
K times, so the step's small torch ops (softmax, gather, compare, and, add: six or more launches
per draft on a model whose whole round is ~0.6 ms of launches) collapse into one.

Program i reads row rows[i] (default i) in blocks of BLOCK_V, keeping the running max, its first
index and sum(exp(l - max)) (rescaled as the max grows, in float32); the pick's probability is
exp(l_max - max) / sum exp(l - max) = 1 / sum. torch.softmax sums in another order, so the two
probabilities differ by rounding only; the gate compares it with >= p_min, so a draft within
rounding of p_min may be cut by one and kept by the other. Output is the same either way: a cut
never changes greedy output, only how many drafts the verify counts. Logits are assumed finite
(torch.argmax picks a NaN; this kernel does not).

`run_if` (a device scalar, nextn.engine.runner.ModelRunner.when): when 0, every program returns
before reading or writing anything (the chain was cut for every member: the step is skipped).
Reference: nextn.ops.draft.greedy_draft_reference (the reference engine's path, and the test oracle).
"""

from __future__ import annotations

import torch

from nextn.ops.draft import DraftGate
from nextn.ops.triton_utils import HAVE_TRITON, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _greedy_draft_kernel(
        logits_ptr,  # [B, V] float32 or bf16
        stride_l,
        V,
        ids_ptr,  # long, flat: program i writes its token at ids[at[i]]
        at_ptr,  # long [n]
        rows_ptr,  # long [n]: program i's logits row and gate member
        d2t_ptr,  # long [V]: each column's target id (a draft vocabulary)
        live_ptr,  # bool [B]
        counted_ptr,  # long [B]
        steps_ptr,  # long [1]
        flag_ptr,  # [] run_if
        p_min,
        HAS_ROWS: tl.constexpr,
        HAS_D2T: tl.constexpr,
        GATED: tl.constexpr,
        FIRST: tl.constexpr,
        HAS_STEPS: tl.constexpr,
        HAS_FLAG: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        i = tl.program_id(0)
        if HAS_FLAG:
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
        for v0 in range(0, V, BLOCK_V):
            x = tl.load(row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
            m, j = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            new = tl.maximum(best, m)
            total = total * tl.exp(best - new) + tl.sum(tl.exp(x - new), axis=0)
            pick = tl.where(m > best, v0 + j, pick)  # strictly greater: an earlier block keeps a tie
            best = new
        token = pick.to(tl.int64)
        if HAS_D2T:
            token = tl.load(d2t_ptr + pick)
        tl.store(ids_ptr + tl.load(at_ptr + i), token)
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
    at: torch.Tensor,  # long [n]
    rows: torch.Tensor | None = None,  # long [n]: each draft's logits row and gate member (None: 0..n-1)
    d2t: torch.Tensor | None = None,  # long [Vd]: a draft vocabulary's target ids (None: the pick is the id)
    gate: DraftGate | None = None,
    run_if: torch.Tensor | None = None,  # [] device flag: 0 skips the call (see the module docstring)
    block_v: int = 4096,
) -> None:
    """Drafts i = 0..n-1: ids[at[i]] = (d2t of) argmax logits[rows[i]], and the gate's update."""
    n, V = at.numel(), logits.shape[1]
    if logits.stride(1) != 1 or gate is not None and gate.first and rows is not None:
        raise ValueError("greedy_draft: logits rows contiguous; a first draft covers every member")
    dummy = ids
    _greedy_draft_kernel[(n,)](
        logits,
        logits.stride(0),
        V,
        ids,
        at,
        rows if rows is not None else dummy,
        d2t if d2t is not None else dummy,
        gate.live if gate is not None else dummy,
        gate.counted if gate is not None else dummy,
        gate.head_steps if gate is not None and gate.head_steps is not None else dummy,
        run_if if run_if is not None else dummy,
        gate.p_min if gate is not None else 0.0,
        HAS_ROWS=rows is not None,
        HAS_D2T=d2t is not None,
        GATED=gate is not None,
        FIRST=gate is not None and gate.first,
        HAS_STEPS=gate is not None and gate.head_steps is not None,
        HAS_FLAG=run_if is not None,
        BLOCK_V=min(block_v, next_pow2(V)),
        num_warps=4 if V <= 16384 else 8,
    )
