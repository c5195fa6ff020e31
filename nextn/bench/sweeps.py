"""The speculative sections of `nextn bench`'s report, one function each, with their log lines.

Greedy spec at each K under one draft confidence gate (speed, exactness, acceptance, the time
split of a traced round), seeded sampled runs, acceptance-profile runs and batched runs, each
written into the report dict, and a round's overhead beyond its steps (`round_overhead`).
Does not time anything itself (nextn.bench.measure's Bench runs the generations) and does not
measure the costs it compares with: it reads `decode_tokens_per_s`, `verify_cost_ratio` and
`draft_cost_ratio` from the report, which nextn.bench.offline.s run_bench writes before it calls these.
"""

from __future__ import annotations

import statistics

from nextn.bench.measure import Bench, RunResult, spread_text, tokens_per_s
from nextn.core import SpecStats


def _round_overhead(
    res: dict, key: str, k: int, runs: list[RunResult], out: dict | None = None, head_steps: float | None = None
) -> None:
    """t(round) / t(plain token) - verify - head steps (default k) drafts: what a round costs beyond
    its steps (into out, default res, whose costs it reads)."""
    if "draft_cost_ratio" not in res or k not in res["verify_cost_ratio"]:
        return
    out = res if out is None else out
    seconds = statistics.median(r.seconds / max(1, r.stats.num_rounds) for r in runs)
    ratio = seconds / (1.0 / res["decode_tokens_per_s"])
    out.setdefault(f"{key}round_cost_ratio", {})[k] = ratio
    steps = k if head_steps is None else head_steps
    out.setdefault(f"{key}round_overhead", {})[k] = (
        ratio - res["verify_cost_ratio"][k] - steps * res["draft_cost_ratio"]
    )


# a run's acceptance at each K (`_acceptance`), in the greedy and the sampled sections alike
_ACCEPTANCE = ("acceptance_rate", "mean_acceptance_length", "accepted_per_position", "num_zero_draft_rounds")
_PER_K = ("spec_equals_plain", "spec_tokens_per_s", "spec_tokens_per_s_runs", "spec_speedup", *_ACCEPTANCE)
_SAMPLED_PER_K = ("spec_tokens_per_s", "spec_speedup", "num_rounds", *_ACCEPTANCE)


def _acceptance(out: dict, k: int, stats: SpecStats) -> None:
    """The _ACCEPTANCE keys of out at K = k, from a run's (or runs') counters."""
    out["acceptance_rate"][k] = stats.acceptance_rate
    out["mean_acceptance_length"][k] = stats.mean_acceptance_length
    out["accepted_per_position"][k] = stats.accepted_per_position[:k]
    out["num_zero_draft_rounds"][k] = stats.num_zero_draft_rounds


def gate_entry(parent: dict, i: int, p_min: float) -> dict:
    """Where the runs at the i-th draft confidence gate p_min go: parent itself for the first gate,
    parent["p_min_runs"][p_min] for the others."""
    return parent if i == 0 else parent.setdefault("p_min_runs", {}).setdefault(p_min, {})


def spec_sweep(bench: Bench, res: dict, out: dict, ks: list[int], reference: list[int], p_min: float, log) -> None:
    """Greedy spec at each K with a draft confidence gate p_min, into out (res: the costs to compare
    with): speed, exactness, acceptance, and from one traced run more, the time split per round."""
    out["p_min"] = p_min
    for name in (*_PER_K, "accept_length_histogram", "head_steps_per_round", "round_split_ms"):
        out[name] = {}
    for k in ks:
        runs, tps = bench.repeated(k, p_min=p_min)
        if res["cuda_graphs"]:  # the traced rounds' graphs captured first
            bench.generate(k, p_min=p_min, trace=True)
        traced = bench.generate(k, p_min=p_min, trace=True)
        stats = runs[0].stats
        out["spec_equals_plain"][k] = all(r.token_ids == reference for r in [*runs, traced])
        out["spec_tokens_per_s"][k] = tps
        out["spec_tokens_per_s_runs"][k] = tokens_per_s(runs)
        out["spec_speedup"][k] = tps / res["decode_tokens_per_s"]
        _acceptance(out, k, stats)
        out["accept_length_histogram"][k] = stats.accept_length_histogram[: k + 1]
        rounds = traced.rounds
        steps = k * len(rounds) if traced.head_steps is None else traced.head_steps  # ungated: every step runs
        out["head_steps_per_round"][k] = steps / max(1, len(rounds))
        out["round_split_ms"][k] = {
            phase: 1e3 * statistics.fmean(getattr(r, f"{phase}_s") for r in rounds) if rounds else 0.0
            for phase in ("draft", "verify", "commit")
        }
        _round_overhead(res, "", k, runs, out, out["head_steps_per_round"][k])
        split = out["round_split_ms"][k]
        log(
            f"bench: K={k} p_min={p_min}: equal={out['spec_equals_plain'][k]} {tps:.1f} tok/s{spread_text(runs)} "
            f"acceptance {stats.acceptance_rate:.2f} mean length {stats.mean_acceptance_length:.2f} "
            f"zero-draft rounds {stats.num_zero_draft_rounds}/{stats.num_rounds} "
            f"head steps/round {out['head_steps_per_round'][k]:.2f}; per round: draft {split['draft']:.3f} ms, "
            f"verify {split['verify']:.3f} ms, commit {split['commit']:.3f} ms; "
            f"round overhead {out.get('round_overhead', {}).get(k, float('nan')):.3f}"
        )


def batched_runs(bench: Bench, res: dict, k: int, reference: list[int], log) -> None:
    """B sequences decoding together, plain and at K = k (through the acceptance profile if set)."""
    profile = (bench.cfg.acceptance_profile, reference, bench.cfg.seed) if bench.cfg.acceptance_profile else None
    out = res["batch_tokens_per_s"] = {"plain": {}, "spec": {}, "spec_k": k, "spec_profile": profile is not None}
    equal = res["batch_outputs_equal_plain"] = {"plain": {}, "spec": {}}
    for B in bench.cfg.batch_sizes:
        for key, kk in (("plain", 0), ("spec", k)) if k > 0 else (("plain", 0),):
            bench.generate_batch(kk, B, profile if kk else None)  # warm-up: compiles, captures the graphs
            ids, seconds = bench.generate_batch(kk, B, profile if kk else None)
            out[key][B] = B * bench.cfg.gen_len / seconds
            equal[key][B] = all(x == reference for x in ids)
        spec = f", spec K={k} {out['spec'][B]:.1f} tok/s (equal {equal['spec'][B]})" if k > 0 else ""
        log(f"bench: batch {B}: plain {out['plain'][B]:.1f} tok/s (equal {equal['plain'][B]}){spec}")
    bench.cores.clear()


def sampled_runs(bench: Bench, res: dict, ks: list[int], temperature: float, log) -> None:
    """Seeded sampling at `temperature`: plain and each K at each draft confidence gate of
    cfg.p_mins (exact in law, not token for token); the first gate's runs give the entry's keys,
    the others `p_min_runs[P]` with the same keys."""
    runs, plain = bench.repeated(0, temperature)
    entry = res.setdefault("sampled", {})[temperature] = {"decode_tokens_per_s": plain}
    log(f"bench: T={temperature} plain {plain:.1f} tok/s{spread_text(runs)}")
    for i, p_min in enumerate(bench.cfg.p_mins):
        out = gate_entry(entry, i, p_min)
        out["p_min"] = p_min
        for name in _SAMPLED_PER_K:
            out[name] = {}
        for k in ks:
            runs, tps = bench.repeated(k, temperature, p_min=p_min)
            stats = SpecStats()
            for r in runs:
                stats.merge(r.stats)
            out["spec_tokens_per_s"][k] = tps
            out["spec_speedup"][k] = tps / plain
            out["num_rounds"][k] = stats.num_rounds
            _acceptance(out, k, stats)
            if i == 0 and (temperature == 0.7 or len(bench.cfg.temperatures) == 1):
                res.setdefault("sampled_spec_speedup", {})[k] = tps / plain
            log(
                f"bench: T={temperature} K={k} p_min={p_min}: {tps:.1f} tok/s{spread_text(runs)} ({tps / plain:.2f}x) "
                f"acceptance {stats.acceptance_rate:.2f} mean length {stats.mean_acceptance_length:.2f} "
                f"zero-draft rounds {stats.num_zero_draft_rounds}/{stats.num_rounds} over seeds "
                f"{bench.cfg.seed}..{bench.cfg.seed + len(runs) - 1}, accepted per position "
                f"{stats.accepted_per_position[:k]}"
            )


def profiled_runs(bench: Bench, res: dict, ks: list[int], profile: list[float], reference: list[int], log) -> None:
    """Greedy rounds whose drafts follow an acceptance profile (the real head still drafts)."""
    res["acceptance_profile"] = profile
    res.update(
        profile_spec_speedup={},
        profile_tokens_per_s={},
        profile_equals_plain={},
        profile_mean_acceptance_length={},
        profile_accepted_per_position={},
    )
    for k in ks:
        runs, tps = bench.repeated(k, profile=(profile, reference, bench.cfg.seed))
        stats = runs[0].stats
        res["profile_tokens_per_s"][k] = tps
        res["profile_spec_speedup"][k] = tps / res["decode_tokens_per_s"]
        res["profile_equals_plain"][k] = all(r.token_ids == reference for r in runs)
        res["profile_mean_acceptance_length"][k] = stats.mean_acceptance_length
        res["profile_accepted_per_position"][k] = [
            a / max(1, d) for a, d in zip(stats.accepted_per_position[:k], stats.drafted_per_position[:k], strict=True)
        ]
        _round_overhead(res, "profile_", k, runs)
        log(
            f"bench: profile K={k}: {tps:.1f} tok/s{spread_text(runs)} ({res['profile_spec_speedup'][k]:.2f}x) "
            f"mean length {stats.mean_acceptance_length:.2f} equal={res['profile_equals_plain'][k]}"
        )
