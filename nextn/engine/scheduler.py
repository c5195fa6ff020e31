"""The scheduler: which requests run, and in which cache slots. No tensors.

Owns the waiting queue (FIFO, bounded), the running requests (each holding a slot; all of them
take part in every batched round), admission (a waiting request gets the kept session serving the
longest prefix of its prompt, else a free slot, else the least recently used session's slot) and
sessions: a finished conversation keeps its slot, pinned, until a request continues it or its
slot is needed. Also the request's settings as its rounds follow them (`RoundSettings`): one object
made where the engine takes the request, carried by it to its rounds (as nano-vllm's Sequence
carries its sampling settings).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from nextn.core import SamplingParams
from nextn.engine.sequence import Sequence


class QueueFull(Exception):
    """More requests wait than the server queues (raised by the server's worker)."""


@dataclass
class SessionCounters:
    lookups: int = 0
    hits: int = 0
    rewinds: int = 0
    reused_tokens: int = 0
    evictions: int = 0


@dataclass(frozen=True)
class RoundSettings:
    """What a request's rounds follow (nextn.engine.rounds.RequestRounds), made once where the engine
    takes the request (Engine.add)."""

    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()  # the tokens that end the output (EOS unless ignore_eos, stop_token_ids)
    num_speculative_tokens: int | None = None  # its K (0..the engine's; None: the engine's)
    trace: bool = False  # a RoundTrace per round read (EngineConfig.trace)

    @property
    def want_logits(self) -> bool:
        """The rounds keep the logits of the tokens they emit (for their logprobs)."""
        return self.params.logprobs is not None


@dataclass
class Request:
    prompt_ids: list[int]
    settings: RoundSettings
    use_sessions: bool = False
    checkpoint_at: int | None = None  # where the session's rewind checkpoint goes (None: prompt end)
    request_id: int = field(default_factory=itertools.count().__next__)
    arrived: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None  # the slot's record, once admitted
    cached: int = 0  # prompt tokens its slot already held
    rewind: bool = False  # the slot must rewind to its checkpoint first
    grammar: object | None = None  # its compiled structured_outputs (nextn.grammar.CompiledGrammar)
    detokenize: bool = True  # the engine makes its text (False: the caller does, nextn.engine.detokenizer)

    @property
    def params(self) -> SamplingParams:
        return self.settings.params


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def usable_prefix(seq: Sequence, prompt: list[int]) -> tuple[int, bool]:
    """(prompt tokens this kept sequence can serve without recomputing, whether it must rewind)."""
    lcp = common_prefix(seq.tokens, prompt)
    if lcp == len(seq.tokens):
        return lcp, False
    ckpt = seq.checkpoint
    if ckpt is not None and ckpt.num_tokens <= lcp:
        return ckpt.num_tokens, True
    return 0, False


class Scheduler:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.waiting: deque[Request] = deque()
        self.running: deque[Request] = deque()  # in turn order
        self.free = list(range(num_slots))
        self.sessions: OrderedDict[int, Sequence] = OrderedDict()  # slot -> kept sequence, oldest first
        self.counters = SessionCounters()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Waiting requests that get a slot now (FIFO), their `seq`, `cached` and `rewind` set; the
        engine prefills them. A new Sequence marks a fresh (or evicted) slot."""
        admitted = []
        while self.waiting:
            req = self.waiting[0]
            found = self._session_for(req) if req.use_sessions else None
            if found is None:
                slot = self._free_slot()
                if slot is None:
                    break
                req.seq = Sequence(slot, heads=False)
            self.waiting.popleft()
            # counted once admitted: a request that waits for a slot looks again every step
            self.counters.lookups += int(req.use_sessions)
            self.running.append(req)
            admitted.append(req)
        return admitted

    def _session_for(self, req: Request) -> Sequence | None:
        best, best_len, best_rewind = None, 0, False
        for slot, seq in self.sessions.items():
            n, rewind = usable_prefix(seq, req.prompt_ids)
            if n > best_len:
                best, best_len, best_rewind = slot, n, rewind
        if best is None:
            return None
        req.seq, req.cached, req.rewind = self.sessions.pop(best), best_len, best_rewind
        self.counters.hits += 1
        self.counters.rewinds += int(best_rewind)
        self.counters.reused_tokens += best_len
        return req.seq

    def _free_slot(self) -> int | None:
        if self.free:
            return self.free.pop(0)
        if self.sessions:  # evict the least recently used conversation
            slot, _ = self.sessions.popitem(last=False)
            self.counters.evictions += 1
            return slot
        return None

    def finish(self, req: Request, keep: bool) -> None:
        """The request is over: its slot becomes a kept session (keep, and it holds tokens: one aborted
        before its first prefill chunk could match no prompt and would hold the slot till evicted) or free."""
        self.running.remove(req)
        if keep and req.seq.tokens:
            self.sessions[req.seq.slot] = req.seq
        else:
            self.free.append(req.seq.slot)

    def cancel_waiting(self, req: Request) -> bool:
        try:
            self.waiting.remove(req)
        except ValueError:
            return False
        return True
