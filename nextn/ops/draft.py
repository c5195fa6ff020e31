"""A greedy draft step with the p_min gate, in plain PyTorch: the reference engine's path and the
oracle of its one-launch kernel (nextn.ops.triton_draft, which says what the step computes and
where the two may differ: the pick's probability by rounding only).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DraftGate(NamedTuple):
    """The p_min gate a draft step updates, per member b of the batch (nextn.spec.proposer)."""

    live: torch.Tensor  # [B] bool: no draft of member b was cut yet; &= (p >= p_min)
    counted: torch.Tensor  # [B] long: drafts before member b's first cut; += live
    p_min: float
    head_steps: torch.Tensor | None  # [1] long: += 1 per call (head steps run)
    first: bool  # draft 1 of every member: live and counted are written (= p >= p_min), not read


def greedy_draft_reference(
    logits: torch.Tensor,
    ids: torch.Tensor,
    at: torch.Tensor,
    rows: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    gate: DraftGate | None = None,
    run_if: torch.Tensor | None = None,
) -> None:
    """Drafts i = 0..n-1: ids[at[i]] = (d2t of) argmax logits[rows[i]] (rows None: row i), and the
    gate's update: live &= (p >= p_min), counted += live, head_steps += 1, where p is the head's
    probability of the pick, 1 / sum(exp(l - max)); nothing where run_if is 0 (read on the host:
    the reference engine sets none, it skips cut steps on the host: ModelRunner.when)."""
    if run_if is not None and not bool(run_if):
        return
    x = (logits if rows is None else logits.index_select(0, rows)).float()  # [n, V]
    pick = x.argmax(-1)
    ids.index_copy_(0, at, pick if d2t is None else d2t.index_select(0, pick))
    if gate is None:
        return
    members = torch.arange(at.numel(), device=at.device) if rows is None else rows
    p = torch.exp(x - x.max(-1, keepdim=True).values).sum(-1).reciprocal()  # [n] the pick's probability
    live = p >= gate.p_min
    if not gate.first:
        live &= gate.live.index_select(0, members)
    gate.live.index_copy_(0, members, live)
    if gate.first:
        gate.counted.index_copy_(0, members, live.long())
    else:
        gate.counted.index_add_(0, members, live.long())
    if gate.head_steps is not None:
        gate.head_steps.add_(1)
