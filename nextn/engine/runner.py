"""The model runner: the one device boundary. It owns the cache slots and the positions in them
(prefill commits here; a round commits on the device through `commit_ctl`), runs the trunk and
the MTP head through the step backend named at construction (`STEPS`: the reference modules or
the fused Triton step), and runs device work as CUDA graphs: eager on a key's first call,
captured on its second, replayed after.

Graphs' memory is counted (`GraphMemory`: what each capture added to the graph pool, by the
slots it serves, so kept sessions' graphs count with them) and bounded by the pool's graph budget.
`when` runs device work only where a device flag holds (the fused step's kernels read the flag
and return);
`PhaseClock` times a round's phases (CUDA events captured with its graph).

The prefix cache (nextn.cache.prefix) is the runner's too: `restore_prefix` copies a cached prompt
prefix into a slot, `snapshot_prefix` keeps what a slot holds at a block boundary.

Does not choose tokens (nextn.sample.sampler) or decide what a round keeps (nextn.engine.rounds).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from itertools import pairwise

import torch

from nextn.cache import SlotCache, SlotPool, StepBatch, commit_ctl
from nextn.cache.hybrid import to_device
from nextn.cache.prefix import Match, PrefixCache
from nextn.config import STEP_ROWS, EngineConfig
from nextn.engine.riding import Piece, Riding
from nextn.engine.sequence import Sequence
from nextn.models.qwen3_5 import CausalLM, ReferenceStep
from nextn.models.qwen3_5_step import TritonStep
from nextn.ops import OPS
from nextn.ops.linear_configs import WIDE_ROWS

log = logging.getLogger(__name__)

MAX_GRAPHS = 512  # captured graphs kept (one per batch kind); past it they are dropped and recaptured
MAX_MIXED_GRAPHS = 64  # of them, mixed steps' rounds (keyed by their pieces' sizes too: `run`)
STEPS = {"torch": ReferenceStep, "triton": TritonStep}


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, pool: SlotPool):
        self.model, self.config, self.pool, self.cfg = model, config, pool, model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.after_norm = config.spec.hidden_after_norm
        self.step = STEPS[config.kernels](model, self.after_norm)
        self.ops = OPS[config.kernels]()
        self.use_graphs = self.device.type == "cuda" and config.kernels == "triton" and not config.enforce_eager
        self.graphs: dict = {}  # key -> None (ran eagerly once) or a captured CUDAGraph
        self.graph_memory = GraphMemory(pool.graph_budget)
        self._capturing: torch.cuda.CUDAGraph | None = None  # the graph `run` is capturing now
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._capture_stream: torch.cuda.Stream | None = None  # (made at the first capture: `_capture`)
        self.slots = [pool.cache.slot(s) for s in range(pool.num_slots)]
        self.prefix = None  # the prefix cache, when on (the memory set aside for it: the pool's budget.prefix)
        if config.enable_prefix_caching:
            k = config.spec.num_speculative_tokens
            self.prefix = PrefixCache(pool.cache, config.prefix_block_size, pool.budget.prefix, draft=k > 0)
        V, H, S = self.cfg.vocab_size, self.cfg.hidden_size, pool.num_slots
        # outputs of a round's verify step (every slot's rows) and of a head pass (a prefill step makes its own)
        rows = max(S * pool.cache.layout.step_states, STEP_ROWS)
        self.step_logits = torch.zeros(rows, V, dtype=torch.float32, device=self.device)
        self.step_hidden = torch.zeros(rows, H, dtype=self.dtype, device=self.device)
        self.head_logits = torch.zeros(2 * S, V, dtype=torch.float32, device=self.device)
        self.head_hidden = torch.zeros(2 * S, H, dtype=self.dtype, device=self.device)
        self._batches: dict = {}
        self._indices: dict = {}
        self._clocks: dict = {}
        # a batch size's device slots (int32 [B], never freed: graphs read them), written before each
        # launch of a round keyed by its size (`follow_slots`), and the one in force (None: keys by slot)
        self._slot_sets: dict[int, torch.Tensor] = {}
        self._following: torch.Tensor | None = None
        self._followed: dict[int, int] | None = None  # its slots' positions in it, as the host wrote them
        self._refreshed: set[int] = set()  # the batches refreshed within the follow_slots in force
        # pad members: rounds of plain greedy requests at one K fill their batch to its size bucket
        # with members on spare slots (nextn.engine.rounds._pads), so 1..bucket requests share a graph;
        # on with graphs (without, a pad is only extra rows). spare_slots: slots no request runs in
        self.pad_rounds = self.use_graphs
        self.spare_slots: list[int] = []
        self.free_slots: list[int] = []  # of them, those no request holds (a pad piece's: riding.Pad)
        self._pad_masks: dict[int, torch.Tensor] = {}
        self.pads: torch.Tensor | None = None  # the batch followed now: which members pad (bool [B])
        # device work by how it ran: captured into a graph, replayed, run eagerly (/metrics)
        self.graph_counts = {"captures": 0, "replays": 0, "eager": 0}
        # mixed rounds' keys run once (eagerly): the second run of one captures it (`run`); what
        # their runs make that the tables lack is kept apart, dropped with their graphs (`_made_once`)
        self._mixed_seen: set = set()
        self._mixed_made: dict = {}  # (table's id, key) -> made; `held` buffers by their keys
        self._mixing = False  # within a mixed round's run

    def slot(self, slot: int) -> SlotCache:
        return self.slots[slot]

    def batch(
        self,
        caches: list[SlotCache],
        rows: list[int],
        pieces_from: int | None = None,
        chunked: bool = False,
        chunks: int | None = None,
    ) -> StepBatch:
        """The step batch of these slots and row counts (made once: graphs hold its tensors; a mixed
        step's with its pieces_from, chunked and chunks: StepBatch). While `follow_slots` holds, one
        per batch size and row counts, whatever the slots: its slot tensors are re-derived on the
        device from the size's slot set (a graph replays that too)."""
        make = lambda: StepBatch(caches, rows, pieces_from=pieces_from, chunked=chunked, chunks=chunks)  # noqa: E731
        if self._following is None:
            key = (tuple(c.slot for c in caches), tuple(rows), pieces_from, chunked)
            return self._made_once(self._batches, key, make)
        # a batch of the followed slots' first ones (a round's members, before its riding pieces)
        # follows a view of the slot set; of others (the members drafting, or still chaining, in a
        # round whose Ks differ), their positions in it, gathered on the device
        key = self._follow_key(caches, rows, pieces_from, chunked, chunks)
        batch = self._made_once(self._batches, key, make)
        if batch.rows != tuple(rows):  # (a mixed step's pieces split otherwise: `resplit` before the round)
            raise RuntimeError(f"a step batch of rows {batch.rows} asked for {tuple(rows)}: not resplit")
        first = key[1] == len(caches)
        if id(batch) not in self._refreshed:  # once a round: its device ops run in every replay
            batch.follow(self._following[: len(caches)] if first else self._followed_at(key[1]))
            batch.refresh(caches, fused=self.config.kernels == "triton")
            self._refreshed.add(id(batch))
        return batch

    def _follow_key(
        self, caches: list[SlotCache], rows: list[int], pieces_from: int | None, chunked: bool, chunks: int | None
    ) -> tuple:
        """A followed step batch's key: its sequences' positions in the slot set (their count when they
        are its first ones) and its sizes (StepBatch.sizes: a chunked mixed step's pieces by count,
        total rows and chunks, so one batch serves any split of them)."""
        positions = tuple(self._followed[c.slot] for c in caches)
        at = len(caches) if positions == tuple(range(len(positions))) else positions
        return ("follow", at, StepBatch.sizes(rows, pieces_from, chunked, chunks), pieces_from, chunked)

    def resplit(
        self, caches: list[SlotCache], rows: list[int], pieces_from: int, chunked: bool, chunks: int | None = None
    ) -> None:
        """Within `follow_slots`, before a mixed round is launched: the followed step batch of its
        sizes, if one was made, takes these pieces' rows (StepBatch.resplit: queued copies a graph's
        replay then reads; a capture may not copy from the host)."""
        batch = self._made_already(self._batches, self._follow_key(caches, rows, pieces_from, chunked, chunks))
        if batch is not None:
            batch.resplit(rows)

    def _followed_at(self, positions: tuple[int, ...]) -> torch.Tensor:
        """The followed slots at these positions (int32, made once; written by a device op)."""
        make = lambda: torch.empty(len(positions), dtype=torch.int32, device=self.device)  # noqa: E731
        held = self._made_once(self._indices, ("followed", positions), make)
        return torch.index_select(self._following, 0, self.index(list(positions)), out=held)

    @contextlib.contextmanager
    def follow_slots(self, slots: list[int], real: int, pieces: int = 0):
        """Within: the step batches `batch` makes take their slots from a device tensor of this
        batch size, written here (stream-ordered after any work that read it), so the device work
        run within (`run`, keyed without the slots) serves any slots of the same kind; `pads` says
        which of the round's members pad the batch (those past the first `real`). The last `pieces`
        slots are a mixed step's prompt pieces (after the members: neither members nor pads)."""
        B, members = len(slots), len(slots) - pieces
        held, pads = self._slot_sets.get(B), self._pad_masks.get(members)
        if held is None:
            held = self._slot_sets[B] = torch.zeros(B, dtype=torch.int32, device=self.device)
        if pads is None:
            pads = self._pad_masks[members] = torch.zeros(members, dtype=torch.bool, device=self.device)
        held.copy_(torch.tensor(slots, dtype=torch.int32), non_blocking=True)
        pads.copy_(torch.arange(members) >= real, non_blocking=True)
        self._following, self.pads, self._followed = held, pads, {s: i for i, s in enumerate(slots)}
        self._refreshed = set()
        try:
            yield
        finally:
            self._following = self.pads = self._followed = None

    def index(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A device tensor of these values (made once)."""
        key = tuple(values)
        make = lambda: torch.tensor(key, dtype=dtype, device=self.device)  # noqa: E731
        return self._made_once(self._indices, key if dtype == torch.long else (dtype, key), make)

    def _made_once(self, table: dict, key, make):
        """table[key], made on first use. A full table starts over: with graphs, together with the
        graphs that read it (drop_graphs; eager rounds, such as constrained ones, add keys no graph
        count bounds), never in the middle of a capture. Within a mixed round's run, what the table
        lacks is made into `_mixed_made` (their pieces' sizes make new keys: they start over
        there, with the mixed rounds' graphs alone: `_drop_mixed`)."""
        if key not in table:
            if self._mixing:
                made = (id(table), key)
                if made not in self._mixed_made:
                    self._mixed_made[made] = make()
                return self._mixed_made[made]
            if len(table) >= 8 * MAX_GRAPHS:
                if not self.use_graphs:
                    table.clear()
                elif self._capturing is None:
                    self.drop_graphs()
            table[key] = make()
        return table[key]

    def _made_already(self, table: dict, key):
        """What `_made_once` made for key in table (kept apart if a mixed round's run made it), or None."""
        return table.get(key) or self._mixed_made.get((id(table), key))

    def clock(self, key) -> PhaseClock:
        """The phase clock of the work run under this key (made once: its graph records its events)."""
        return self._made_once(self._clocks, key, lambda: PhaseClock(self.device))

    def run(self, key, fn: Callable[[], None], slots: tuple[int, ...] = (), mixed: bool = False) -> None:
        """fn (device work on static buffers, no host reads) eagerly on the key's first call (Triton
        compiles, the allocator settles; a warm-up run would change state), captured on the second
        and replayed from then on; slots: the cache slots it serves (its graph's memory counts
        with them). Without graphs, always eagerly. mixed: a mixed step's round, whose keys name
        its pieces' sizes (ragged prompt tails make several): its first run is eager and takes no graph
        slot, its second is captured while fewer than MAX_MIXED_GRAPHS of them are held (and the
        graphs' memory is within budget), else it runs eagerly every time (counted so) rather than
        crowd out the rounds' graphs; what its runs make is kept apart (`_made_once`)."""
        if not self.use_graphs:
            self.graph_counts["eager"] += 1
            return fn()
        self._mixing = mixed
        try:
            self._run(key, fn, slots, mixed)
        finally:
            self._mixing = False

    def _run(self, key, fn: Callable[[], None], slots: tuple[int, ...], mixed: bool) -> None:
        if mixed and key not in self.graphs:
            room = self._mixed_held() < MAX_MIXED_GRAPHS and not self.graph_memory.full()
            if key not in self._mixed_seen or not room:
                if max(len(self._mixed_made), len(self._mixed_seen)) >= 8 * MAX_GRAPHS:
                    self._drop_mixed()
                self._mixed_seen.add(key)
                self.graph_counts["eager"] += 1
                return fn()
            self.graphs[key] = None  # its first run made what it reads: captured now
        if key not in self.graphs:
            # batches come and go: past the count or the memory budget, start over rather than grow
            if len(self.graphs) >= MAX_GRAPHS or self.graph_memory.full():
                self.drop_graphs()
            self.graphs[key] = None
            self.graph_counts["eager"] += 1
            return fn()
        graph = self.graphs[key]
        if graph is None:
            graph = self._capturing = torch.cuda.CUDAGraph()
            reserved = torch.cuda.memory_reserved(self.device)
            try:
                self._capture(graph, fn)
            finally:
                self._capturing = None
            self.graph_memory.add(key, slots, torch.cuda.memory_reserved(self.device) - reserved)
            self.graphs[key] = graph
            self.graph_counts["captures"] += 1
        graph.replay()
        self.graph_counts["replays"] += 1

    def _capture(self, graph: torch.cuda.CUDAGraph, fn: Callable[[], None]) -> None:
        """fn's device work captured into graph, on a side stream (made once) ordered after the
        current stream's work by an event, not by the host. torch.cuda.graph's entry work is left
        out: it synchronizes the device and empties the allocator's caches, device and pinned host,
        so a server capturing a key as prompts arrive (a mixed step's pieces) drained the rounds
        queued ahead, and the allocations after it went to cudaMalloc and cudaHostAlloc again."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._capture_stream.wait_stream(current)
        with torch.cuda.stream(self._capture_stream):
            graph.capture_begin(self.graph_pool)
            try:
                fn()
            finally:
                graph.capture_end()
        current.wait_stream(self._capture_stream)

    def held(self, key, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A buffer a mixed round's graph reads or writes, made once per key where graphs run (kept
        with what the mixed rounds' runs make: `_drop_mixed` forgets it with their graphs), else
        made now."""
        if not self.use_graphs:
            return make()
        if key not in self._mixed_made:
            self._mixed_made[key] = make()
        return self._mixed_made[key]

    def _mixed_held(self) -> int:
        """Mixed rounds' graphs held (a mixed key enters `graphs` only to be captured)."""
        return sum(1 for key in self.graphs if key[0] == "mixed round")

    def _drop_mixed(self) -> None:
        """Forget the mixed rounds' graphs and what their runs made (`drop_graphs`, for them alone)."""
        torch.cuda.synchronize(self.device)
        for key in [key for key in self.graphs if key[0] == "mixed round"]:
            graph = self.graphs.pop(key)
            if graph is not None:
                graph.reset()
            self.graph_memory.held.pop(key, None)
        self._mixed_made.clear()
        self._mixed_seen.clear()

    def when(self, pred: torch.Tensor, fn: Callable[[], None]) -> None:
        """fn (head steps and their drafts) only where pred (a bool device scalar) holds, with no
        host read. The fused step runs fn with pred as its kernels' run_if: each
        returns at once where pred is false, so a skipped step costs its launches alone (pred is
        read as each kernel starts: fn may write it in its last kernel only). (CUDA-graph IF nodes
        were measured instead, run 41: a taken node costs 6.5-9.5 us, which ate what the skips
        saved.) Else (the reference modules) a plain branch on the CPU, and on a GPU fn runs
        whatever pred says. Whatever runs where pred is false, the caller discards."""
        if isinstance(self.step, TritonStep) and self.step.head_skips:
            self.step.run_if = pred
            try:
                return fn()
            finally:
                self.step.run_if = None
        if self.device.type != "cpu" or pred.item():
            fn()

    def drop_graphs(self) -> None:
        """Forget every captured graph and the step batches, indices and clocks they read; their
        memory goes back to the device (later captures then count what they take anew). Each graph
        is reset here, not left to the garbage collector: a graph that captured NCCL work holds its
        communicator, and leaving the process group waits for every such graph to be destroyed
        (pytorch issue 115388; NCCL counts them in localPersistentRefs)."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            if graph is not None:
                graph.reset()
        self.graphs.clear()
        self._mixed_made.clear()
        self._mixed_seen.clear()
        self.graph_memory.clear()
        self._batches.clear()
        self._indices.clear()
        self._clocks.clear()
        torch.cuda.empty_cache()

    # --- a slot's state, host record and device counters together

    def reset(self, seq: Sequence, heads: bool) -> None:
        """A fresh sequence in seq's slot."""
        self.slot(seq.slot).reset()
        seq.heads = heads

    def checkpoint(self, seq: Sequence) -> None:
        """Keep where the sequence stands, for a later request that rewrites what follows."""
        seq.make_checkpoint()
        self.slot(seq.slot).snapshot_gdn()

    @torch.inference_mode()
    def fold(self, slots: list[int]) -> None:
        """Fold the slots' pending GDN rows into their base states (nextn.cache.hybrid), so that
        SlotCache.committed_gdn reads the committed state as this step backend computed it; the
        committed tokens stay as they are."""
        caches = [self.slot(s) for s in slots]
        self.step.fold(caches)
        cache = self.pool.cache
        index = to_device(slots, self.device)
        ctl = cache.ctl.index_select(0, index)
        cache.ctl.index_copy_(0, index, commit_ctl(ctl, 0, caches[0].cols, store_all=False))

    def rewind(self, seq: Sequence) -> None:
        """Back to the sequence's checkpoint (K/V need nothing: positions past it are rewritten)."""
        seq.rewind_to_checkpoint()
        cache = self.slot(seq.slot)
        cache.restore_gdn(seq.checkpoint.num_tokens)
        cache.set(draft_len=seq.draft_len)

    @torch.inference_mode()
    def restore_prefix(self, seq: Sequence, match: Match, prompt: list[int]) -> Sequence:
        """A new record of seq's slot holding the matched prompt prefix, copied in from the prefix
        cache (a new record: a kept session's checkpoint of other tokens must not survive). The
        MTP rows of the prefix are in the draft K/V; the next token pairs with the cached hidden."""
        fresh = Sequence(seq.slot, heads=self.prefix.draft)
        cache = self.slot(seq.slot)
        cache.reset()
        self.prefix.restore(match, cache)
        n = match.num_tokens
        fresh.tokens = list(prompt[:n])
        fresh.last_hidden = match.blocks[-1].boundary.hidden.clone()
        fresh.draft_len = n - 1 if fresh.heads else 0
        return fresh

    @torch.inference_mode()
    def snapshot_prefix(self, seq: Sequence) -> None:
        """Keep what seq's slot holds (a whole number of prefix blocks, a prefill step just ended
        after them, its MTP rows caught up) in the prefix cache."""
        self.prefix.insert(seq.tokens, self.slot(seq.slot), seq.last_hidden)

    # --- prefill

    @torch.inference_mode()
    def extend(
        self, seq: Sequence, token_ids: list[int], on_logits: Callable[[int, torch.Tensor], None] | None = None
    ) -> None:
        """Prefill token_ids after the sequence's committed tokens and commit them, in pieces of
        config.prefill_chunk tokens (`prefill` on one sequence). on_logits(start, logits [T, V]):
        called with the logits of every row (row i follows token_ids[start + i])."""
        chunk = self.config.prefill_chunk
        for s in range(0, len(token_ids), chunk):
            take = None if on_logits is None else (lambda start, rows, s=s: on_logits(s + start, rows))
            self.prefill([Piece(seq, token_ids[s : s + chunk], take)])

    @torch.inference_mode()
    def prefill(self, pieces: list[Piece]) -> None:
        """Prefill each piece's tokens after its sequence's committed tokens and commit them: one
        trunk step over every piece, its rows packed, whatever their number (a prefill step keeps
        the last GDN state and conv columns only), then one head step writing their MTP rows into
        the draft K/V. Every kernel but the GDN's computes a row from its token and position alone.

        "steps" (the server's default): the GDN rows by the decode step's recurrence, so a prompt
        prefilled in any pieces, beside any others, equals a decode of the same tokens: a resumed or
        rewound session emits bitwise what a cold run emits. "chunked": the GDN rows by the chunked
        delta rule (StepBatch.chunked: tensor-core chunks of 64 rows from each piece's first), so a
        prompt gives the same bits cut at any whole chunks, alone or beside others (the engine cuts
        there), and other bits than its decode. Pieces may also ride a round's trunk step (`ride`).
        A piece's `on_logits(start, rows [T, V])` gets the logits of all its rows (row i follows
        token_ids[start + i]); the others' last only."""
        riding = self.ride(pieces)
        if riding is None:
            return
        batch = StepBatch(riding.caches, riding.rows, max_pos=riding.top, chunked=riding.chunked)
        logits, hidden = riding.buffers(self, 0)
        logit_rows, kept = riding.indices(self, 0)
        self.step.trunk(batch, riding.ids, logits, hidden, store_all=False, logit_rows=logit_rows)
        self.commit_pieces(batch.slot_index, kept, riding)
        self.landed(riding, logits, hidden)

    @torch.inference_mode()
    def ride(self, pieces: list[Piece]) -> Riding | None:
        """Prompt pieces made ready for a trunk step (None: no tokens): alone (`prefill`) or riding
        a round's verify rows (a mixed step: nextn.engine.rounds.launch, then `landed`). Each must
        fit its context; under "chunked" their slots' pending GDN rows are folded first."""
        pieces = [p for p in pieces if p.token_ids]
        if not pieces:
            return None
        for p in pieces:
            total, max_len = len(p.seq.tokens) + len(p.token_ids), self.slot(p.seq.slot).max_len
            if total > max_len:
                raise ValueError(f"{total} tokens exceed the context of {max_len}")
        chunked = self.config.prefill == "chunked"
        if chunked:
            self.fold([p.seq.slot for p in pieces])
        rows = [len(p.token_ids) for p in pieces]
        # (a sequence's committed tokens: its slot's SEQ_LEN)
        top = max(len(p.seq.tokens) + n for p, n in zip(pieces, rows, strict=True))
        ids = to_device([t for p in pieces for t in p.token_ids], self.device)
        # logits of each piece's last row, or of all its rows where asked (prompt logprobs)
        offsets = list(itertools.accumulate(rows, initial=0))[:-1]
        wanted = [
            range(o, o + n) if p.on_logits else range(o + n - 1, o + n)
            for p, o, n in zip(pieces, offsets, rows, strict=True)
        ]
        caches = [self.slot(p.seq.slot) for p in pieces]
        return Riding(pieces, caches, rows, offsets, ids, wanted, top, chunked)

    def commit_pieces(self, slots: torch.Tensor, kept: torch.Tensor, riding: Riding) -> None:
        """The pieces' slots (slots: long [pieces] on the device, as the step batch holds them)
        commit their rows (kept: int32 [pieces, 1], `Riding.indices`): device work only (a mixed
        round's graph holds it)."""
        ctl = self.pool.cache.ctl
        ctl.index_copy_(0, slots, commit_ctl(ctl.index_select(0, slots), kept, riding.caches[0].cols, store_all=False))

    def landed(self, riding: Riding, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """The pieces' trunk step ran (alone or riding a round) and their slots committed it
        (`commit_pieces`): logits [the wanted rows, V] and hidden [their rows, H] are theirs. The
        sequences record them, prompt logprobs get their rows, and the sequences that draft catch
        their MTP rows up in one head step (host work: after a mixed round's graph)."""
        at = 0
        for p, o, n, w in zip(riding.pieces, riding.offsets, riding.rows, riding.wanted, strict=True):
            own = logits[at : at + len(w)]
            at += len(w)
            if p.on_logits is not None:
                p.on_logits(0, own)
            p.seq.commit(p.token_ids, hidden[o : o + n], own[-1].clone())
        self._catch_up([p.seq for p in riding.pieces if p.seq.heads])

    @torch.inference_mode()
    def warm_prefill(self, heads: bool) -> None:
        """Compile a prefill's kernel variants before any request, so that no request waits
        on a compile: a piece of one row (a cached prompt's last token; one-row launches are arranged
        as a decode's, nextn.ops.triton_utils.row_launch), one of a few rows, and two pieces of
        WIDE_ROWS rows together (the GEMMs' wide tiles, nextn.ops.linear_configs), each with its MTP
        head's catch-up where the engine drafts, on slots reset after. Between them, pieces of 9, 18, 34
        and 66 rows: 16-row tiles and the mid tiles of 32, 64 and 128 rows a program (linear_configs.mid_tile),
        the head's a row fewer in the same tiles (under "chunked", the chunk rule's kernels with them)."""
        slots = list(range(min(2, self.pool.num_slots)))
        wide = -(-WIDE_ROWS // len(slots)) + 1  # (the head's catch-up takes a row fewer a prompt)
        mid = [[n] for n in (9, 18, 34, 66) if n < WIDE_ROWS]
        for lengths in ([1], *mid, [wide] * len(slots)):
            pieces = []
            for slot, n in zip(slots, lengths, strict=False):  # (one piece: the first slot)
                self.slot(slot).reset()
                n = min(n, self.slot(slot).max_len - 1)
                pieces.append(Piece(Sequence(slot, heads=heads), [0] * n))
            self.prefill(pieces)
        for slot in slots:
            self.slot(slot).reset()

    @torch.inference_mode()
    def catch_up(self, seq: Sequence) -> None:
        """Write the sequence's pending MTP rows into its draft K/V (after a prefill, rows its rounds
        kept since: none, or a session's)."""
        self._catch_up([seq])

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """The sequences' pending MTP rows through one head step, every sequence's rows packed (the
        rounds' head arithmetic per row, however many)."""
        taken = [(seq, *seq.take_rows()) for seq in seqs]
        taken = [(seq, ids, hidden) for seq, ids, hidden in taken if ids]
        if taken:
            caches = [self.slot(seq.slot) for seq, _, _ in taken]
            rows = [len(ids) for _, ids, _ in taken]
            first = [seq.draft_len for seq, _, _ in taken]  # row draft_len + 1 sits in draft slot draft_len
            batch = StepBatch(caches, rows, max_pos=max(f + n for f, n in zip(first, rows, strict=True)))
            ids = to_device([t for _, piece, _ in taken for t in piece], self.device)
            hidden = torch.cat([h for _, _, h in taken]) if len(taken) > 1 else taken[0][2]
            last = to_device([o + n - 1 for o, n in zip(batch.offsets[:-1], rows, strict=True)], self.device)
            pos = to_device(first, self.device, torch.int32)
            B = len(taken)
            self.step.head(batch, ids, hidden, pos, last, (self.head_logits[:B], self.head_hidden[:B]))
        for seq in seqs:
            self._caught_up(seq)

    def _caught_up(self, seq: Sequence) -> None:
        seq.draft_len = max(seq.draft_len, len(seq.tokens) - 1)
        self.slot(seq.slot).set(draft_len=seq.draft_len)


class GraphMemory:
    """The bytes captured graphs hold (what each capture added to the graph pool), by the slots
    they serve, against a budget: a kept session's graphs are part of what it holds."""

    def __init__(self, budget: int):
        self.budget = budget
        self.held: dict = {}  # graph key -> (slots it serves, bytes)

    def add(self, key, slots: tuple[int, ...], nbytes: int) -> None:
        self.held[key] = (frozenset(slots), max(0, nbytes))

    @property
    def total(self) -> int:
        return sum(n for _, n in self.held.values())

    def of(self, slots) -> int:
        """Bytes of the graphs that serve any of these slots."""
        slots = set(slots)
        return sum(n for served, n in self.held.values() if served & slots)

    def full(self) -> bool:
        return self.total >= self.budget

    def clear(self) -> None:
        self.held.clear()


class PhaseClock:
    """Wall time between marks of device work: the host clock on the CPU (its work is done when a
    mark is reached); CUDA events on a GPU, recorded inside the work's graph when it has one, read
    once the work is done."""

    def __init__(self, device: torch.device, marks: int = 4):
        self.events = None
        if device.type == "cuda":
            self.events = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(marks)]
        self.times = [0.0] * marks

    def mark(self, i: int) -> None:
        if self.events is None:
            self.times[i] = time.perf_counter()
        else:
            self.events[i].record()

    def split(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.events is None:
            return [b - a for a, b in pairwise(self.times)]
        return [a.elapsed_time(b) / 1e3 for a, b in pairwise(self.events)]
