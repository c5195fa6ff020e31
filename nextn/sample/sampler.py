"""One slot's token choice on the device: the request's sampling values as device scalars, its
seeded uniforms and its penalty history, kept in the slot's cache buffers, so a round's CUDA graph
(captured once per batch of K and `SamplerKind`: a round works on copies of them gathered at the
slot's device index, `lane`) serves every request in any slot. Drawing, drafting and
verifying are device ops with no host read; the host fills the buffers once per request.

Generated token number i always uses uniform i of its stream (nextn.sample.pipeline), so a seeded request
reproduces whatever K is and however its tokens fall into rounds.

A request with a grammar (`SamplerKind.grammar`) has a host-side `GrammarState` (nextn.grammar)
that writes the allowed tokens of each round row into the slot's mask buffer; its rounds run
eagerly (nextn.engine.rounds), so `draft` and `verify` call its hooks, which read the drafts to the
host. The masks apply to the logits before every other transform, on both sides (the target's
rows in `verify`, and the head's when drafts are grammar-masked), so p and q are the masked,
renormalised laws and rejection sampling stays exact against constrained plain sampling.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from nextn.cache import SlotCache
from nextn.cache.hybrid import NUM_GEN, to_device
from nextn.config import STEP_ROWS
from nextn.core import SamplingParams
from nextn.grammar import GrammarState
from nextn.sample.pipeline import (
    Law,
    RequestRng,
    SamplerKind,
    Stream,
    TokenHistory,
    greedy_ids,
    penalized_logits,
    probs_from_logits,
    sample,
)
from nextn.sample.verifier import VerifyResult, gate_draft_probs, verify_greedy, verify_sampled
from nextn.spec.draft_vocab import DraftHead

VALUES = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens")


def sampler_buffers(vocab_size: int, max_len: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Per-slot buffers: values, top_k, uniforms of every stream for any generated index a request
    can reach (a round may draft 2 * STEP_ROWS past the budget), penalty history."""
    return [
        ("sampling_values", (len(VALUES),), torch.float32),
        ("sampling_top_k", (1,), torch.long),
        ("uniforms", (len(Stream), max_len + 2 * STEP_ROWS + 2), torch.float64),
        ("prompt_mask", (vocab_size,), torch.bool),
        ("output_counts", (vocab_size,), torch.int32),
        ("stop_mask", (vocab_size,), torch.bool),  # the tokens min_tokens bans
    ]


class SlotSampler:
    """fast (the Triton backend's choice): sampled drafts (over the full vocabulary), verify rows
    and the rejection sampling through Triton kernels (the law after penalties and masks:
    temperature, top-k, top-p, min-p): nextn.sample.triton_sample's one-launch kernels where the
    vocabulary fits one program (MAX_V columns), nextn.sample.triton_wide's chunked ones where it
    does not (the released models' 248,320)."""

    def __init__(self, cache: SlotCache, p_min: float = 0.0, fast: bool = False):
        self.p_min = p_min
        self.kernels = None
        if fast:  # imported here: kernel modules load only where their kernels run
            from nextn.sample import triton_sample, triton_wide

            narrow = cache.t("prompt_mask").numel() <= triton_sample.MAX_V
            self.kernels = triton_sample if narrow else triton_wide
        values = cache.t("sampling_values")
        self.values = SimpleNamespace(
            **{name: values[i] for i, name in enumerate(VALUES)}, top_k=cache.t("sampling_top_k")[0]
        )
        self.uniforms = cache.t("uniforms")  # [streams, U] float64
        self.base = 0  # the generated index of the uniforms' column 0 (a lane's window: `lane`)
        self.history = TokenHistory(cache.t("prompt_mask"), cache.t("output_counts"))
        self.stop_mask = cache.t("stop_mask")
        self.ctl = cache.ctl
        self.kind = SamplerKind(greedy=True)
        self.grammar: GrammarState | None = None

    def start(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        stop_ids: set[int] = frozenset(),
        grammar: GrammarState | None = None,
    ) -> None:
        """Load a request's values, uniforms and history (host -> device, once per request);
        stop_ids: the tokens min_tokens bans (EOS and the request's stop ids); grammar: the
        request's matcher, when it has structured outputs."""
        self.kind = SamplerKind.of(params)
        if self.kind.grammar != (grammar is not None):
            raise ValueError("a request with structured_outputs takes its GrammarState (and only such a request)")
        self.grammar = grammar
        device = self.uniforms.device
        for name in VALUES:
            getattr(self.values, name).fill_(getattr(params, name))
        self.values.top_k.fill_(params.top_k)
        if not self.kind.greedy:
            count = min(self.uniforms.shape[1], params.max_tokens + 2 * STEP_ROWS + 2)
            self.uniforms[:, :count].copy_(RequestRng(params.seed).table(0, count, device))
        if self.kind.min_tokens:
            self.stop_mask.zero_()
            if stop_ids:
                self.stop_mask.index_fill_(0, to_device(sorted(stop_ids), device), True)
        if self.kind.penalties:
            self.history.prompt_mask.zero_()
            self.history.prompt_mask.index_fill_(0, to_device(prompt_ids, device), True)
            self.history.output_counts.zero_()

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits before the argmax (no penalty, min_tokens ban
        or grammar mask): its drafts can take the fused argmax-and-gate step (nextn.spec.proposer)
        and its verify the batched argmax (nextn.engine.rounds)."""
        kind = self.kind
        return kind.greedy and not kind.penalties and not kind.min_tokens and not kind.grammar

    def lane(self, tensors: dict, slot: torch.Tensor, ctl: torch.Tensor, count: int) -> SlotSampler:
        """This sampler for one round on the slot at device index slot ([1] long), over copies
        gathered from the pool-wide tensors ([num_slots, ...]) rather than the slot's views, so a
        round's graph serves whichever slot the index names (nextn.engine.device_round.Lane): ctl: the
        slot's counters before the round [NUM_CTL]; count: the round's rows (K + 1). Gathered is
        only what the request's kind reads: values and top_k (36 bytes); sampled, the uniforms of
        generated indices NUM_GEN..NUM_GEN + count - 1 of each stream (3 * count * 8 bytes); with
        penalties the prompt mask and output counts (5 * V bytes; the counts are written back by
        the caller: `history.output_counts`); with min_tokens the stop mask (V bytes)."""
        lane = copy.copy(self)
        values = tensors["sampling_values"].index_select(0, slot)[0]
        top_k = tensors["sampling_top_k"].index_select(0, slot)[0, 0]
        lane.values = SimpleNamespace(**{name: values[i] for i, name in enumerate(VALUES)}, top_k=top_k)
        lane.ctl, lane.uniforms, lane.history, lane.stop_mask = ctl, None, None, None
        if not self.kind.greedy:  # the window [streams, count] of the slot's table from NUM_GEN
            streams, U = self.uniforms.shape
            lane.base = ctl[NUM_GEN]
            rows = (slot * streams + torch.arange(streams, device=slot.device)) * U + lane.base.long()
            cells = rows[:, None] + torch.arange(count, device=slot.device)
            lane.uniforms = tensors["uniforms"].view(-1).index_select(0, cells.view(-1)).view(streams, count)
        if self.kind.penalties:
            gathered = (tensors[name].index_select(0, slot)[0] for name in ("prompt_mask", "output_counts"))
            lane.history = TokenHistory(*gathered)
        if self.kind.min_tokens:
            lane.stop_mask = tensors["stop_mask"].index_select(0, slot)[0]
        return lane

    def uniforms_at(self, stream: Stream, start: torch.Tensor, count: int) -> torch.Tensor:
        """Uniforms [count] of indices start.. (start a device scalar)."""
        idx = (start.long() - self.base) + torch.arange(count, device=self.uniforms.device)
        return self.uniforms[int(stream)].index_select(0, idx)

    def _history(self):
        return self.history if self.kind.penalties else None

    def _fused_law(self, logits: torch.Tensor, u=None, out=None, ids=None) -> torch.Tensor:
        """The request's law over logits rows [N, V] (penalized and masked), and the draws into ids
        with uniforms u, through the one-launch kernel (nextn.sample.triton_sample)."""
        values, kind = self.values, self.kind
        law = Law(
            values.temperature,
            top_k=values.top_k if kind.top_k else None,
            top_p=values.top_p if kind.top_p else None,
            min_p=values.min_p if kind.min_p else None,
        )
        probs, _ = self.kernels.temperature_sample(logits, law, u, out=out, ids=ids)
        return probs

    def _banned(
        self,
        logits: torch.Tensor,
        first: torch.Tensor,
        columns: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits [N, V] of generated indices first.. with the stop tokens masked out where the
        index is below min_tokens, and with the tokens outside allowed [N, V] bool (the grammar's,
        None: no grammar) masked out (draft and target alike: the same law on both sides). A row
        the ban would empty keeps the grammar's tokens; a row with no allowed column (a draft
        vocabulary with no legal token) stays unmasked: its draft is rejected by the verify.
        columns [Vd]: the target ids of the logits' columns (a draft vocabulary's d2t; default all V)."""
        if allowed is not None and columns is not None:
            allowed = allowed[:, columns]
        if self.kind.min_tokens:
            index = first.long() + torch.arange(logits.shape[0], device=logits.device)
            stop = self.stop_mask if columns is None else self.stop_mask[columns]
            ban = (index < self.values.min_tokens)[:, None] & stop[None]
            if allowed is None:
                return logits.float().masked_fill(ban, float("-inf"))
            allowed = _unless_empty(allowed & ~ban, allowed)
        if allowed is None:
            return logits
        return logits.float().masked_fill(~_unless_empty(allowed, torch.ones_like(allowed)), float("-inf"))

    def draft(
        self,
        logits: torch.Tensor,
        drafts_so_far: torch.Tensor,
        u: torch.Tensor | None,
        token: torch.Tensor,
        q: torch.Tensor,
        vocab: DraftHead | None = None,
    ):
        """One draft step from head logits [1, V] into token ([1] long, a slot of the round's ids)
        and, sampled, its law into q ([1, V], a row of the round's buffer); drafts_so_far [j] long;
        u [1]: the draft's DRAFT uniform. With a draft vocabulary `vocab`, logits are [1, Vd] over
        its rows: the pick maps through d2t, q is the subset's law scattered onto the target ids
        (zero elsewhere), penalties and the min_tokens ban read target ids projected onto the subset.
        Returns the head's probability of its pick [1] (over the subset, with a draft vocabulary)
        when a p_min gate is on, else None; sampled, q is then the law of a draft the gate keeps
        (restricted to the tokens whose head probability reaches p_min: nextn.sample.verifier)."""
        history, so_far, pick, columns = self._history(), drafts_so_far, token, None
        if vocab is not None:
            history, so_far = vocab.project(history, drafts_so_far)
            pick, columns = torch.empty_like(token), vocab.d2t  # the draft row, mapped to its target id below
        j, masked = drafts_so_far.numel(), self.grammar is not None and self.grammar.draft_mask
        allowed = self.grammar.masks[j : j + 1] if masked else None
        logits = self._banned(logits, self.ctl[NUM_GEN] + j, columns, allowed)  # draft j: NUM_GEN + j
        probs = None
        if self.kind.greedy:
            torch.argmax(penalized_logits(logits, self.values, history, so_far, self.kind), dim=-1, out=pick)
        elif self.kernels is not None and vocab is None:
            probs = self._fused_law(penalized_logits(logits, self.values, history, so_far, self.kind), u, q, pick)
        else:
            probs = probs_from_logits(logits, self.values, history, so_far, self.kind, out=q if vocab is None else None)
            sample(probs, u, out=pick)
        confidence = None
        if self.p_min > 0.0:
            head = torch.softmax(logits.float(), dim=-1)  # [1, V or Vd] the head's own probabilities
            confidence = head.gather(-1, pick[:, None])[:, 0]
            if probs is not None:
                gate_draft_probs(probs, head >= self.p_min)
        if vocab is not None:
            if probs is not None:
                vocab.scatter(probs, out=q)
            vocab.to_target(pick, out=token)
        if masked:  # the grammar walks the draft (a host read) to mask the next one
            self.grammar.drafted(j, token)
        return confidence

    def verify(
        self,
        logits: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_q: torch.Tensor | None,
        num_drafts,
        index: torch.Tensor,
    ) -> VerifyResult:
        """Verify rows logits [k+1, V] (row 0 predicts generated index `index`) against draft_ids
        [k] (q [k, V] or None when greedy), the first num_drafts of which count. Under a grammar
        each row is masked by the grammar state after its drafts (the walk is a host read)."""
        allowed = None
        if self.grammar is not None:
            self.grammar.walk(draft_ids)
            allowed = self.grammar.masks[: draft_ids.numel() + 1]
        logits = self._banned(logits, index, None, allowed)
        if self.kind.greedy:
            target = greedy_ids(logits, self.values, self._history(), draft_ids, self.kind)  # [k+1]
            return verify_greedy(target, draft_ids, num_drafts)
        if self.kernels is not None:
            p = self._fused_law(penalized_logits(logits, self.values, self._history(), draft_ids, self.kind))
            n, out_ids = self.kernels.verify_sampled(
                p, draft_q, draft_ids, self.uniforms, index - self.base, num_drafts
            )
            return VerifyResult(n, out_ids)
        k = draft_ids.numel()
        p = probs_from_logits(logits, self.values, self._history(), draft_ids, self.kind)  # [k+1, V]
        return verify_sampled(
            p,
            draft_q,
            draft_ids,
            self.uniforms_at(Stream.ACCEPT, index, k),
            self.uniforms_at(Stream.SAMPLE, index, k + 1),
            num_drafts,
        )

    def record(self, out_ids: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Count a round's emitted tokens (out_ids [k+1], the first n+1 real) in the penalty history."""
        if self.kind.penalties:
            kept = (torch.arange(out_ids.numel(), device=out_ids.device) <= num_accepted).int()
            self.history.output_counts.index_add_(0, out_ids.clamp(min=0), kept)


def _unless_empty(mask: torch.Tensor, otherwise: torch.Tensor) -> torch.Tensor:
    """mask [N, V] bool, with its rows that allow nothing taken from otherwise."""
    return torch.where(mask.any(-1, keepdim=True), mask, otherwise)
