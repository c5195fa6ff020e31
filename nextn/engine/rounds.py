"""Rounds, the host side: each request queues its rounds one ahead and reads each round's tokens
once; a step launches a batch's round (nextn.engine.device_round: the device work) as one CUDA graph
per batch of (K, sampler kind), padded to its size bucket, whatever slots run.

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

from nextn.cache import StepBatch, commit_ctl
from nextn.cache.hybrid import DRAFT_LEN, SEQ_LEN, to_device
from nextn.config import GDN_CHUNK
from nextn.core import SpecStats
from nextn.engine.device_round import OUT_ACCEPTED, OUT_DRAFTED, OUT_TOKENS, Buffers, Member, device_round, first_token
from nextn.engine.riding import Pad
from nextn.engine.runner import PhaseClock
from nextn.engine.scheduler import RoundSettings
from nextn.engine.sequence import Sequence
from nextn.grammar import GrammarState
from nextn.sample.pipeline import SamplerKind
from nextn.sample.sampler import SlotSampler
from nextn.spec.adaptive import AdaptiveK
from nextn.spec.k_policy import bucket


@torch.inference_mode()
def advance(
    runner, proposer, rounds: list[RequestRounds], riding=None
) -> tuple[list[Round | Exception], list[int], bool]:
    """One engine step of these requests: one batched round of the unconstrained ones, each with
    none in flight or one queued ahead, then (eagerly, apart) a round of the constrained requests
    with none in flight, then each one's oldest round read. A request starting (its first token
    in flight) joins the running requests' round: no round of its own. riding
    (nextn.engine.riding.Riding): prompt pieces that ride the unconstrained round (a mixed step).
    Returns the rounds read, the sizes of the batches launched and whether the pieces rode. A
    request whose launch or read raises (its grammar failing mid-output is a RequestError of that
    request alone) gets the exception in place of its Round; the others' rounds stand (no round
    writes another slot), and pieces whose round raised did not ride."""
    sizes = []
    free, constrained = [r for r in rounds if r.grammar is None], [r for r in rounds if r.grammar is not None]
    failed: dict[RequestRounds, Exception] = {}  # what a request's launch raised
    rode = False
    groups = (
        ([r for r in free if r.needs_round() or r.wants_ahead()], riding),
        ([r for r in constrained if r.needs_round()], None),
    )
    for group, carried in groups:
        if group:
            try:
                launch(runner, proposer, group, carried)
            except Exception as e:
                failed.update(dict.fromkeys(group, e))
                continue
            rode = rode or carried is not None
            sizes.append(len(group))
    return [failed.get(r) or _read(r) for r in rounds], sizes, rode


def _read(rounds: RequestRounds) -> Round | Exception:
    """The request's oldest round, or what reading it raised."""
    try:
        return rounds.read()
    except Exception as e:
        return e


@torch.inference_mode()
def launch(runner, proposer, rounds: list[RequestRounds], riding=None) -> None:
    """One batched round of these requests (one CUDA graph per batch of (K, sampler kind), whatever
    slots run; eagerly when they are constrained: all or none); each queues the read of its
    outcome. riding (nextn.engine.riding.Riding): prompt pieces that ride the round, a mixed step,
    graphed too: keyed also by the pieces' sizes (StepBatch.sizes: their count, total rows and
    chunks; the split written before the round, `runner.resplit`), their slots followed after the
    members' (and the pads', which never take a riding slot), their host records after it
    (runner.landed)."""
    members = [r.member() for r in rounds]
    traced = rounds[0].trace is not None
    if riding is not None and runner.pad_rounds and riding.chunked:  # (before the members' pads take slots)
        riding = _pad_piece(runner, riding, sum(m.k + 1 for m in members))
    if rounds[0].grammar is None and runner.pad_rounds and len({m.k for m in members}) == 1:
        members += _pads(runner, members, () if riding is None else [c.slot for c in riding.all_caches])
    slots = [m.cache.slot for m in members]
    if rounds[0].grammar is not None:  # host work inside the round: never captured
        key = ("round", tuple(zip(slots, (m.k for m in members), strict=True)), id(proposer), traced)
        clock = runner.clock(key) if traced else None
        runner.graph_counts["eager"] += 1
        device_round(runner, proposer, members, clock)
    else:  # one graph per batch of Ks (and sampler kinds, where any is not plain greedy), any slots
        if all(m.sampler.plain_greedy for m in members):
            key = ("greedy round", tuple(m.k for m in members), id(proposer), traced)
        else:  # the members' sampling work on copies gathered at their device slots (`Lane`)
            key = ("round", tuple((m.k, m.sampler.kind) for m in members), id(proposer), traced)
        pieces = []
        if riding is not None:  # (keyed by the pieces' count, total rows and chunks, any split: StepBatch.sizes)
            rows, chunks = [m.k + 1 for m in members] + riding.all_rows, riding.chunks
            key = ("mixed round", *key, StepBatch.sizes(rows, len(members), riding.chunked, chunks), riding.chunked)
            pieces = [c.slot for c in riding.all_caches]
            verify_rows = sum(rows[: len(members)])
            riding = riding.staged(runner, verify_rows)
        clock = runner.clock(key) if traced else None
        with runner.follow_slots(slots + pieces, len(rounds), len(pieces)):
            if riding is not None:  # the split its graph's replay reads, written first
                caches = [m.cache for m in members] + riding.all_caches
                runner.resplit(caches, rows, len(members), riding.chunked, chunks)
            runner.run(key, lambda: device_round(runner, proposer, members, clock, riding), mixed=riding is not None)
        if riding is not None:  # the pieces' host records, from the rows the round left them
            runner.landed(riding, *(t[verify_rows:] for t in riding.out))
    for r in rounds:
        r.queue_read(clock)


# the rows a mixed round's prompt pieces are padded to (`_pad_piece`): whole chunks, each at most 1.5x the
# one before (64 x 2^i and 192 x 2^i): a pad costs at most half the pieces' rows again (a fifth on average)
PIECE_BUCKETS = sorted({GDN_CHUNK << i for i in range(24)} | {3 * GDN_CHUNK << i for i in range(23)})


def _pad_piece(runner, riding, verify_rows: int):
    """The riding pieces with a pad piece after them (nextn.engine.riding.Pad) that fills their rows to
    a bucket, the smallest of PIECE_BUCKETS above them (at most the whole chunks of what the step's
    token budget leaves beside the members' verify_rows, as the pieces were planned), and their
    chunks to the bucket's chunks plus one a piece (what any split of the bucket's rows takes, the
    pad's own included), on a slot no request holds: a ragged load's mixed rounds share a graph per
    (members, pieces, bucket) where their exact sizes would rarely meet again. The riding pieces as
    they are where no slot is free or no bucket above them fits."""
    taken = {c.slot for c in riding.caches}
    free = [s for s in runner.free_slots if s not in taken]
    total = sum(riding.rows)
    top = (runner.config.max_num_batched_tokens - verify_rows) // GDN_CHUNK * GDN_CHUNK
    rows = min(next(b for b in PIECE_BUCKETS if b > total), top)
    if not free or rows <= total or rows - total > runner.slot(free[0]).max_len:
        return riding
    return riding._replace(pad=Pad(runner.slot(free[0]), rows - total, rows // GDN_CHUNK + len(riding.rows)))


class _PadSampler(NamedTuple):
    """A pad member's sampler: plain greedy (it reads no sampling values)."""

    plain_greedy: bool = True
    kind: SamplerKind = SamplerKind(greedy=True)


def _pads(runner, members: list[Member], riding: list[int] | tuple = ()) -> list[Member]:
    """Members on spare slots (the scratch slot, free ones, or kept sessions': no request runs there) that fill a batch
    of plain greedy members at one K up to its size bucket (nextn.spec.k_policy.bucket), so rounds
    of 1..bucket requests share one graph. A pad's round leaves its slot as it was: it writes only
    where no committed state lives (K/V and draft K/V past the committed positions, the step halves
    of the GDN buffers, the round buffers a request's start rewrites) and its counters are put back
    at the round's end (inside the graph: `device_round`); its outcome is never read. None without
    enough spare slots (or where a member is not plain greedy). riding: the slots of prompt pieces
    riding the round (a mixed step), which no pad takes."""
    need = padded_size(len(members), runner.pool.sequences) - len(members)
    spare = [s for s in runner.spare_slots if s not in riding]
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
    sizes = sorted({padded_size(b, runner.pool.sequences) for b in range(1, min(max_batch, runner.pool.sequences) + 1)})
    for size in sizes:
        slots = list(range(size))
        for k in ks:
            members = [Member(runner.slot(s), _PadSampler(), Buffers.of(runner.slot(s)), k) for s in slots]
            key = ("greedy round", (k,) * size, id(proposer), False)
            for _ in range(2):
                with runner.follow_slots(slots, 0):
                    runner.run(key, lambda members=members: device_round(runner, proposer, members))
    return runner.graph_counts["captures"] - before


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
        """Run alone: launch this request's round (none in flight, or one ahead), read the oldest."""
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
        n = out[OUT_ACCEPTED]
        tokens, before = out[OUT_TOKENS : OUT_TOKENS + n + 1], out[OUT_TOKENS + R :]
        self.reads = (self.reads + [_Read(index, n, tokens, before)])[-2:]
        room = 1  # the first token commits nothing
        self._record(None)
        if index > 0:
            room = self.max_len - before[SEQ_LEN]  # a round commits what it emits but the last
            self.next_start = before[SEQ_LEN] + n + 1
            if room > 0:  # (a round queued ahead into a full context counts for nothing)
                self.k_ctl.update(n, self.next_start)
                times = clock.split() if clock else (0.0, 0.0, 0.0)
                self.unrecorded = RoundTrace(k, out[OUT_DRAFTED], n, *times, zero_draft=out[OUT_DRAFTED] == 0)
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
        cache.ctl.copy_(to_device(ctl, cache.ctl.device, torch.int32))  # (queued: no wait for the rounds in flight)
