"""CUDA graphs of one sequence state's Triton steps: the trunk step per row count (decode T = 1,
verify T = K + 1), the MTP head step per row count, and the greedy draft chain per length.

A graph bakes in addresses, so each state's cache and draft K/V get their own graphs, captured
lazily on first use and kept on the cache (they die with it). Inputs go through static buffers;
the start position is a device scalar filled before each replay, so one graph serves every
position and nothing reads back to the host. All graphs of a runner share one memory pool: each
replay's outputs are consumed (or cloned) before the next replay of any graph.
"""
from __future__ import annotations

import torch

from nextn.cache import LayerKV


def _capture(fn, pool):
    """Run fn once eagerly (Triton compiles, the allocator settles), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class TrunkGraph:
    def __init__(self, step, cache, T: int, pool):
        device = cache.conv_all.device
        self.ids = torch.zeros(T, dtype=torch.long, device=device)
        # warm-up and capture run at the next free slots: their K/V writes land where the real
        # step writes next, and the GDN writes go to the step buffers, never the committed state
        self.pos = torch.full((1,), cache.seq_len, dtype=torch.int32, device=device)
        self.graph, self.out = _capture(lambda: step.trunk(self.ids, self.pos, cache), pool)

    def run(self, start: int, token_ids: torch.Tensor):
        self.ids.copy_(token_ids)
        self.pos.fill_(start)
        self.graph.replay()
        return self.out


class HeadGraph:
    def __init__(self, step, kv: LayerKV, T: int, slot: int, pool):
        device = kv.key.device
        self.ids = torch.zeros(T, dtype=torch.long, device=device)
        self.hidden = torch.zeros(T, step.cfg.hidden_size, dtype=kv.key.dtype, device=device)
        self.pos = torch.full((1,), slot, dtype=torch.int32, device=device)  # where the real rows go
        self.graph, self.out = _capture(lambda: step.head_step(self.ids, self.hidden, self.pos, kv), pool)

    def run(self, slot: int, ids: torch.Tensor, hidden: torch.Tensor):
        self.ids.copy_(ids)
        self.hidden.copy_(hidden)
        self.pos.fill_(slot)
        self.graph.replay()
        return self.out


class ChainGraph:
    """The greedy draft chain after a round's first head pass, for k drafts, in one graph: draft 1
    is the argmax of that pass's logits; then k - 1 times a head step on (the last draft, the
    chained hidden) at the next draft K/V slot, whose argmax is the next draft. The same ops the
    eager chain runs (`TokenSelector.draft` without penalties is `logits.float().argmax(-1)`), so
    the same drafts; one replay instead of ~9 launches per draft."""

    def __init__(self, step, kv: LayerKV, k: int, slot: int, hidden_after_norm: bool, pool):
        device = kv.key.device
        self.logits = torch.zeros(1, step.cfg.vocab_size, dtype=torch.float32, device=device)
        self.hidden = torch.zeros(1, step.cfg.hidden_size, dtype=kv.key.dtype, device=device)
        self.pos = torch.full((1,), slot, dtype=torch.int32, device=device)  # the first chain step's slot

        def chain():
            token = self.logits.argmax(dim=-1)
            tokens, hidden = [token], self.hidden
            for j in range(k - 1):
                out = step.head_step(token, hidden, self.pos + j, kv)
                hidden = out.chained(hidden_after_norm)
                token = out.logits.float().argmax(dim=-1)
                tokens.append(token)
            return torch.cat(tokens)

        self.graph, self.out = _capture(chain, pool)

    def run(self, slot: int, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The k drafts [k] long (a graph output: consume or clone before the next replay)."""
        self.logits.copy_(logits)
        self.hidden.copy_(hidden)
        self.pos.fill_(slot)
        self.graph.replay()
        return self.out


class StepGraphs:
    """The graphs of one state (kept on its cache; they hold no reference back to it): trunk
    steps and head steps keyed by row count, greedy draft chains by length."""

    def __init__(self, step, pool):
        self.step, self.pool = step, pool
        self.trunk_graphs: dict[int, TrunkGraph] = {}
        self.head_graphs: dict[int, HeadGraph] = {}
        self.chain_graphs: dict[int, ChainGraph] = {}

    def trunk(self, T: int, cache) -> TrunkGraph:
        if T not in self.trunk_graphs:
            self.trunk_graphs[T] = TrunkGraph(self.step, cache, T, self.pool)
        return self.trunk_graphs[T]

    def head(self, T: int, slot: int, draft_kv: LayerKV) -> HeadGraph:
        if T not in self.head_graphs:
            self.head_graphs[T] = HeadGraph(self.step, draft_kv, T, slot, self.pool)
        return self.head_graphs[T]

    def chain(self, k: int, slot: int, draft_kv: LayerKV, hidden_after_norm: bool) -> ChainGraph:
        if k not in self.chain_graphs:
            self.chain_graphs[k] = ChainGraph(self.step, draft_kv, k, slot, hidden_after_norm, self.pool)
        return self.chain_graphs[k]
