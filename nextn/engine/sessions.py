"""Kept conversation states: found by longest token prefix, rewound to their prompt-end
checkpoint when a client rewrote what followed, evicted least-recently-used under a byte budget.

A state is checked out while a request runs on it, so two requests never share one.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from nextn.engine.state import SeqState


@dataclass
class SessionCounters:
    lookups: int = 0
    hits: int = 0
    rewinds: int = 0
    reused_tokens: int = 0
    evictions: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def usable_prefix(state: SeqState, prompt: list[int]) -> tuple[int, bool]:
    """(prompt tokens this state can serve without recomputing, whether it must rewind first)."""
    lcp = common_prefix(state.tokens, prompt)
    if lcp == len(state.tokens):
        return lcp, False
    ckpt = state.checkpoint
    if ckpt is not None and ckpt.num_tokens <= lcp:
        return ckpt.num_tokens, True
    return 0, False


class SessionStore:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._states: OrderedDict[int, SeqState] = OrderedDict()
        self.counters = SessionCounters()

    def acquire(self, prompt: list[int]) -> tuple[SeqState | None, int]:
        """Check out the state serving the longest prefix of `prompt` (rewound if needed)."""
        self.counters.lookups += 1
        best, best_len, best_rewind = None, 0, False
        for key, state in self._states.items():
            n, rewind = usable_prefix(state, prompt)
            if n > best_len:
                best, best_len, best_rewind = key, n, rewind
        if best is None:
            return None, 0
        state = self._states.pop(best)
        if best_rewind:
            state.rewind_to_checkpoint()
            self.counters.rewinds += 1
        self.counters.hits += 1
        self.counters.reused_tokens += best_len
        return state, best_len

    def release(self, state: SeqState) -> None:
        """Keep `state` as most recently used; evict the oldest beyond the budget."""
        if state.nbytes > self.budget_bytes:
            return
        self._states[id(state)] = state
        while sum(s.nbytes for s in self._states.values()) > self.budget_bytes:
            self._states.popitem(last=False)
            self.counters.evictions += 1

    def __len__(self) -> int:
        return len(self._states)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._states.values())
