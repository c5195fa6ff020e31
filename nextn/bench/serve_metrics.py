"""What `nextn bench serve` reads off a server's /metrics (Prometheus text): the mean acceptance
length, the prefix cache's hit rate and prefill tokens, K, and nextn's engine step time, from counter
deltas over the timed run; under any prefix (`nextn:`, `vllm:`), with or without `_total`, so vLLM's
names read too."""

from __future__ import annotations

import contextlib
import re

# Prometheus text: name, optional {labels}, value (an optional timestamp after it is ignored)
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample (name with its labels): value}."""
    out = {}
    for line in text.splitlines():
        if (m := _SAMPLE.match(line)) and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                out[m[1] + (m[2] or "")] = float(m[3])
    return out


def _samples(metrics: dict[str, float], name: str) -> dict[str, float]:
    """The samples of counter `name` under any prefix (`nextn:`, `vllm:`), with or without `_total`."""
    return {k: v for k, v in metrics.items() if k.split("{")[0].rsplit(":", 1)[-1].removesuffix("_total") == name}


def mean_acceptance_length(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """1 + accepted draft tokens / drafts over the run, from the counters' deltas; None without them
    or without a draft (plain decoding)."""
    if before is None or after is None:
        return None

    def delta(name: str) -> float:
        return sum(_samples(after, name).values()) - sum(_samples(before, name).values())

    drafts = delta("spec_decode_num_drafts")
    return 1 + delta("spec_decode_num_accepted_tokens") / drafts if drafts > 0 else None


def prefix_caching(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """`prefix_caching` (whether the server's /metrics has prefix-cache counters; None without
    /metrics), and over the run, from the counters' deltas: `prefix_cache_hit_rate` (hit / looked-up
    prompt tokens) and `prefill_tokens_computed` (prompt tokens the server computed; nextn's)."""
    if before is None or after is None:
        return {"prefix_caching": None, "prefix_cache_hit_rate": None, "prefill_tokens_computed": None}

    def delta(name: str) -> float | None:
        if not _samples(after, name):
            return None
        return sum(_samples(after, name).values()) - sum(_samples(before, name).values())

    queries, hits, computed = (
        delta("prefix_cache_queries"),
        delta("prefix_cache_hits"),
        delta("prefill_tokens_computed"),
    )
    return {
        "prefix_caching": queries is not None,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "prefill_tokens_computed": None if computed is None else int(computed),
    }


def metrics_spec_k(metrics: dict[str, float] | None) -> int | None:
    """K as the server's per-position draft counters tell it (their positions: 0..K-1; nextn keeps at
    most 8), 0 for a server with spec counters and no positions, None for one without."""
    if metrics is None or not _samples(metrics, "spec_decode_num_drafts"):
        return None
    per_pos = _samples(metrics, "spec_decode_num_draft_tokens_per_pos")
    return len({m[1] for k in per_pos if (m := _POSITION.search(k))})


_ENGINE_COUNTER = re.compile(r"(?:^|:)engine_(\w+?)(?:_total)?$")


def engine_time(before: dict[str, float] | None, after: dict[str, float] | None, duration: float) -> dict | None:
    """Where the server's engine spent the timed run (nextn's `engine_*` counters' deltas, by their
    names: its steps, their prefill passes and batched rounds, in seconds of wall time), beside the
    run's duration; None for a server without them."""
    if before is None or after is None or not _samples(after, "engine_steps"):
        return None
    out = {}
    for name, value in after.items():
        if m := _ENGINE_COUNTER.search(name):
            out[m[1]] = value - before.get(name, 0.0)
    out["run_seconds"] = duration
    return out
