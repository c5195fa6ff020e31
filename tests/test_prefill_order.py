"""The order prompts share a step's prefill budget in (Engine._order): the fewest tokens left first,
each step waited counting as a step's budget fewer. Short prompts admitted behind a long one get
their first token first; a long prompt behind a stream of short ones still starts within a bounded
number of steps; and what each request computes does not depend on the order."""

from __future__ import annotations

import functools

import pytest
import torch

import nextn
from nextn.core import SamplingParams

BUDGET = 32


@functools.lru_cache(maxsize=2)
def _engine(ckpt):
    llm = nextn.LLM(
        model=ckpt,
        device="cpu",
        dtype="float32",
        kernels="torch",
        num_speculative_tokens=2,
        max_model_len=128,
        max_num_seqs=8,
        prefill="steps",
        enable_prefix_caching=False,
        max_num_batched_tokens=BUDGET,
    )
    return llm.engine


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=g).tolist()


def _run(engine, arrivals: dict[int, list[list[int]]], max_tokens: int = 3, steps: int = 60):
    """Requests added before the engine step numbered by their key; returns {request index: (the
    step its first token came in, its tokens)}."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs, first, tokens = [], {}, {}
    for step in range(steps):
        for prompt in arrivals.get(step, []):
            reqs.append(engine.add(prompt, params))
        if not engine.has_work:
            if step > max(arrivals):
                break
            continue
        for req, ev in engine.step():
            assert not isinstance(ev, BaseException), ev
            i = next(j for j, r in enumerate(reqs) if r is req)
            if ev.token_ids:
                first.setdefault(i, step)
                tokens.setdefault(i, []).extend(ev.token_ids)
    assert not engine.has_work
    return {i: (first[i], tokens[i]) for i in first}


def test_short_prompts_admitted_behind_a_long_one_start_first(dense_fitted_ckpt):
    engine = _engine(dense_fitted_ckpt)
    prompts = [_prompt(70, 1), _prompt(9, 2), _prompt(30, 3)]  # admitted in this order (9 + 30 > the budget)
    got = _run(engine, {0: prompts})
    # the 9-token prompt is in after the first step (admission order would spend it on the 70-token
    # one), the 30-token one next, the 70-token one last
    assert got[1][0] < got[2][0] < got[0][0], got
    # and each request's tokens are what it computes alone
    for i, prompt in enumerate(prompts):
        alone = _run(engine, {0: [prompt]})
        assert alone[0][1] == got[i][1], i


def test_a_long_prompt_starts_within_a_bounded_number_of_steps(dense_fitted_ckpt):
    engine = _engine(dense_fitted_ckpt)
    long = _prompt(64, 4)
    # two 16-token prompts arrive before every step: by length alone they would take every step's
    # budget, and the long prompt would wait as long as they keep coming
    shorts = {step: [_prompt(16, 100 + 2 * step), _prompt(16, 101 + 2 * step)] for step in range(1, 16)}
    got = _run(engine, {0: [long], **shorts}, max_tokens=1)
    # its age counts a budget a step: after 2 steps it ranks before a fresh short prompt, and its
    # 64 tokens take at most 64 / 16 steps of the least budget a step leaves
    assert got[0][0] <= 2 + 64 // 16 + 1, got[0]


@pytest.mark.parametrize("age", [0, 3])
def test_order_ranks_tokens_left_less_a_budget_per_step_waited(dense_fitted_ckpt, age):
    engine = _engine(dense_fitted_ckpt)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    old, new = engine.add(_prompt(100, 5), params), engine.add(_prompt(40, 6), params)
    try:
        for req in engine.scheduler.admit():
            engine._begin(req)
        engine.prefilling[old.request_id].admitted = engine.steps - age
        order = engine._order([old, new])
        # 100 - 3 * 32 = 4 < 40: the older one first once it has waited three steps
        assert order == ([new, old] if age == 0 else [old, new])
    finally:
        engine.abort(old)
        engine.abort(new)
        assert not engine.has_work


def test_a_prompt_its_slot_holds_whole_still_starts(dense_fitted_ckpt):
    """A request whose whole prompt its slot already holds (a kept session's tokens) has no token
    left to prefill: it is planned all the same, and starts (a share of 0 tokens must not skip it)."""
    engine = _engine(dense_fitted_ckpt)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = _prompt(24, 7)
    first = engine.add(prompt, params, use_sessions=True)
    out = [ev for _ in range(20) if engine.has_work for _, ev in engine.step()]
    tokens = [t for ev in out for t in ev.token_ids]
    assert first.seq is not None and len(tokens) == 2
    again = engine.add(prompt + tokens[:1], params, use_sessions=True)  # the kept conversation, one token on
    later = [ev for _ in range(20) if engine.has_work for _, ev in engine.step()]
    assert again.cached == len(prompt) + 1, again.cached  # its slot held every prompt token
    assert not engine.has_work and later[-1].output is not None
