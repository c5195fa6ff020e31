"""Rounds: draft -> verify -> accept -> commit on the device for a batch of requests at once, and
the host side of each request, which queues its rounds one ahead and reads each round's tokens
once.

A round (`device_round`) is device work only, one CUDA graph per batch of (K, sampler kind), the
slots device values it reads (a member that is not plain greedy works on copies gathered at its
slot: `Lane`; sampled batches are not padded, pads are plain greedy rounds' alone):
the proposer drafts each request's K tokens after its pending token (K may differ, 0 for plain
decoding; a confidence gate may count fewer, down to none: the round then verifies the pending
token alone); one trunk step verifies every request's [pending, drafts] rows; per request, the
sampler accepts the longest matching prefix (greedy) or rejection-samples, and picks the bonus /
recovered token, which becomes the next round's pending token (it enters the trunk only as column
0 of the next verify: no round spends a forward on it alone); `commit_ctl` keeps the accepted
columns by moving the slot's pointers. Each request's outcome goes to a small buffer, [accepted,
drafts counted, tokens..., counters before the round], copied to pinned host memory. A request's
rows are computed with the same arithmetic alone or batched, so its output does not depend on
what runs beside it.

The host (`RequestRounds`) queues round r+1 before it reads round r, so its bookkeeping overlaps a
running round. EOS, stop ids, the token budget and the context end cut the tokens read (stop
strings are the caller's, through `close`); when a request ends inside round r, the round queued
after it is not kept: `close` recommits round r's columns with the same `commit_ctl` (no round
writes where a committed state lives, so nothing is undone). What is emitted never depends on the
overlap. Traced, a round also marks its draft, verify and commit (`PhaseClock`: CUDA events
inside its graph) and each request keeps a `RoundTrace` per round read.

Structured outputs: a request with a grammar needs host work inside its round (its matcher walks
the drafts to mask the verify rows, and each draft step when the chain is grammar-masked; see
nextn.grammar.state). So its rounds run eagerly, never captured, in a batch of the constrained
requests only, launched after the graphed batch of the others (whose graphs and batch compositions
are unchanged by it); and it never runs ahead: its round r+1 is launched only after round r was
read and the matcher advanced over what it emitted (that read writes row 0's mask of round r+1).
The rows are the same arithmetic as in any batch, so the output does not depend on what runs
beside it either way. A constrained request ends ("stop") at an EOS, which its grammar allows only
where it is complete, ignore_eos or not.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from nextn.cache import SlotCache, StepBatch, commit_ctl
from nextn.cache.hybrid import DRAFT_LEN, NUM_CTL, NUM_GEN, SEQ_LEN, commit_table
from nextn.config.model import ModelConfig
from nextn.core import SpecStats
from nextn.engine.runner import PhaseClock
from nextn.engine.scheduler import RoundSettings
from nextn.engine.sequence import Sequence
from nextn.grammar import GrammarState
from nextn.sample.pipeline import SamplerKind
from nextn.sample.sampler import SlotSampler
from nextn.spec.adaptive import AdaptiveK
from nextn.spec.k_policy import bucket

_N, _DRAFTED, _TOKENS = 0, 1, 2  # fields of a round's outcome buffer


def round_buffers(cfg: ModelConfig, k_max: int, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Per-slot buffers of a round with up to k_max drafts (R = k_max + 1 verify rows)."""
    R, V, H, f32 = k_max + 1, cfg.vocab_size, cfg.hidden_size, torch.float32
    return [
        ("verify_ids", (R,), torch.long),
        ("head_ids", (R,), torch.long),
        ("logits", (R, V), f32),
        ("hidden", (R, H), dtype),
        ("prev_logits", (R, V), f32),
        ("prev_hidden", (R, H), dtype),
        ("draft_q", (max(k_max, 1), V), f32),
        ("grammar_mask", (R, V), torch.bool),  # a constrained request's allowed tokens per row
        ("out", (_TOKENS + R + NUM_CTL,), torch.long),
    ]


class Buffers(NamedTuple):
    verify_ids: torch.Tensor  # [R] [pending token, drafts...]
    head_ids: torch.Tensor  # [R] the tokens the last round kept: its accepted drafts, the pending token
    logits: torch.Tensor  # [R, V] the last verify's logits (row j predicts emitted token j)
    hidden: torch.Tensor  # [R, H] its head-input hiddens
    prev_logits: torch.Tensor  # the verify before it (copied as a round starts)
    prev_hidden: torch.Tensor
    draft_q: torch.Tensor
    out: torch.Tensor  # [2 + R + NUM_CTL] the round's outcome

    @classmethod
    def of(cls, cache: SlotCache) -> Buffers:
        return cls(*(cache.t(name) for name in cls._fields))


class Member(NamedTuple):
    """One request's part of a batched round."""

    cache: SlotCache
    sampler: SlotSampler
    buf: Buffers
    k: int  # drafts this round (0: plain decoding)
    lane: Lane | None = None  # set: sampler and buf are copies gathered for the round (`Lane`)


class Lane(NamedTuple):
    """Where a member's gathered copies go back: its slot as a device index, so a round whose
    members' own work (sampled drafts, `_accept`) runs on copies gathered from the pool-wide
    tensors at that index, rather than on the slot's views, is one graph per batch of (K, sampler
    kind) whatever slots run (`runner.follow_slots` writes the index before each replay). Gathered
    per member per round (R = K_max + 1 rows): ctl (36 bytes), verify_ids (8R, twice: as the round
    starts and again after the drafts, which a ProfileProposer may rewrite in the pool) and head_ids (8R),
    the sampler's values (`SlotSampler.lane`: 36 bytes, + 24 (K + 1) sampled, + 5V with penalties,
    + V with min_tokens); the verify logits are the trunk step's own rows (no copy) and draft_q a
    scratch the drafts fill ([K, V] f32, zeroed). Written back: verify_ids after each draft (the
    next head step and the verify read the pool) and at the end, head_ids, out, ctl, and the
    output counts with penalties."""

    slot: torch.Tensor  # [1] long: the member's slot
    tensors: dict  # the pool-wide tensors [num_slots, ...]

    def store(self, name: str, value: torch.Tensor) -> None:
        """The slot's row of tensor `name` <- value (its shape without the slot dimension)."""
        self.tensors[name].index_copy_(0, self.slot, value[None])


def _lane(m: Member, slot: torch.Tensor, before: torch.Tensor, logits: torch.Tensor) -> Member:
    """m for one round on copies gathered at device slot index slot [1] (`Lane`); before: its ctl
    [NUM_CTL]; logits: its verify rows (the trunk step's, [K + 1, V]; filled by the verify)."""
    tensors, buf = m.cache.cache.tensors, m.buf
    ids, heads = (tensors[name].index_select(0, slot)[0] for name in ("verify_ids", "head_ids"))
    draft_q = buf.draft_q.new_zeros(buf.draft_q.shape[0] if not m.sampler.kind.greedy else 0, buf.draft_q.shape[1])
    lane_buf = Buffers(ids, heads, logits, None, None, None, draft_q, buf.out.new_empty(buf.out.shape))
    return Member(m.cache, m.sampler.lane(tensors, slot, before, m.k + 1), lane_buf, m.k, Lane(slot, tensors))


def device_round(runner, proposer, members: list[Member], clock=None) -> None:
    """One round of every member, device work only (clock: marks its draft, verify and commit)."""
    tensors = members[0].cache.cache.tensors
    _mark(clock, 0)
    # the trunk step's batch: every member's [pending, drafts] rows (its slots as device values)
    batch = runner.batch([m.cache for m in members], [m.k + 1 for m in members])
    slots = batch.slot_index
    befores = tensors["ctl"].index_select(0, slots)
    logits = runner.step_logits[: batch.num_rows]
    if not all(_plain_greedy(m) for m in members):  # their own work on copies at their device slots
        rows = [logits[batch.offsets[b] : batch.offsets[b] + m.k + 1] for b, m in enumerate(members)]
        members = [_lane(m, slots[b : b + 1], befores[b], rows[b]) for b, m in enumerate(members)]
    drafting = [b for b, m in enumerate(members) if m.k > 0]
    counted = proposer.propose([members[b] for b in drafting]) if drafting else None
    num_drafts = runner.index([m.k for m in members])  # [B] the drafts that count
    if counted is not None:  # a confidence gate cut some
        num_drafts = num_drafts.index_copy(0, runner.index(drafting), counted)
    for name in ("logits", "hidden"):  # what a request ending in the last round reads
        tensors[f"prev_{name}"].index_copy_(0, slots, tensors[name].index_select(0, slots))
    _mark(clock, 1)
    # one trunk step over every member's rows, out of and into the slots' buffers
    flat = batch.flat_rows(members[0].buf.verify_ids.shape[0])
    hidden = runner.step_hidden[: batch.num_rows]
    live = None if counted is None else (num_drafts + 1).to(torch.int32)  # a gate cut: the rows that count
    runner.step.trunk(batch, tensors["verify_ids"].view(-1).index_select(0, flat), logits, hidden, live=live)
    tensors["logits"].flatten(0, 1).index_copy_(0, flat, logits)
    tensors["hidden"].flatten(0, 1).index_copy_(0, flat, hidden)
    _mark(clock, 2)
    # greedy members without penalties: verified and committed together
    plain = [b for b, m in enumerate(members) if _plain_greedy(m)]
    if plain:
        _accept_greedy(runner, _Verified(batch, befores, logits, num_drafts, proposer is not None), members, plain)
    for b, m in enumerate(members):
        if b not in plain:
            _accept(m, befores[b], num_drafts[b], proposer is not None)
    if runner.pads is not None:  # pad members (nextn.engine.rounds._pads) commit nothing: their counters back
        tensors["ctl"].index_copy_(
            0, slots, torch.where(runner.pads[:, None], befores, tensors["ctl"].index_select(0, slots))
        )
    _mark(clock, 3)


def _mark(clock, i: int) -> None:
    if clock is not None:
        clock.mark(i)


def _plain_greedy(m: Member) -> bool:
    return m.sampler.plain_greedy


class _Verified(NamedTuple):
    """A batched round's verify, as its greedy members' accept reads it."""

    batch: StepBatch  # the trunk step's rows
    befores: torch.Tensor  # [B, NUM_CTL] the members' counters before the round
    logits: torch.Tensor  # [rows, V] the verify's logits
    num_drafts: torch.Tensor  # [B] the drafts that count
    heads: bool  # the round drafted: the next head pass writes the rows it kept


def _accept_greedy(runner, verified: _Verified, members: list[Member], index: list[int]) -> None:
    """`_accept` for the greedy members without penalties (members[b] for b in index), all at once
    (the same integer results): each row's argmax, the longest prefix of the drafts that count
    (counts [G]) matching it, the commit and the outcomes. With the Triton kernels one launch after
    the argmax (nextn.sample.triton_sample.accept_greedy); this is its reference."""
    batch, befores, logits, num_drafts, heads = verified
    counts = num_drafts if len(index) == len(members) else num_drafts.index_select(0, runner.index(index))
    group = [members[b] for b in index]
    R, tensors, G, cache = group[0].buf.verify_ids.shape[0], group[0].cache.cache.tensors, len(group), group[0].cache
    slots = batch.slot_index if G == len(batch) else batch.slot_index.index_select(0, runner.index(index))
    ks = runner.index([m.k for m in group])
    if runner.config.kernels == "triton":  # imported here: kernel modules load only where their kernels run
        from nextn.sample import triton_sample

        starts = runner.index([batch.offsets[b] for b in index])
        table = commit_table(cache.cols, True, True, logits.device)
        members = triton_sample.GreedyGroup(starts, slots, ks, counts, runner.index(index))
        triton_sample.accept_greedy(logits.argmax(-1), members, befores, tensors, table, heads)
        return
    rows = runner.index([batch.offsets[b] + i for b, m in zip(index, group, strict=True) for i in range(m.k + 1)])
    cells = runner.index([g * R + i for g, m in enumerate(group) for i in range(m.k + 1)])
    target = torch.full((G * R,), -1, dtype=torch.long, device=logits.device)
    target = target.index_copy_(0, cells, logits.argmax(-1).index_select(0, rows)).view(G, R)
    cols = torch.arange(R, device=logits.device)
    ids = tensors["verify_ids"].index_select(0, slots)  # [G, R]: pending, drafts
    match = (ids[:, 1:] == target[:, :-1]) & (cols[None, :-1] < counts[:, None])
    n = match.long().cumprod(1).sum(1)  # [G] drafts before the first mismatch
    out_ids = torch.where(cols[None] <= n[:, None], target, -1)  # accepted drafts, then the bonus
    ids[:, 0] = out_ids.gather(1, n[:, None])[:, 0]  # the next round's pending token
    tensors["verify_ids"].index_copy_(0, slots, ids)
    if heads:  # the next head pass writes the rows of what this round kept
        kept = cols[None] <= ks[:, None]
        head_ids = torch.where(kept, out_ids.clamp(min=0), tensors["head_ids"].index_select(0, slots))
        tensors["head_ids"].index_copy_(0, slots, head_ids)
    before = befores.index_select(0, runner.index(index))
    ctl = commit_ctl(before, (n + 1)[:, None], cache.cols, round_=True)
    tensors["ctl"].index_copy_(0, slots, ctl.to(torch.int32))
    tensors["out"].index_copy_(0, slots, torch.cat([n[:, None], counts[:, None], out_ids, before.long()], dim=1))


def _accept(m: Member, before: torch.Tensor, num_drafts: torch.Tensor, heads: bool) -> None:
    """Verify a member's drafts (the first num_drafts [] count), commit what it keeps and write its outcome."""
    cache, sampler, buf, k, lane = m
    if lane is not None:  # the drafts as the slot holds them (a ProfileProposer rewrites them there)
        buf.verify_ids.copy_(cache.cache.tensors["verify_ids"].index_select(0, lane.slot)[0])
    q = None if sampler.kind.greedy else buf.draft_q[:k]
    n, out_ids = sampler.verify(buf.logits[: k + 1], buf.verify_ids[1 : k + 1], q, num_drafts, before[NUM_GEN])
    sampler.record(out_ids, n)
    ctl = commit_ctl(before, n + 1, cache.cols, round_=True).to(torch.int32)
    buf.verify_ids[:1] = out_ids.index_select(0, n.reshape(1))  # the next round's pending token
    if heads:  # the next head pass writes the rows of what this round kept
        torch.clamp(out_ids, min=0, out=buf.head_ids[: k + 1])
    _write_outcome(buf, n, num_drafts, out_ids, before)
    if lane is None:
        cache.ctl.copy_(ctl)
        return
    for name, value in (("ctl", ctl), ("verify_ids", buf.verify_ids), ("head_ids", buf.head_ids), ("out", buf.out)):
        lane.store(name, value)
    if sampler.kind.penalties:
        lane.store("output_counts", sampler.history.output_counts)


@torch.inference_mode()
def advance(runner, proposer, rounds: list[RequestRounds]) -> tuple[list[Round | Exception], list[int]]:
    """One engine step of these requests: a batched round for those with none in flight, one
    queued ahead for those that can, then (eagerly, apart) a round of the constrained requests
    with none in flight, then each one's oldest round read. Returns the rounds read and the sizes
    of the batches launched. A request whose launch or read raises (its grammar failing mid-output
    is a RequestError of that request alone) gets the exception in place of its Round; the others'
    rounds stand (no round writes another slot)."""
    sizes, needs, ahead = [], RequestRounds.needs_round, RequestRounds.wants_ahead
    free, constrained = [r for r in rounds if r.grammar is None], [r for r in rounds if r.grammar is not None]
    failed: dict[RequestRounds, Exception] = {}  # what a request's launch raised
    for wanted, among in ((needs, free), (ahead, free), (needs, constrained)):
        group = [r for r in among if wanted(r) and r not in failed]
        if group:
            try:
                launch(runner, proposer, group)
            except Exception as e:
                failed.update(dict.fromkeys(group, e))
                continue
            sizes.append(len(group))
    return [failed.get(r) or _read(r) for r in rounds], sizes


def _read(rounds: RequestRounds) -> Round | Exception:
    """The request's oldest round, or what reading it raised."""
    try:
        return rounds.read()
    except Exception as e:
        return e


@torch.inference_mode()
def launch(runner, proposer, rounds: list[RequestRounds]) -> None:
    """One batched round of these requests (one CUDA graph per batch of (K, sampler kind), whatever
    slots run; eagerly when they are constrained: all or none); each queues the read of its outcome."""
    members = [r.member() for r in rounds]
    traced = rounds[0].trace is not None
    if rounds[0].grammar is None and runner.pad_rounds and len({m.k for m in members}) == 1:
        members += _pads(runner, members)
    slots = [m.cache.slot for m in members]
    if rounds[0].grammar is not None:  # host masks inside the round: never captured
        key = ("round", tuple(zip(slots, (m.k for m in members), strict=True)), id(proposer), traced)
        clock = runner.clock(key) if traced else None
        runner.graph_counts["eager"] += 1
        device_round(runner, proposer, members, clock)
    else:  # one graph per batch of Ks (and sampler kinds, where any is not plain greedy), any slots
        if all(m.sampler.plain_greedy for m in members):
            key = ("greedy round", tuple(m.k for m in members), id(proposer), traced)
        else:  # the members' sampling work on copies gathered at their device slots (`Lane`)
            key = ("round", tuple((m.k, m.sampler.kind) for m in members), id(proposer), traced)
        clock = runner.clock(key) if traced else None
        with runner.follow_slots(slots, len(rounds)):
            runner.run(key, lambda: device_round(runner, proposer, members, clock))
    for r in rounds:
        r.queue_read(clock)


class _PadSampler(NamedTuple):
    """A pad member's sampler: plain greedy (it reads no sampling values)."""

    plain_greedy: bool = True
    kind: SamplerKind = SamplerKind(greedy=True)


def _pads(runner, members: list[Member]) -> list[Member]:
    """Members on spare slots (free ones, or kept sessions': no request runs there) that fill a batch
    of plain greedy members at one K up to its size bucket (nextn.spec.k_policy.bucket), so rounds
    of 1..bucket requests share one graph. A pad's round leaves its slot as it was: it writes only
    where no committed state lives (K/V and draft K/V past the committed positions, the step halves
    of the GDN buffers, the round buffers a request's start rewrites) and its counters are put back
    at the round's end (inside the graph: `device_round`); its outcome is never read. None without
    enough spare slots (or where a member is not plain greedy)."""
    need = padded_size(len(members), runner.pool.num_slots) - len(members)
    spare = runner.spare_slots
    if not need or len(spare) < need or not all(m.sampler.plain_greedy for m in members):
        return []
    k = members[0].k
    return [Member(runner.slot(s), _PadSampler(), Buffers.of(runner.slot(s)), k) for s in spare[:need]]


def padded_size(batch_size: int, num_slots: int) -> int:
    """The size a round of batch_size plain greedy members is padded to: its bucket, or every slot
    where the pool holds fewer (a pool of 60 pads 57 to 60, not to 64, which it cannot fill)."""
    return min(bucket(batch_size), num_slots)


@torch.inference_mode()
def warm_up(runner, proposer, max_batch: int, ks: list[int]) -> int:
    """Capture the graphs of greedy rounds at every batch-size bucket up to max_batch and each K of
    ks before any request runs (a key runs eagerly the first time, is captured the second), so a
    server's first requests replay rather than capture. The rounds run on pad members only (a
    pad's round leaves its slot as it was). Returns the graphs captured."""
    before = runner.graph_counts["captures"]
    sizes = sorted({padded_size(b, runner.pool.num_slots) for b in range(1, min(max_batch, runner.pool.num_slots) + 1)})
    for size in sizes:
        slots = list(range(size))
        for k in ks:
            members = [Member(runner.slot(s), _PadSampler(), Buffers.of(runner.slot(s)), k) for s in slots]
            key = ("greedy round", (k,) * size, id(proposer), False)
            for _ in range(2):
                with runner.follow_slots(slots, 0):
                    runner.run(key, lambda members=members: device_round(runner, proposer, members))
    return runner.graph_counts["captures"] - before


def first_token(cache: SlotCache, sampler: SlotSampler, buf: Buffers, seq: Sequence) -> None:
    """The token after the prompt, from the trunk's last logits: the outcome of a round with no
    verify (nothing committed). Sets up the first round's head pass (the pending token's row)."""
    ctl = cache.ctl
    before = ctl.clone()
    buf.logits[:1] = seq.last_logits
    buf.hidden[:1] = seq.last_hidden
    n, out_ids = sampler.verify(buf.logits[:1], buf.verify_ids[:0], None, 0, before[NUM_GEN])
    sampler.record(out_ids, n)
    buf.verify_ids[:1] = out_ids
    buf.head_ids[:1] = out_ids
    ctl[NUM_GEN] += 1
    _write_outcome(buf, n, n, out_ids, before)


def _write_outcome(buf: Buffers, n, drafted, out_ids, before) -> None:
    """buf.out = [accepted, drafts counted, tokens (-1 padded to R), counters before the round]."""
    pad = out_ids.new_full((buf.verify_ids.shape[0] - out_ids.numel(),), -1)
    buf.out.copy_(torch.cat([n.reshape(1), drafted.reshape(1), out_ids, pad, before.long()]))


class Round(NamedTuple):
    """One round as read on the host, cut at a stop token, the budget or the context end."""

    token_ids: list[int]
    logits: torch.Tensor | None  # [len(token_ids), V] the rows that predicted them (when asked)
    finish_reason: str | None  # None while running, else "stop" or "length"


class _Read(NamedTuple):
    index: int  # 0: the first token; r >= 1: a verify round
    n: int
    tokens: list[int]  # emitted, uncut
    before: list[int]  # ctl before the round


class _Queued(NamedTuple):
    index: int  # as in _Read
    host: torch.Tensor  # where its outcome lands
    event: torch.cuda.Event | None  # recorded after the copy (CUDA)
    k: int  # its drafts (before a gate)
    clock: PhaseClock | None  # its phases (traced)


class RoundTrace(NamedTuple):
    """One verify round as traced: K drafted, the drafts that counted (a gate may cut), accepted,
    the wall time of the round's phases (a batched round's, shared by its requests), and whether it
    verified the pending token alone (K = 0, or the gate cut draft 1; a round that drafted but was
    cut to its first token by max_tokens or a stop counts 0 drafted too, and is not one)."""

    k: int
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    commit_s: float
    zero_draft: bool


class RequestRounds:
    """The rounds of one request on one slot. Rounds are launched in batches (`launch`): one when
    the request has none in flight (`needs_round`), and one ahead (`wants_ahead`, unless the
    request wants logits, which the next round would overwrite, has a grammar, is traced, or `ahead`
    is off); `read()` reads the oldest; `next()` does all three for a request running alone.
    `close(kept)` ends the request after `kept` tokens of the last round read and leaves the slot's
    state as exactly those tokens. `settings`: what the request asked (its sampling params, stop
    ids, K, ...), as its Request carries them; `stats` counts its rounds. `grammar`: the request's
    matcher (structured outputs), advanced by `read`. Traced (settings.trace), each round read adds
    a `RoundTrace` to `trace` (a round queued ahead would blur the phases)."""

    def __init__(
        self,
        runner,
        proposer,
        seq: Sequence,
        settings: RoundSettings,
        grammar: GrammarState | None = None,
        ahead: bool = True,
    ):
        self.runner, self.proposer, self.seq, self.settings = runner, proposer, seq, settings
        self.cache = runner.slot(seq.slot)
        self.buf = Buffers.of(self.cache)
        spec = runner.config.spec
        self.sampler = SlotSampler(self.cache, spec.p_min, fast=runner.config.kernels == "triton")
        self.grammar = grammar
        stop_ids = set(settings.stop_ids)
        if grammar is not None:  # the grammar's end is the request's
            stop_ids |= set(grammar.eos_ids)
        self.stop_ids, self.stats = stop_ids, SpecStats()
        self.ahead = ahead and not settings.want_logits and grammar is None and not settings.trace
        self.trace: list[RoundTrace] | None = [] if settings.trace else None
        k_max = spec.num_speculative_tokens if proposer is not None else 0
        k = k_max if settings.num_speculative_tokens is None else settings.num_speculative_tokens
        self.k_ctl = AdaptiveK(k, spec.adaptive, runner.cfg.hidden_size)
        self.step_k: int | None = None  # the K of the rounds launched now, when the engine's K policy sets it
        self.max_len = self.cache.max_len
        self.inflight: deque[_Queued] = deque()
        self.launched = 0  # rounds queued (round 0 included)
        if runner.device.type == "cuda":  # round r's outcome lands in host[r % 2]: one round is read while one runs
            self.host = [torch.empty_like(self.buf.out, device="cpu", pin_memory=True) for _ in range(2)]
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.reads: list[_Read] = []  # the last two rounds read
        # the last round read, counted in stats once what it emits is final (a stop string may cut it)
        self.unrecorded: RoundTrace | None = None
        self.emitted: list[int] = []  # tokens handed out
        self.handed = 0  # of them, from the last round read
        self.prompt_len = len(seq.tokens)
        self.next_start = len(seq.tokens)  # committed tokens when the oldest unread round starts
        self.closed = False
        self._start()

    @torch.inference_mode()
    def _start(self) -> None:
        if self.proposer is not None:
            self.runner.catch_up(self.seq)
        self.sampler.start(self.settings.params, self.seq.tokens, self.stop_ids, self.grammar)
        self.cache.set(num_gen=0, accepted=0)
        first_token(self.cache, self.sampler, self.buf, self.seq)
        self.queue_read()

    def member(self) -> Member:
        return Member(self.cache, self.sampler, self.buf, self.k)

    @property
    def k(self) -> int:
        """The drafts of the next round launched: its own K (adaptive or asked), or what the
        engine's batch K policy set for this step (nextn.spec.k_policy.request_k)."""
        return self.k_ctl.k if self.step_k is None else self.step_k

    def needs_round(self) -> bool:
        return not self.closed and not self.inflight and self.next_start < self.max_len

    def wants_ahead(self) -> bool:
        return not self.closed and len(self.inflight) == 1 and self.ahead and self.next_start < self.max_len

    def queue_read(self, clock: PhaseClock | None = None) -> None:
        """Start the copy of the round just queued's outcome to the host (read in `next`)."""
        if self.runner.device.type == "cuda":
            host, event = self.host[self.launched % 2], self.events[self.launched % 2]
            host.copy_(self.buf.out, non_blocking=True)
            event.record()
        else:
            host, event = self.buf.out.clone(), None
        self.inflight.append(_Queued(self.launched, host, event, self.k, clock))
        self.launched += 1

    @torch.inference_mode()
    def next(self) -> Round:
        """Run alone: launch this request's round if none is in flight, one ahead, read the oldest."""
        if self.closed:
            raise RuntimeError("the request's rounds are closed")
        r = advance(self.runner, self.proposer, [self])[0][0]
        if isinstance(r, Exception):
            raise r
        return r

    @torch.inference_mode()
    def read(self) -> Round:
        """The oldest round in flight, as read on the host."""
        if not self.inflight:  # the context is full: no round can run (nothing read)
            return Round([], None, "length")
        index, host, event, k, clock = self.inflight.popleft()
        if event is not None:
            event.synchronize()
        out = host.tolist()
        R = self.buf.verify_ids.shape[0]
        n, tokens, before = out[_N], out[_TOKENS : _TOKENS + out[_N] + 1], out[_TOKENS + R :]
        self.reads = (self.reads + [_Read(index, n, tokens, before)])[-2:]
        room = 1  # the first token commits nothing
        self._record(None)
        if index > 0:
            room = self.max_len - before[SEQ_LEN]  # a round commits what it emits but the last
            self.next_start = before[SEQ_LEN] + n + 1
            if room > 0:  # (a round queued ahead into a full context counts for nothing)
                self.k_ctl.update(n, self.next_start)
                times = clock.split() if clock else (0.0, 0.0, 0.0)
                self.unrecorded = RoundTrace(k, out[_DRAFTED], n, *times, zero_draft=out[_DRAFTED] == 0)
        read = self._cut(index, tokens, room)
        if self.grammar is not None and read.finish_reason is None:  # masks row 0 of the next round
            self.grammar.commit(read.token_ids)
        return read

    def _record(self, kept: int | None) -> None:
        """Count the last round read in stats (and the trace) with the `kept` tokens it emitted (None:
        all it handed out). Counted are the tokens a user gets (SpecStats.record_emitted), so the
        first token plus each round's 1 + accepted is the output's length."""
        r, self.unrecorded = self.unrecorded, None
        m = self.handed if kept is None else kept
        counted = None if r is None else self.stats.record_emitted(r.drafted, r.accepted, r.zero_draft, m)
        if counted is not None and self.trace is not None:
            self.trace.append(r._replace(drafted=counted[0], accepted=counted[1]))

    def _cut(self, index: int, tokens: list[int], room: int) -> Round:
        budget, done = self.settings.params.max_tokens, None
        kept = tokens[: max(0, min(len(tokens), budget - len(self.emitted), room))]
        for i, t in enumerate(kept):
            if t in self.stop_ids:
                kept, done = kept[: i + 1], "stop"
                break
        if done is None and (len(self.emitted) + len(kept) >= budget or len(kept) < len(tokens)):
            done = "length"
        self.emitted.extend(kept)
        self.handed = len(kept)
        logits = None
        if self.settings.want_logits and kept:
            logits = (self.seq.last_logits[None] if index == 0 else self.buf.logits[: len(kept)]).clone()
        return Round(kept, logits, done)

    @torch.inference_mode()
    def close(self, kept: int | None = None) -> None:
        """End the request after `kept` tokens of the last round read (None: all it handed out;
        fewer: a stop string). The slot then holds the prompt and every emitted token but the last."""
        if self.closed:
            return
        if not self.reads:  # nothing read yet: the first token's outcome tells where things stand
            self.read()
            kept = 0
        kept = self.handed if kept is None else kept
        if kept > self.handed:
            raise ValueError(f"close({kept}) after a round that handed out {self.handed} tokens")
        del self.emitted[len(self.emitted) - (self.handed - kept) :]
        self._record(kept)
        self.closed = True
        self._settle(self.reads[-1], kept, ahead=bool(self.inflight))
        self.inflight.clear()

    def _settle(self, last: _Read, kept: int, ahead: bool) -> None:
        """The slot's counters and the sequence's record after `kept` tokens of round `last`."""
        if last.index > 0 and kept == 0:  # a round queued into a full context: the one before stands whole
            last, kept, ahead = self.reads[-2], len(self.reads[-2].tokens), True
        seq, cache, buf = self.seq, self.cache, self.buf
        seq.tokens[self.prompt_len :] = self.emitted[:-1]
        ctl = torch.tensor(last.before, dtype=torch.int32)
        if last.index > 0:  # (the first token commits nothing)
            ctl = commit_ctl(ctl, kept, cache.cols, round_=True)
            hidden, logits = (buf.prev_hidden, buf.prev_logits) if ahead else (buf.hidden, buf.logits)
            seq.last_hidden, seq.last_logits = hidden[kept - 1].clone(), logits[kept - 1].clone()
        if seq.heads:  # rows of the round's kept drafts are pending (the next head pass rewrites them)
            seq.draft_len, seq.pending_ids, seq.pending_hidden = int(ctl[DRAFT_LEN]), [], None
            if last.index > 0:
                seq.queue_rows(last.tokens[: kept - 1], hidden[: kept - 1].clone())
        cache.ctl.copy_(ctl.to(cache.ctl.device))
