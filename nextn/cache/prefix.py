"""The prefix cache: what prompts left in their slots at block boundaries, kept under a byte
budget, so a later request whose prompt starts the same way copies it into its slot and prefills
only the rest.

Prompts are cut into blocks of `block_size` tokens; a tree holds one node per block, keyed by its
tokens under its parent (a radix tree of blocks: the path from the root is the prompt prefix). A
node holds, for its block's positions, the attention layers' K/V rows (their fp8 scales too) and
the MTP head's draft K/V rows (row p, token p paired with hidden p-1, sits in draft position p-1:
a block [s, e) keeps draft positions [s-1, e-1), the first block one row fewer); and, when a
prefill step ended at the block's end, the state there (`Boundary`): every GDN layer's conv
columns and recurrent state, gathered by SlotCache.committed_gdn_all, and the head-input hidden of
the last token (what pairs with the next token's MTP row). A request resumes from the deepest node
with a boundary, always leaving one prompt token to prefill (its logits start the first round).

Why copying is exact: under prefill "steps" a row's bits depend on its token and position alone
(nextn.engine.runner.ModelRunner.prefill), so the rows and the states a slot holds after a prefill
step that ended at a boundary are what any prefill of the same tokens leaves there, whoever
computed them. Copy, not reference: the slots' K/V are contiguous per slot (the step attention
reads a slot's positions as one run), so a hit copies the prefix into the slot (one `torch.cat`
per cached tensor) and the blocks are free again at once; nothing running holds them.

Eviction is least recently used, leaves first: a lookup or an insertion touches its path from
the leaf up, so every node is more recent than its descendants and the oldest node is a leaf;
a path being extended is pinned while room is made for it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from nextn.cache.hybrid import HybridCache, SlotCache
from nextn.config import FULL


class Boundary(NamedTuple):
    """The state after a block's last token."""

    conv: torch.Tensor  # [G, D, W-1] every GDN layer's conv columns
    recurrent: torch.Tensor  # [G, HV, K, V] float32
    hidden: torch.Tensor  # [H] the head-input hidden of the last token


@dataclass(eq=False)
class Block:
    parent: Block | None
    key: tuple[int, ...]  # its tokens
    end: int  # prompt tokens up to its end
    rows: list[torch.Tensor]  # [B or B-1, ...] its positions' rows of each cached tensor (PrefixCache._sources)
    boundary: Boundary | None = None
    children: dict = field(default_factory=dict)
    pins: int = 0

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.rows + list(self.boundary or ()))


class Match(NamedTuple):
    """A lookup's answer: the blocks of the deepest cached boundary (root first) and its tokens."""

    blocks: list[Block]
    num_tokens: int


@dataclass
class PrefixCounters:
    """vLLM's prefix-cache counters (in tokens), and what was evicted."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, served from the cache
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, cache: HybridCache, block_size: int, budget: int, draft: bool):
        """budget: bytes the cached blocks may hold; draft: the engine drafts (the MTP head's K/V are cached)."""
        self.cache, self.block_size, self.budget, self.draft = cache, block_size, budget, draft
        self.root = Block(None, (), 0, [])
        self.lru: OrderedDict[Block, None] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.counters = PrefixCounters()
        self.attention = [i for i, kind in enumerate(cache.cfg.layer_types) if kind == FULL]

    def __len__(self) -> int:
        return len(self.lru)

    # --- lookup

    def match(self, prompt: list[int], count: bool = False) -> Match:
        """The deepest boundary before prompt's last token (count: a request's lookup, counted and
        its path touched)."""
        B, node, path, best = self.block_size, self.root, [], Match([], 0)
        while node.end + B < len(prompt):
            node = node.children.get(tuple(prompt[node.end : node.end + B]))
            if node is None:
                break
            path.append(node)
            if node.boundary is not None:
                best = Match(list(path), node.end)
        if count:
            self.counters.queries += len(prompt)
            self.counters.hits += best.num_tokens
            if best.blocks:
                self._touch(best.blocks[-1])
        return best

    def restore(self, match: Match, slot: SlotCache) -> None:
        """The matched prefix into an empty slot: K/V rows, draft rows, GDN states, counters (the
        host record is the caller's: nextn.engine.runner.ModelRunner.restore_prefix)."""
        n = match.num_tokens
        for j, (dst, shift) in enumerate(self._sources(slot)):
            torch.cat([b.rows[j] for b in match.blocks], out=dst[: n - shift])
        last = match.blocks[-1].boundary
        slot.load_gdn(last.conv, last.recurrent, n, draft_len=n - 1 if self.draft else 0)

    # --- insertion

    def insert(self, tokens: list[int], slot: SlotCache, hidden: torch.Tensor) -> None:
        """The slot holds tokens (a whole number of blocks) and a prefill step just ended after them:
        their blocks (those the tree lacks, from the slot's rows) and the boundary at their end,
        as far as the budget allows once older blocks are evicted."""
        B = self.block_size
        node, keys = self.root, [tuple(tokens[s : s + B]) for s in range(0, len(tokens), B)]
        while keys and keys[0] in node.children:
            node = node.children[keys.pop(0)]
        if not keys and node.boundary is not None:  # (an equal prefix computed beside it)
            self._touch(node)
            return
        sources = self._sources(slot)
        conv, recurrent = slot.committed_gdn_all()  # copies: [G, D, W-1], [G, HV, K, V]
        need = _nbytes(conv) + _nbytes(recurrent) + _nbytes(hidden)
        need += sum(_rows_nbytes(sources, node.end + k * B, B) for k in range(len(keys)))
        if not self._make_room(need, node):
            return
        for key in keys:
            start = node.end
            rows = [t[slice(*_span(start, B, shift))].clone() for t, shift in sources]
            child = Block(node, key, start + B, rows)
            node.children[key] = child
            self.lru[child] = None
            self.nbytes += child.nbytes
            node = child
        node.boundary = Boundary(conv, recurrent, hidden.clone())
        self.nbytes += sum(_nbytes(t) for t in node.boundary)
        self._touch(node)

    def _sources(self, slot: SlotCache) -> list[tuple[torch.Tensor, int]]:
        """(tensor, shift) of each position-addressed slot tensor a block keeps rows of: every
        attention layer's K/V (and fp8 scales) at their positions, then the draft K/V, whose row
        for position p sits at p - 1 (shift 1)."""
        out = [(t, 0) for i in self.attention for t in slot.kv(i) if t is not None]
        if self.draft:
            out += [(t, 1) for t in slot.draft_kv()[:2]]
        return out

    # --- eviction

    def _touch(self, node: Block) -> None:
        """node and its ancestors the most recent, the ancestors after it (each newer than its descendants)."""
        while node is not self.root:
            self.lru.move_to_end(node)
            node = node.parent

    def _make_room(self, need: int, keep: Block) -> bool:
        """Evict the least recently used unpinned leaves until need more bytes fit (keep's path stays)."""
        if need > self.budget:
            return False
        pinned = []
        node = keep
        while node is not self.root:
            node.pins += 1
            pinned.append(node)
            node = node.parent
        try:
            while self.nbytes + need > self.budget:
                victim = next((b for b in self.lru if not b.children and b.pins == 0), None)
                if victim is None:
                    return False
                self._evict(victim)
            return True
        finally:
            for node in pinned:
                node.pins -= 1

    def _evict(self, block: Block) -> None:
        del block.parent.children[block.key]
        del self.lru[block]
        self.nbytes -= block.nbytes
        self.counters.evicted_blocks += 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rows_nbytes(sources: list[tuple[torch.Tensor, int]], start: int, size: int) -> int:
    """Bytes of a block's rows of positions start..start+size in each (tensor, shift) of sources."""
    total = 0
    for t, shift in sources:
        lo, hi = _span(start, size, shift)
        total += (hi - lo) * _nbytes(t[0])
    return total


def _span(start: int, size: int, shift: int) -> tuple[int, int]:
    """Where a block's rows of positions start..start+size sit in a tensor shifted by `shift`
    (the first block's draft rows: one fewer, position 0 has none)."""
    return max(start - shift, 0), start + size - shift
