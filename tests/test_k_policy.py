"""The batch K policy (nextn.spec.k_policy), driven with scripted acceptance and step costs: the K
it settles on against the K the formula E(K) / t(B, K) gives from the true rates and costs
(computed here independently), its exploration out of a misleading start, its hysteresis under
noise, the exactness rule of which requests follow it; and the k_policy setting through
SpecConfig, LLM and the CLI. Pure host arithmetic: no model runs."""

from __future__ import annotations

import random

import pytest

import nextn
from nextn.cli import main
from nextn.config import SpecConfig
from nextn.config.engine_args import EngineArgs
from nextn.core import SamplingParams
from nextn.engine import llm as llm_module
from nextn.spec.k_policy import KPolicy, PolicyTuning, bucket, expected_tokens, make_policy, request_k


def true_best(rates: list[float], cost, batch_size: int, k_max: int) -> int:
    """argmax_K B * E(K) / t(B, K), E(K) = 1 + sum_j prod_{i<=j} a_i, written out independently."""
    best, best_rate = 0, 0.0
    for k in range(k_max + 1):
        e, run = 1.0, 1.0
        for j in range(k):
            run *= rates[j]
            e += run
        if batch_size * e / cost(batch_size, k) > best_rate:
            best, best_rate = k, batch_size * e / cost(batch_size, k)
    return best


def drive(policy: KPolicy, steps: int, batch_sizes, rates, cost, seed: int = 0, noise: float = 0.0) -> list:
    """`steps` engine steps of each batch size in turn: the policy chooses K, every request's round
    accepts draft j with probability rates[j] given the ones before, the step takes cost(B, K)
    seconds (times 1 +- noise). rates may be a function of the step. Returns (B, K run, the bucket's
    choice) per step."""
    rng, picks = random.Random(seed), []
    for step in range(steps):
        for b in batch_sizes:
            k = policy.choose(b)
            picks.append((b, k, policy.choice.get(bucket(b))))
            a = rates(step) if callable(rates) else rates
            for _ in range(b):
                n = 0
                while n < k and rng.random() < a[n]:
                    n += 1
                policy.observe_round(k, n)
            policy.observe_step(b, k, cost(b, k) * (1.0 + noise * (2.0 * rng.random() - 1.0)))
    return picks


def memory_bound(b: int, k: int) -> float:
    return 0.010 * (1.0 + 0.01 * k)  # rows nearly free


def compute_bound(b: int, k: int) -> float:
    return 0.010 + 0.0005 * b * (k + 1)  # a weight read plus every row


def test_buckets_and_expected_tokens():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 64, 72]
    assert expected_tokens([0.9, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.9, 0.5, 0.5], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.225)
    with pytest.raises(ValueError):
        bucket(0)


def test_acceptance_is_per_position_and_conditional():
    """Position j counts only rounds that reached it: rounds accepting 0 of 3 say nothing of
    position 2, so it keeps its prior; position 1's estimate goes to what was observed."""
    p = KPolicy(3, PolicyTuning(prior=(0.7, 0.6, 0.5)))
    assert p.acceptance() == pytest.approx([0.7, 0.6, 0.5])
    for i in range(2000):
        p.observe_round(3, 0 if i % 4 == 0 else 3)  # a_1 = 0.75, then a_2 = a_3 = 1
    a = p.acceptance()
    assert a[0] == pytest.approx(0.75, abs=0.02) and a[1] > 0.97 and a[2] > 0.97
    q = KPolicy(3)
    for _ in range(500):
        q.observe_round(3, 0)
    assert q.acceptance()[0] < 0.03 and q.acceptance()[1:] == pytest.approx([0.6, 0.5])
    with pytest.raises(ValueError):
        q.observe_round(2, 3)


def test_unmeasured_costs_are_estimated_from_neighbours():
    p = KPolicy(4)
    for k, t in ((1, 2.0), (3, 4.0)):
        for _ in range(3):
            p.observe_step(4, k, t)
    seconds = lambda b: [expected_tokens(p.acceptance(), k) / r for k, r in enumerate(p.rates(b))]  # noqa: E731
    # between measured Ks: linear; beyond: the line, kept between flat and proportional to K + 1
    assert seconds(4) == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])
    # a bucket with one measured K takes the nearest shaped bucket's shape, scaled to it; none: that shape
    p.observe_step(8, 1, 4.0)
    assert seconds(8) == pytest.approx([2.0, 4.0, 6.0, 8.0, 10.0])
    assert seconds(1) == pytest.approx(seconds(4))
    # a warm-up sample (a graph capture) is dropped once a step shows the cell is more than twice cheaper
    p.observe_step(16, 2, 50.0)
    p.observe_step(16, 2, 1.0)
    assert p.snapshot()["cost"][16][2] == {"seconds": 1.0, "samples": 1}


def test_high_acceptance_and_flat_cost_picks_k_max():
    p = KPolicy(3)
    picks = drive(p, 300, [1], [0.9] * 3, memory_bound)
    assert true_best([0.9] * 3, memory_bound, 1, 3) == 3
    assert p.snapshot()["choice"] == {1: 3}
    assert [k for _, k, _ in picks[-100:]].count(3) >= 95


def test_zero_acceptance_picks_zero():
    cost = lambda b, k: 0.010 * (1.0 + 0.05 * k)  # noqa: E731 - verify rows cost a little
    p = KPolicy(3)
    picks = drive(p, 300, [4], [0.0] * 3, cost)
    assert p.snapshot()["choice"] == {4: 0}
    assert [k for _, k, _ in picks[-100:]].count(0) >= 95


def test_compute_bound_large_batch_stops_speculating():
    """One policy, two batch sizes: at B=64 every verify row costs, and acceptance 0.6 does not
    pay for them (K=0); at B=1 the rows are nearly free (K=k_max)."""
    rates = [0.6] * 3
    assert (true_best(rates, compute_bound, 64, 3), true_best(rates, compute_bound, 1, 3)) == (0, 3)
    p = KPolicy(3)
    picks = drive(p, 400, [1, 64], rates, compute_bound)
    assert p.snapshot()["choice"] == {1: 3, 64: 0}
    late = picks[-200:]
    assert [k for b, k, _ in late if b == 64].count(0) >= 95 and [k for b, k, _ in late if b == 1].count(3) >= 95


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interior_optimum(seed):
    """Acceptance falling off by position and a moderately growing cost: the best K is inside."""
    rates, cost = [0.9, 0.3, 0.1], lambda b, k: 0.010 * (1.0 + 0.3 * k)  # noqa: E731
    expected = true_best(rates, cost, 8, 3)
    assert 0 < expected < 3
    p = KPolicy(3)
    picks = drive(p, 500, [8], rates, cost, seed=seed)
    assert p.snapshot()["choice"] == {8: expected}
    assert [k for _, k, _ in picks[-100:]].count(expected) >= 95


def test_exploration_recovers_from_misleading_early_costs():
    """The first samples at each K > 0 are slow (warm-up growing with K): the policy walks down to
    K=0, and only its rechecks of the neighbours bring it back to the true best, K=3."""
    seen: dict[int, int] = {}

    def cost(b, k):
        seen[k] = seen.get(k, 0) + 1
        return memory_bound(b, k) * (1 + k if seen[k] <= 3 else 1)

    p = KPolicy(3)
    picks = [k for _, k, _ in drive(p, 1000, [1], [0.9] * 3, cost)]
    assert picks[:20].count(0) >= 10  # misled
    assert all(seen[k] > 3 for k in range(4))  # every K measured past its warm-up
    assert p.snapshot()["choice"] == {1: 3} and picks[-200:].count(3) >= 190


def test_exploration_recovers_from_an_early_run_of_rejections():
    """Acceptance 0 for the first 50 steps, 0.9 after: at K=0 no round says anything of acceptance,
    so only the rechecks at K=1 see it rise and lead the policy back up."""
    cost = lambda b, k: 0.010 * (1.0 + 0.05 * k)  # noqa: E731
    p = KPolicy(3)
    picks = [k for _, k, _ in drive(p, 600, [4], lambda step: [0.0] * 3 if step < 50 else [0.9] * 3, cost)]
    assert picks[30:45] == [0] * 15  # misled
    assert p.snapshot()["choice"] == {4: true_best([0.9] * 3, cost, 4, 3)} == {4: 3}


def test_hysteresis_holds_the_choice_under_noise():
    """K=2 and K=3 tie (E(3) / E(2) = t(3) / t(2)) and each step's time is off by up to 3%: the
    choice holds (the K run differs from it only on rechecks and while a new choice's neighbours are
    measured); without the margin it flips."""
    rates = [0.9, 0.6, 0.3]
    ratio = expected_tokens(rates, 3) / expected_tokens(rates, 2)
    c = (ratio - 1) / (3 - 2 * ratio)  # (1 + 3c) / (1 + 2c) = ratio
    cost = lambda b, k: 0.010 * (1.0 + c * k)  # noqa: E731
    assert expected_tokens(rates, 2) / cost(8, 2) == pytest.approx(expected_tokens(rates, 3) / cost(8, 3))
    flips = {}
    for margin in (PolicyTuning().margin, 0.0):
        p = KPolicy(3, PolicyTuning(margin=margin))
        picks = drive(p, 2000, [8], rates, cost, noise=0.03)
        choices, off = [choice for _, _, choice in picks], sum(k != choice for _, k, choice in picks)
        flips[margin] = sum(x != y for x, y in zip(choices[100:], choices[101:], strict=False))
        if margin:
            assert off <= 2000 // p.tuning.recheck_every + 3 * p.tuning.min_samples * 4
    assert flips[PolicyTuning().margin] <= 3 < 10 <= flips[0.0]


def test_snapshot_and_k0():
    p = KPolicy(2)
    drive(p, 5, [3], [0.8, 0.5], memory_bound)
    s = p.snapshot()
    assert set(s) == {"k_max", "acceptance", "expected_tokens", "cost", "choice"}
    assert len(s["acceptance"]) == 2 and len(s["expected_tokens"]) == 3 and set(s["cost"]) == {4}
    assert sum(cell["samples"] for cell in s["cost"][4].values()) == 5
    plain = KPolicy(0)
    assert {k for _, k, _ in drive(plain, 100, [1, 9], [], memory_bound)} == {0}


def test_which_requests_follow_the_choice():
    greedy, unseeded, seeded = SamplingParams(temperature=0.0, seed=7), SamplingParams(), SamplingParams(seed=7)
    assert (request_k(3, 1, greedy), request_k(3, 1, unseeded), request_k(3, 1, seeded)) == (1, 1, 3)
    assert request_k(2, 3, unseeded) == 2  # a request's own K caps it
    auto = make_policy(SpecConfig(3, k_policy="auto"))
    assert isinstance(auto, KPolicy) and auto.k_max == 3
    assert make_policy(SpecConfig(3)) is None and make_policy(SpecConfig(0, k_policy="auto")) is None


def test_k_policy_setting(monkeypatch, capsys):
    """SpecConfig / LLM refuse an unknown k_policy; the CLI's --spec-k-policy reaches SpecConfig
    (auto by default there; the Python API's default is fixed: the cap) and is refused where nothing is drafted."""
    assert SpecConfig(3).k_policy == "fixed"
    with pytest.raises(ValueError, match=r"k_policy must be one of \('auto', 'fixed'\), got 'greedy'"):
        SpecConfig(3, k_policy="greedy")
    with pytest.raises(ValueError, match="k_policy must be one of"):
        nextn.LLM(num_speculative_tokens=3, k_policy="dynamic", device="cpu")
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--spec-k-policy", "sometimes"])
    assert "--spec-k-policy: invalid choice: 'sometimes'" in capsys.readouterr().err
    assert main(["serve", "--spec-k", "0", "--spec-k-policy", "fixed"]) == 2
    assert capsys.readouterr().err == (
        "nextn: error: --spec-k-policy would do nothing: speculation is off (K=0), nothing is drafted\n"
    )

    class Configured(Exception):  # stops LLM once its settings are checked, before any model is read
        pass

    configs = []
    real = EngineArgs.engine_config
    monkeypatch.setattr(EngineArgs, "engine_config", lambda *a, **kw: configs.append(real(*a, **kw)))
    monkeypatch.setattr(llm_module, "resolve_model", lambda *a: (_ for _ in ()).throw(Configured()))
    for flags, policy in (([], "auto"), (["--spec-k-policy", "fixed"], "fixed"), (["--spec-k-policy", "auto"], "auto")):
        with pytest.raises(Configured):
            main(["generate", "--prompt", "x", "--spec-k", "2", "--device", "cpu", *flags])
        assert (configs[-1].spec.k_policy, configs[-1].spec.num_speculative_tokens) == (policy, 2)


def test_the_engine_applies_the_choice_by_the_exactness_rule():
    """In the engine: a step's choice reaches greedy requests (their rounds draft at most it, and
    their output is unchanged) but not seeded sampled ones (their own K, their output unchanged); the
    policy is fed the rounds read."""
    kw = dict(model=None, device="cpu", num_speculative_tokens=3, max_num_seqs=2)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    fixed = nextn.LLM(**kw)
    expected = [fixed.generate(prompt_token_ids=[5, 9, 40, 7], params=p).token_ids for p in (greedy, seeded)]
    llm = nextn.LLM(**kw, k_policy="auto")
    engine = llm.engine
    assert engine.k_policy is not None
    observed = []
    engine.k_policy.choose = lambda batch_size: 1  # scripted: every step drafts at most 1
    real = engine.k_policy.observe_round
    engine.k_policy.observe_round = lambda k, n: (observed.append((k, n)), real(k, n))
    reqs = [engine.add([5, 9, 40, 7], p) for p in (greedy, seeded)]
    outputs = {}
    while len(outputs) < 2:
        for r, ev in engine.step():
            if ev.output is not None:
                outputs[r.request_id] = ev.output
    g, s = (outputs[r.request_id] for r in reqs)
    assert [g.token_ids, s.token_ids] == expected
    assert g.spec.drafted_per_position[0] > 0 and g.spec.drafted_per_position[1:3] == [0, 0]
    assert s.spec.drafted_per_position[2] > 0  # the seeded request kept its K = 3
    assert observed and max(k for k, _ in observed) == 3 and any(k == 1 for k, _ in observed)
