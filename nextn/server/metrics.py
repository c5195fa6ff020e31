"""Server metrics in the Prometheus text format (vLLM's names under the `nextn:` prefix), and the
periodic throughput/acceptance log line made from them.

Owns the counters and histograms; the worker records into them (under one lock) as the engine
core's events arrive, and /metrics renders them. The engine's own numbers (session store, batch
sizes, CUDA graph counts) are copied in from the snapshot the core sends with each step's events.
Does not know HTTP.
"""

from __future__ import annotations

import threading
import time
from copy import deepcopy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nextn.cache.prefix import PrefixCounters
from nextn.core import MAX_TRACKED_POSITIONS, RequestOutput, SpecStats
from nextn.engine.scheduler import SessionCounters

if TYPE_CHECKING:
    from nextn.engine.engine import EngineTime

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0)
# the runner's CUDA graph counters (engine.runner.graph_counts), shown when the runner keeps them
GRAPH_COUNTS = (
    ("captures", "CUDA graph captures (the model runner's count)."),
    ("replays", "CUDA graph replays (the model runner's count)."),
    ("eager", "Forwards run eagerly, outside CUDA graphs (the model runner's count)."),
    ("kernel_compiles", "Triton kernels compiled by the engine; after its warm-up each is also logged as a warning."),
)
# the engine steps' wall time (nextn.engine.engine.EngineTime), as counters: a served run's deltas
# split its time between prompts and rounds (`nextn bench serve`'s engine_time)
ENGINE_TIME = (
    ("steps", "Engine steps (a loop turn with work: admissions, prefill passes, one batched round)."),
    ("step_seconds", "Wall time of the engine's steps."),
    ("prefill_passes", "Prefill passes (a step's prompt pieces through the model, up to a prefix-cache block each)."),
    ("prefill_seconds", "Wall time of the steps' prefill passes, with the host wait after them (it also waits out "
     "the round launched a step before)."),
    ("round_seconds", "Wall time of the steps' batched rounds (launching one, reading the one before)."),
    ("mixed_steps", "Batched rounds that prompt pieces rode (one trunk step: mixed steps, under --prefill chunked)."),
)  # fmt: skip
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += times
        self.total += value * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for b, c in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cum += c
            le = "+Inf" if b == float("inf") else repr(b)
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        return out + [f"{name}_sum {self.total}", f"{name}_count {self.count}"]


@dataclass
class SessionSnapshot:
    counters: SessionCounters = field(default_factory=SessionCounters)  # a copy of the store's
    num_states: int = 0
    memory_bytes: int = 0


@dataclass
class Totals:
    prompt_tokens: int
    generation_tokens: int
    spec: SpecStats  # a copy of the finished requests' aggregate


class ThroughputLog:
    """The log line of an interval: tokens per second and draft acceptance since the last line."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.last, self.t = metrics.totals(), time.monotonic()

    def line(self, running: int, waiting: int) -> str | None:
        """None when nothing ran and nothing waits (an idle server logs nothing)."""
        now, cur = time.monotonic(), self.metrics.totals()
        prompt, generated = (
            cur.prompt_tokens - self.last.prompt_tokens,
            cur.generation_tokens - self.last.generation_tokens,
        )
        spec = cur.spec.delta_since(self.last.spec)
        dt = max(now - self.t, 1e-9)
        self.last, self.t = cur, now
        if not (prompt or generated or spec.num_rounds) and not running and not waiting:
            return None
        line = f"running {running}, waiting {waiting}; prompt {prompt / dt:.1f} tok/s, "
        line += f"generation {generated / dt:.1f} tok/s"
        if spec.drafted_per_position[0]:  # per round with drafts, as vLLM's
            line += f"; mean acceptance length {1 + spec.num_accepted / spec.drafted_per_position[0]:.2f}"
        return line


class Metrics:
    def __init__(self, num_speculative_tokens: int):
        self.num_positions = min(num_speculative_tokens, MAX_TRACKED_POSITIONS)
        self._lock = threading.Lock()
        self.success: dict[str, int] = {"stop": 0, "length": 0}
        self.aborted = 0
        self.failed = 0
        self.rejected: dict[str, int] = {}
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.spec = SpecStats()  # the finished requests' draft counters
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.sessions = SessionSnapshot()
        self.running = 0
        self.batch_sizes: dict[int, int] = {}  # batched rounds by requests held
        self.graph_counts: dict[str, int] | None = None  # the runner's captures / replays / eager, if it counts
        self.engine_time: EngineTime | None = None  # the engine steps' wall time (None: no step reported yet)
        self.waiting = 0
        self.prefix: PrefixCounters | None = None  # the prefix cache's counters (None: off)
        self.prefix_cache_bytes = 0
        self.prefill_tokens = 0

    def observe_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_tokens(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` arrived together `seconds` after the previous ones: each waited seconds/n."""
        with self._lock:
            self.itl.observe(seconds / num_tokens, num_tokens)

    def finished(self, out: RequestOutput, e2e_seconds: float) -> None:
        with self._lock:
            self.success[out.finish_reason] = self.success.get(out.finish_reason, 0) + 1
            self.prompt_tokens += out.prompt_tokens
            self.cached_tokens += out.cached_tokens
            self.generation_tokens += len(out.token_ids)
            self.spec.merge(out.spec)
            self.e2e.observe(e2e_seconds)

    def ended_early(self, aborted: bool, prompt_tokens: int, generated_tokens: int) -> None:
        """A request the client dropped (aborted) or the engine failed on."""
        with self._lock:
            if aborted:
                self.aborted += 1
            else:
                self.failed += 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generated_tokens

    def rejected_request(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def set_sessions(self, snap: SessionSnapshot) -> None:
        with self._lock:
            self.sessions = snap

    def totals(self) -> Totals:
        with self._lock:
            return Totals(self.prompt_tokens, self.generation_tokens, deepcopy(self.spec))

    def set_batch_sizes(self, sizes: dict[int, int]) -> None:
        """Batched rounds launched so far by the number of requests they held (the engine's)."""
        with self._lock:
            self.batch_sizes = sizes

    def set_engine(
        self,
        sessions: SessionSnapshot,
        batch_sizes: dict[int, int],
        graph_counts: dict[str, int] | None,
        engine_time: EngineTime | None = None,
    ) -> None:
        """The engine core's numbers as of its last step (set_sessions and set_batch_sizes at once)."""
        with self._lock:
            self.sessions, self.batch_sizes, self.graph_counts = sessions, batch_sizes, graph_counts
            self.engine_time = engine_time

    def set_prefix(self, counters: PrefixCounters | None, nbytes: int, prefill_tokens: int) -> None:
        """The prefix cache's counters and bytes, and the prompt tokens computed, as of the engine's last step."""
        with self._lock:
            self.prefix, self.prefix_cache_bytes, self.prefill_tokens = counters, nbytes, prefill_tokens

    def set_queue(self, running: int, waiting: int) -> None:
        with self._lock:
            self.running, self.waiting = running, waiting

    def render(self) -> str:
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
                # text format 0.0.4: a counter's TYPE names its samples, `_total` included
                lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

            def counter(name: str, help_: str, value, labels: str = "") -> None:
                metric(name, "counter", help_, [f"{name}{labels} {value}"])

            def gauge(name: str, help_: str, value) -> None:
                metric(name, "gauge", help_, [f"{name} {value}"])

            gauge("nextn:num_requests_running", "Requests being generated (one batched forward).", self.running)
            gauge("nextn:num_requests_waiting", "Requests waiting for a cache slot.", self.waiting)
            sizes, bounds, samples = self.batch_sizes, (1, 2, 4, 8, 16, 32, 64, 128), []
            for le in bounds:
                samples.append(f'nextn:batch_size_bucket{{le="{le}"}} {sum(n for b, n in sizes.items() if b <= le)}')
            total = sum(sizes.values())
            samples += [
                f'nextn:batch_size_bucket{{le="+Inf"}} {total}',
                f"nextn:batch_size_sum {sum(b * n for b, n in sizes.items())}",
                f"nextn:batch_size_count {total}",
            ]
            metric("nextn:batch_size", "histogram", "Requests per batched round launched.", samples)
            metric(
                "nextn:request_success_total",
                "counter",
                "Finished requests by finish reason.",
                [f'nextn:request_success_total{{finished_reason="{k}"}} {v}' for k, v in sorted(self.success.items())],
            )
            counter("nextn:request_aborted_total", "Requests cancelled by a client disconnect.", self.aborted)
            counter("nextn:request_failed_total", "Requests the engine failed on.", self.failed)
            metric(
                "nextn:request_rejected_total",
                "counter",
                "Requests refused before queueing, by reason.",
                [f'nextn:request_rejected_total{{reason="{k}"}} {v}' for k, v in sorted(self.rejected.items())],
            )
            counter("nextn:prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens)
            counter("nextn:generation_tokens_total", "Generated tokens.", self.generation_tokens)
            counter(
                "nextn:prefill_tokens_computed_total",
                "Prompt tokens prefilled (computed, not served from a kept session or the prefix cache).",
                self.prefill_tokens,
            )
            if self.prefix is not None:  # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
                p = self.prefix
                counter("nextn:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", p.queries)
                counter("nextn:prefix_cache_hits_total", "Looked-up prompt tokens the prefix cache served.", p.hits)
                counter("nextn:prefix_cache_evicted_blocks_total", "Prefix cache blocks evicted.", p.evicted_blocks)
                gauge("nextn:prefix_cache_bytes", "Bytes held by the prefix cache's blocks.", self.prefix_cache_bytes)
            metric(
                "nextn:time_to_first_token_seconds",
                "histogram",
                "Time from arrival to the first token.",
                self.ttft.lines("nextn:time_to_first_token_seconds"),
            )
            metric(
                "nextn:inter_token_latency_seconds",
                "histogram",
                "Time per output token after the first (a round's wait split over its tokens).",
                self.itl.lines("nextn:inter_token_latency_seconds"),
            )
            metric(
                "nextn:e2e_request_latency_seconds",
                "histogram",
                "Time from arrival to the last token.",
                self.e2e.lines("nextn:e2e_request_latency_seconds"),
            )
            self._spec_metrics(metric, counter)
            s, c = self.sessions, self.sessions.counters
            counter("nextn:session_lookups_total", "Session lookups by prompt prefix.", c.lookups)
            counter("nextn:session_hits_total", "Lookups that found a kept session state.", c.hits)
            counter("nextn:session_rewinds_total", "Hits that rewound a state to its prompt-end checkpoint.", c.rewinds)
            counter("nextn:session_evictions_total", "Session states evicted under the memory budget.", c.evictions)
            counter(
                "nextn:prompt_tokens_cached_total", "Prompt tokens served from kept session state.", self.cached_tokens
            )
            gauge("nextn:session_states", "Kept session states.", s.num_states)
            gauge(
                "nextn:session_memory_bytes",
                "Bytes held by kept session states: their cache slots and the CUDA graphs captured for them.",
                s.memory_bytes,
            )
            if self.graph_counts is not None:
                for key, help_ in GRAPH_COUNTS:
                    counter(f"nextn:graph_{key}_total", help_, self.graph_counts.get(key, 0))
            if self.engine_time is not None:
                for key, help_ in ENGINE_TIME:
                    counter(f"nextn:engine_{key}_total", help_, getattr(self.engine_time, key))
            return "\n".join(lines) + "\n"

    def _spec_metrics(self, metric, counter) -> None:
        """The draft counters in vLLM's names, zero-draft rounds and the accept-length histogram."""
        s, positions = self.spec, range(self.num_positions)
        counter(
            "nextn:spec_decode_num_drafts_total",
            "Verify rounds with at least one draft token.",
            s.drafted_per_position[0],
        )
        counter("nextn:spec_decode_num_draft_tokens_total", "Draft tokens proposed.", s.num_drafted)
        counter("nextn:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", s.num_accepted)
        counter(
            "nextn:spec_decode_num_zero_draft_rounds_total",
            "Verify rounds of the pending token alone (a confidence gate cut the first draft).",
            s.num_zero_draft_rounds,
        )
        for name, help_, values in (
            ("accepted_tokens", "Draft tokens accepted at each draft position.", s.accepted_per_position),
            ("draft_tokens", "Draft tokens proposed at each draft position.", s.drafted_per_position),
        ):
            full = f"nextn:spec_decode_num_{name}_per_pos_total"
            metric(full, "counter", help_, [f'{full}{{position="{j}"}} {values[j]}' for j in positions])
        lengths = Histogram(tuple(positions) + (self.num_positions,))  # drafts accepted per round, 0..K
        lengths.counts = s.accept_length_histogram[: self.num_positions + 1] + [0]
        lengths.total, lengths.count = s.num_accepted, s.num_rounds
        name = "nextn:spec_decode_accept_length"
        metric(name, "histogram", "Draft tokens accepted per verify round.", lengths.lines(name))
