"""Kept sessions in bf16: with prefill="steps" a resumed or rewound session emits exactly what a
cold run of the same prompt emits (every token's state comes from the same per-row arithmetic,
however the conversation was split into requests)."""

from __future__ import annotations

import random

import pytest
import torch

import nextn

GREEDY = nextn.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("name", ["dense_ckpt", "next_ckpt"])
def test_resumed_and_rewound_sessions_equal_cold_runs_bf16(name, request):
    ckpt = request.getfixturevalue(name)
    warm = nextn.LLM(model=ckpt, dtype="bfloat16", num_speculative_tokens=3, prefill="steps")
    cold = nextn.LLM(model=ckpt, dtype="bfloat16", num_speculative_tokens=3, prefill="steps")
    rng = random.Random(0)
    for _ in range(8):
        turn1 = [rng.randrange(340) for _ in range(rng.randrange(5, 60))]
        reply = warm.generate(prompt_token_ids=turn1, params=GREEDY, use_sessions=True).token_ids
        turn2 = turn1 + reply + [rng.randrange(340) for _ in range(rng.randrange(3, 30))]
        resumed = warm.generate(prompt_token_ids=turn2, params=GREEDY, use_sessions=True)
        assert resumed.cached_tokens >= len(turn1)
        assert resumed.token_ids == cold.generate(prompt_token_ids=turn2, params=GREEDY).token_ids
        # the client rewrote the reply it got (as clients that strip <think> blocks do): the state
        # rewinds to turn 2's prompt-end checkpoint and prefills the rewritten reply
        turn3 = turn2 + resumed.token_ids[:3] + [1, 2, 3] + [rng.randrange(340) for _ in range(5)]
        rewound = warm.generate(prompt_token_ids=turn3, params=GREEDY, use_sessions=True)
        assert rewound.cached_tokens >= len(turn2)
        assert rewound.token_ids == cold.generate(prompt_token_ids=turn3, params=GREEDY).token_ids
    assert warm.engine.scheduler.counters.rewinds > 0


def test_prefill_mode_is_validated(dense_ckpt):
    with pytest.raises(ValueError, match="prefill"):
        nextn.LLM(model=dense_ckpt, prefill="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton step in CUDA graphs")
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_k=20, seed=7)])
def test_resumed_equals_cold_on_the_gpu(dense_fitted_ckpt, sampling):
    """The Triton path, greedy and seeded sampled: a 6-turn conversation (each turn the previous
    prompt, the reply and new text) resumed from kept sessions emits what a cold engine emits,
    drafts included (the head's catch-up runs the step's per-row arithmetic whatever the split),
    token for token and logprob for logprob. The later turns' cold prefills pass WIDE_ROWS rows
    (the GEMMs' wide tiles) where the resumed replies' rows were decoded in 16-row tiles."""
    from nextn.ops.linear_configs import WIDE_ROWS

    kw = dict(model=dense_fitted_ckpt, device="cuda", dtype="bfloat16", num_speculative_tokens=3, prefill="steps")
    warm, cold = nextn.LLM(**kw), nextn.LLM(**kw)
    params = nextn.SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1, **sampling)
    rng = random.Random(1)
    prompt: list[int] = []
    for _ in range(6):
        prompt = prompt + [rng.randrange(340) for _ in range(rng.randrange(20, 60))]
        resumed = warm.generate(prompt_token_ids=prompt, params=params, use_sessions=True)
        fresh = cold.generate(prompt_token_ids=prompt, params=params)
        assert resumed.token_ids == fresh.token_ids
        assert [e["logprob"] for e in resumed.logprobs] == [e["logprob"] for e in fresh.logprobs]
        prompt = prompt + resumed.token_ids
    assert resumed.cached_tokens > 0 and len(prompt) - 24 > WIDE_ROWS


def test_a_request_waiting_for_a_slot_is_one_session_lookup():
    """The scheduler counted a lookup each step a session request waited for a slot (every slot
    running), inflating nextn:session_lookups_total against its hits."""
    from nextn.engine.scheduler import Request, RoundSettings, Scheduler

    sched = Scheduler(1)
    first = Request([1, 2, 3], RoundSettings(GREEDY), use_sessions=True)
    sched.add(first)
    assert sched.admit() == [first]
    waiting = Request([1, 2, 3, 4], RoundSettings(GREEDY), use_sessions=True)
    sched.add(waiting)
    for _ in range(3):
        assert sched.admit() == []
    first.seq.tokens = [1, 2, 3]
    sched.finish(first, keep=True)
    assert sched.admit() == [waiting] and waiting.cached == 3
    assert (sched.counters.lookups, sched.counters.hits) == (2, 1)


def test_a_session_request_ended_before_its_prefill_frees_its_slot():
    """A session request aborted before any prompt chunk was prefilled was kept as a session of no
    tokens: it matched no prompt and held its slot until evicted. Its slot goes back free."""
    from nextn.engine.scheduler import Request, RoundSettings, Scheduler

    sched = Scheduler(2)
    empty, full = (
        Request([1, 2, 3], RoundSettings(GREEDY), use_sessions=True),
        Request([4, 5], RoundSettings(GREEDY), use_sessions=True),
    )
    sched.add(empty)
    sched.add(full)
    assert sched.admit() == [empty, full]
    full.seq.tokens = [4, 5]
    sched.finish(empty, keep=True)
    sched.finish(full, keep=True)
    assert list(sched.sessions) == [full.seq.slot] and sched.free == [empty.seq.slot]
