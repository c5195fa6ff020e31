"""The verifier of one speculative round: which drafts to accept, which token follows.

Owns: `verify_greedy` (longest prefix matching the target argmax + bonus) and `verify_sampled`
(speculative rejection sampling, Leviathan et al. 2023 / Chen et al. 2023, exact in distribution),
plus `draft_probs_on_target_vocab` for reduced-vocabulary draft heads. Inputs and outputs are
device tensors; nothing here reads back to the host, so the caller reads `num_accepted` and
`out_ids` once per round. Does not know models, histories or filters: the caller passes the
already filtered distributions (`nextn.sample.pipeline.probs_from_logits`) and the uniforms
(`nextn.sample.pipeline.RequestRng`, streams ACCEPT and SAMPLE indexed by generated-token number).

Words: K drafts `draft_ids[j]` for generated positions i..i+K-1; the round emits the *accepted*
drafts draft_ids[:n], then either a *recovered* token (first rejection at n < K) or the *bonus*
token (n == K) — always n + 1 tokens. `num_drafts` (a device scalar <= K, default K) cuts the
drafts a confidence gate dropped: the round is then exactly a round of that many drafts.

Exactness contract for q (the draft distribution):
  * `draft_probs[j]` must be the exact distribution draft_ids[j] was drawn from, including the
    draft's own filters; the target's filters live in `target_probs`. Any q gives exact output as
    long as it is the law the draft was really drawn from; a q closer to p only raises acceptance.
  * Greedy drafts (argmax of the draft head) have a one-hot q: pass `draft_probs=None`; then a
    draft x is accepted with probability p(x) and a rejection resamples from p with x removed.
  * q is indexed by TARGET ids. A reduced-vocabulary draft head (FR-Spec) draws over Vd < V
    tokens; map its ids through `draft_to_target` [Vd] and scatter its probabilities onto the
    target vocabulary with zeros elsewhere (`draft_probs_on_target_vocab`) before calling
    `verify_sampled`. Target ids outside the draft vocabulary then have q = 0, so the residual
    max(0, p - q) keeps all their target mass: the output law stays exactly p. Equivalently,
    scatter the draft head's logits onto a [V] row filled with -inf and run the usual
    `probs_from_logits` on it (penalties and filters then use target ids and the target history).
  * A confidence gate (p_min) that cuts the chain at a draft x depending on x itself changes the
    law of the drafts that are verified: a draft is verified only when the gate let it through,
    so its law is q restricted to the tokens the gate lets through, renormalised
    (`gate_draft_probs`). Verifying it against the unrestricted q biases the output towards the
    tokens the head is confident about; against the restricted q the round is exact, and a cut
    draft is never drafted (the bonus at the cut comes from p).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from nextn.sample.pipeline import sample


class VerifyResult(NamedTuple):
    num_accepted: Tensor  # [] long, n in 0..K
    out_ids: Tensor  # [K+1] long: draft_ids[:n], then the recovered/bonus token, then -1


def verify_greedy(target_argmax: Tensor, draft_ids: Tensor, num_drafts: Tensor | int | None = None) -> VerifyResult:
    """target_argmax [K+1] long (per verify row, penalties applied), draft_ids [K] long."""
    K = draft_ids.shape[0]
    if K == 0:  # a plain step: the argmax is the token (one launch, not seven)
        return VerifyResult(target_argmax.new_zeros(()), target_argmax.long())
    # accept the longest prefix where the draft equals the target's argmax
    match = draft_ids == target_argmax[:K]  # [K]
    n = match.long().cumprod(0).sum()  # [] drafts before the first mismatch
    if isinstance(num_drafts, torch.Tensor):
        n = torch.minimum(n, num_drafts)
    # accepted drafts equal the argmax, and the argmax at row n is the bonus/correction
    pos = torch.arange(K + 1, device=target_argmax.device)  # [K+1]
    out_ids = torch.where(pos <= n, target_argmax.long(), -1)  # [K+1]
    return VerifyResult(n, out_ids)


def verify_sampled(
    target_probs: Tensor,
    draft_probs: Tensor | None,
    draft_ids: Tensor,
    uniforms_accept: Tensor,
    uniforms_resample: Tensor,
    num_drafts: Tensor | None = None,
) -> VerifyResult:
    """Speculative rejection sampling for one round.

    target_probs [K+1, V]: filtered target law per verify row (row j: after the first j drafts).
    draft_probs [K, V] over target ids (None: greedy drafts, one-hot q). draft_ids [K] long.
    uniforms_accept [K]: ACCEPT uniforms of positions i..i+K-1.
    uniforms_resample [K+1]: SAMPLE uniforms of positions i..i+K (only entry n is used).
    """
    K = draft_ids.shape[0]
    num_drafts = K if num_drafts is None else num_drafts
    device = target_probs.device
    rows = torch.arange(K, device=device)  # [K]
    p_x = target_probs[rows, draft_ids].double()  # [K] p_j(x_j)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[rows, draft_ids].double()
    # accept x_j with probability min(1, p_j(x_j) / q_j(x_j)):  u < p/q  <=>  u * q < p
    # (no division; p(x) = 0 is never accepted since u >= 0)
    accept = (uniforms_accept.double() * q_x < p_x) & (rows < num_drafts)  # [K]
    n = accept.long().cumprod(0).sum()  # [] drafts before the first rejection
    # first rejection at n < K: recovered token ~ norm(max(0, p_n - q_n));
    # all K accepted: bonus token ~ p_K (q_K := 0 below makes the same formula give p_K)
    p_n = target_probs.index_select(0, n.reshape(1))[0].float()  # [V]
    residual = (p_n - _draft_row(draft_probs, draft_ids, n, num_drafts, p_n)).clamp_(min=0.0)  # [V]
    # p == q makes a rejection impossible in exact arithmetic; if round-off still produced one
    # with an all-zero residual, draw from p_n
    residual = torch.where(residual.sum() > 0, residual, p_n)
    token = sample(residual, uniforms_resample.index_select(0, n.reshape(1)))  # [1]
    pos = torch.arange(K + 1, device=device)  # [K+1]
    drafts_padded = torch.cat([draft_ids.long(), draft_ids.new_full((1,), -1).long()])  # [K+1]
    out_ids = torch.where(pos < n, drafts_padded, -1).scatter(0, n.reshape(1), token.reshape(1))
    return VerifyResult(n, out_ids)


def _draft_row(draft_probs: Tensor | None, draft_ids: Tensor, n: Tensor, num_drafts, like: Tensor) -> Tensor:
    """q_n as [V] float32; zeros when n == num_drafts (the bonus row has no draft)."""
    K = draft_ids.shape[0]
    if K == 0:
        return torch.zeros_like(like)
    row = n.clamp(max=K - 1).reshape(1)  # [1]
    live = (n < num_drafts).float()  # [] 0 for the bonus row
    if draft_probs is None:  # one-hot q at the greedy draft
        return torch.zeros_like(like).scatter_(0, draft_ids.index_select(0, row), live.reshape(1))
    return draft_probs.index_select(0, row)[0].float() * live


def gate_draft_probs(q: Tensor, passed: Tensor) -> Tensor:
    """q [N, V] restricted to the tokens a confidence gate lets through (passed [N, V] bool) and
    renormalised, in place: the law of a draft given that the gate kept it. A row with no mass left
    stays zero (its draft is always cut, never verified)."""
    q.mul_(passed)
    return q.div_(q.sum(-1, keepdim=True).clamp_(min=torch.finfo(q.dtype).tiny))


def draft_probs_on_target_vocab(
    draft_probs: Tensor, draft_to_target: Tensor, vocab_size: int, out: Tensor | None = None
) -> Tensor:
    """Reduced-vocabulary q [K, Vd] -> q over target ids [K, V] (zeros outside the draft vocab),
    written into out [K, V] when given.

    draft_to_target [Vd] long maps draft-head ids to target ids (distinct). The drafted ids must be
    mapped the same way: `draft_to_target[draft_local_ids]`.
    """
    out = draft_probs.new_zeros(draft_probs.shape[0], vocab_size) if out is None else out.zero_()  # [K, V]
    index = draft_to_target.long().expand(draft_probs.shape[0], -1)  # [K, Vd]
    return out.scatter_(1, index, draft_probs)
