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

Does not choose tokens (nextn.engine.sampler) or decide what a round keeps (nextn.engine.rounds).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from itertools import pairwise

import torch

from nextn.cache import SlotCache, SlotPool, StepBatch
from nextn.config import STEP_ROWS, EngineConfig
from nextn.engine.sequence import Sequence
from nextn.models.qwen3_5 import CausalLM, ReferenceStep
from nextn.models.qwen3_5_step import TritonStep
from nextn.ops import OPS

log = logging.getLogger(__name__)

MAX_GRAPHS = 128  # captured graphs kept (one per batch composition); past it they are dropped and recaptured
STEPS = {"torch": ReferenceStep, "triton": TritonStep}


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, pool: SlotPool):
        self.model, self.config, self.pool, self.cfg = model, config, pool, model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.after_norm = config.spec.hidden_after_norm
        self.step = STEPS[config.kernels](model, self.after_norm)
        self.ops = OPS[config.kernels]()
        self.use_graphs = self.device.type == "cuda" and config.kernels == "triton"
        self.graphs: dict = {}  # key -> None (ran eagerly once) or a captured CUDAGraph
        self.graph_memory = GraphMemory(pool.graph_budget)
        self._capturing: torch.cuda.CUDAGraph | None = None  # the graph `run` is capturing now
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.slots = [pool.cache.slot(s) for s in range(pool.num_slots)]
        V, H, S = self.cfg.vocab_size, self.cfg.hidden_size, pool.num_slots
        # outputs of a step (every slot's verify rows, or a prefill step) and of a head pass
        rows = max(S * pool.cache.layout.step_states, STEP_ROWS)
        self.step_ids = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.step_logits = torch.zeros(rows, V, dtype=torch.float32, device=self.device)
        self.step_hidden = torch.zeros(rows, H, dtype=self.dtype, device=self.device)
        self.head_logits = torch.zeros(2 * S, V, dtype=torch.float32, device=self.device)
        self.head_hidden = torch.zeros(2 * S, H, dtype=self.dtype, device=self.device)
        self._batches: dict = {}
        self._indices: dict = {}
        self._clocks: dict = {}

    def slot(self, slot: int) -> SlotCache:
        return self.slots[slot]

    def batch(self, caches: list[SlotCache], rows: list[int]) -> StepBatch:
        """The step batch of these slots and row counts (made once: graphs hold its tensors)."""
        key = (tuple(c.slot for c in caches), tuple(rows))
        return self._made_once(self._batches, key, lambda: StepBatch(caches, rows))

    def index(self, values: list[int]) -> torch.Tensor:
        """A long device tensor of these values (made once)."""
        key = tuple(values)
        return self._made_once(self._indices, key, lambda: torch.tensor(key, dtype=torch.long, device=self.device))

    def _made_once(self, table: dict, key, make):
        """table[key], made on first use. A full table starts over: with graphs, together with the
        graphs that read it (drop_graphs; eager rounds, such as constrained ones, add keys no graph
        count bounds), never in the middle of a capture."""
        if key not in table:
            if len(table) >= 8 * MAX_GRAPHS:
                if not self.use_graphs:
                    table.clear()
                elif self._capturing is None:
                    self.drop_graphs()
            table[key] = make()
        return table[key]

    def clock(self, key) -> PhaseClock:
        """The phase clock of the work run under this key (made once: its graph records its events)."""
        return self._made_once(self._clocks, key, lambda: PhaseClock(self.device))

    def run(self, key, fn: Callable[[], None], slots: tuple[int, ...] = ()) -> None:
        """fn (device work on static buffers, no host reads) eagerly on the key's first call (Triton
        compiles, the allocator settles; a warm-up run would change state), captured on the second
        and replayed from then on; slots: the cache slots it serves (its graph's memory counts
        with them). Without graphs, always eagerly."""
        if not self.use_graphs:
            return fn()
        if key not in self.graphs:
            # batches come and go: past the count or the memory budget, start over rather than grow
            if len(self.graphs) >= MAX_GRAPHS or self.graph_memory.full():
                self.drop_graphs()
            self.graphs[key] = None
            return fn()
        graph = self.graphs[key]
        if graph is None:
            graph = self._capturing = torch.cuda.CUDAGraph()
            reserved = torch.cuda.memory_reserved(self.device)
            try:
                with torch.cuda.graph(graph, pool=self.graph_pool):
                    fn()
            finally:
                self._capturing = None
            self.graph_memory.add(key, slots, torch.cuda.memory_reserved(self.device) - reserved)
            self.graphs[key] = graph
        graph.replay()

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

    def rewind(self, seq: Sequence) -> None:
        """Back to the sequence's checkpoint (K/V need nothing: positions past it are rewritten)."""
        seq.rewind_to_checkpoint()
        cache = self.slot(seq.slot)
        cache.restore_gdn(seq.checkpoint.num_tokens)
        cache.set(draft_len=seq.draft_len)

    # --- prefill

    @torch.inference_mode()
    def extend(
        self, seq: Sequence, token_ids: list[int], on_logits: Callable[[int, torch.Tensor], None] | None = None
    ) -> None:
        """Prefill token_ids after the sequence's committed tokens and commit them.

        "chunked": the module forward over config.prefill_chunk tokens per call (states to the
        slot's home); "steps": the decode step over STEP_ROWS tokens at a time, so every token's
        state is computed with the same per-row arithmetic however the sequence was split into
        requests (a resumed session equals a cold run bitwise). on_logits(start, logits [T, V]):
        called with the logits of every row (row i follows token_ids[start + i]).
        """
        cache = self.slot(seq.slot)
        if len(seq.tokens) + len(token_ids) > cache.max_len:
            raise ValueError(f"{len(seq.tokens) + len(token_ids)} tokens exceed the context of {cache.max_len}")
        steps = self.config.prefill == "steps"
        chunk = STEP_ROWS if steps else self.config.prefill_chunk
        for s in range(0, len(token_ids), chunk):
            piece = token_ids[s : s + chunk]
            if steps:
                logits, hidden = self._prefill_steps(cache, piece)
            else:
                logits, hidden = self._prefill_chunk(cache, piece, on_logits is not None)
            if on_logits:
                on_logits(s, logits)
            seq.commit(piece, hidden.clone(), logits[-1].clone())

    def _prefill_chunk(self, cache: SlotCache, piece: list[int], all_rows: bool):
        h = self.model(torch.tensor([piece], device=self.device), cache, ops=self.ops)[0]
        normed = self.model.final_norm(h)
        # the last row's logits alone (a batched matmul may round it differently), all rows when asked
        last = self.model.logits(normed[-1:])
        logits = torch.cat([self.model.logits(normed[:-1]), last]) if all_rows else last
        cache.commit_home(len(piece))
        return logits, normed if self.after_norm else h

    def _prefill_steps(self, cache: SlotCache, piece: list[int]):
        T = len(piece)
        self.step_ids[:T].copy_(torch.tensor(piece), non_blocking=True)
        logits, hidden, batch = self.step_logits[:T], self.step_hidden[:T], self.batch([cache], [T])
        self.run(
            ("prefill", cache.slot, T),
            lambda: self.step.trunk(batch, self.step_ids[:T], logits, hidden, store_all=False),
            (cache.slot,),
        )
        cache.commit(T, store_all=False)
        return logits, hidden

    @torch.inference_mode()
    def catch_up(self, seq: Sequence) -> None:
        """Write the sequence's pending MTP rows into its draft K/V (a whole prompt after a prefill),
        in prefill-sized chunks, or in step-sized head passes under prefill="steps" (the rounds'
        own arithmetic, however the sequence was split)."""
        ids, hidden = seq.take_rows()
        cache, first = self.slot(seq.slot), seq.draft_len + 1
        chunk = STEP_ROWS if self.config.prefill == "steps" else self.config.prefill_chunk
        for s in range(0, len(ids), chunk):
            piece, rows = torch.tensor(ids[s : s + chunk], device=self.device), hidden[s : s + chunk]
            if chunk == STEP_ROWS:
                pos = torch.tensor([first + s - 1], dtype=torch.int32, device=self.device)
                batch, last = self.batch([cache], [piece.numel()]), self.index([piece.numel() - 1])
                self.step.head(batch, piece, rows, pos, last, self.head_logits[:1], self.head_hidden[:1])
            else:
                self.model.head_rows(cache.draft_kv(), piece, rows, first + s, ops=self.ops)
        seq.draft_len = max(seq.draft_len, len(seq.tokens) - 1)
        cache.set(draft_len=seq.draft_len)


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
