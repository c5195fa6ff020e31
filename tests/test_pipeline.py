"""Pipelined plain decoding (`pipelined_rounds`, the next step queued before the host reads this
round's token) against the round-by-round loop (`verify_rounds` with no drafts): the same events
(tokens, finish reasons, logprob rows, round counts) and the same state afterwards, bitwise,
whether the request ends by the budget, a stop token, the context, or the consumer closing it;
and a second turn on either state continues identically."""
from __future__ import annotations

import pytest
import torch
import triton_interp  # noqa: F401  (before triton: its interpreter on CPU)

import nextn
from nextn.config import SpecConfig
from nextn.core import SamplingParams, SpecStats
from nextn.engine import generate
from nextn.engine.fast import build_engine
from nextn.engine.selector import TokenSelector
from nextn.models.loader import load_model

PROMPTS = [[7, 81, 3, 199, 42, 5, 260, 11], [17], [5, 5, 5, 5, 9, 300, 2]]
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=1234)
SECOND_TURN = [40, 7, 250]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CUDA: token reads through pinned memory


@pytest.fixture(scope="module")
def runner(dense_ckpt):
    return build_engine(load_model(dense_ckpt, device=DEVICE), SpecConfig(), "torch")[0]


def _prefilled(runner, prompt, max_len=96):
    state = runner.new_state(max_len)
    runner.extend(state, prompt)
    return state


def _run(runner, state, params, stop_ids=(), pipelined=True, close_after=None):
    """Events as (token_ids, finish_reason, logprob rows), the round count and the steps run."""
    selector = TokenSelector(params, state.tokens, runner.cfg.vocab_size, runner.device)
    stats = SpecStats()
    if pipelined:
        rounds = generate.pipelined_rounds(runner, state, selector, set(stop_ids), stats, want_logits=True)
    else:
        rounds = generate.verify_rounds(runner, None, state, selector, SpecConfig(), set(stop_ids), stats, True)
    events, steps = [], []
    runner.step = lambda *args: steps.append(1) or type(runner).step(runner, *args)
    try:
        for ev in rounds:
            events.append((ev.token_ids, ev.finish_reason, ev.logprob_rows))
            if close_after is not None and len(events) == close_after:
                rounds.close()
                break
    finally:
        del runner.step
    return events, stats.num_rounds, len(steps)


def _assert_same_events(got, ref):
    assert [e[:2] for e in got] == [e[:2] for e in ref]
    for (_, _, rows), (_, _, ref_rows) in zip(got, ref):
        assert (rows is None) == (ref_rows is None)
        if rows is not None:
            assert torch.equal(rows, ref_rows)


def _assert_same_state(a, b):
    assert a.tokens == b.tokens
    assert a.cache.seq_len == b.cache.seq_len == len(a.tokens)
    # nothing left pending (FastCache: nor its flag of a Triton step)
    assert a.cache.step_tokens == b.cache.step_tokens == 0 and not a.cache.stash
    assert not getattr(a.cache, "fast_step", False)
    assert torch.equal(a.last_logits, b.last_logits) and torch.equal(a.last_hidden, b.last_hidden)
    for cache in (a.cache, b.cache):  # FastCache: the committed states come home from the step buffers
        if hasattr(cache, "materialize"):
            cache.materialize()
    for i in a.cache.conv:
        assert torch.equal(a.cache.conv[i], b.cache.conv[i])
        assert torch.equal(a.cache.recurrent[i], b.cache.recurrent[i])
    n = a.cache.seq_len
    for i in a.cache.kv:
        assert torch.equal(a.cache.kv[i].key[:, :n], b.cache.kv[i].key[:, :n])
        assert torch.equal(a.cache.kv[i].value[:, :n], b.cache.kv[i].value[:, :n])


def _compare(runner, prompt, params, stop_ids=(), max_len=96, close_after=None):
    """Run both loops on fresh states, then a second turn pipelined on one and round by round on
    the other; assert everything equal. Returns the first turn's tokens."""
    states, runs = [], []
    for pipelined in (True, False):
        state = _prefilled(runner, prompt, max_len)
        runs.append(_run(runner, state, params, stop_ids, pipelined, close_after))
        states.append(state)
    (events, num_rounds, steps), (ref_events, ref_rounds, ref_steps) = runs
    _assert_same_events(events, ref_events)
    assert num_rounds == ref_rounds
    _assert_same_state(*states)
    # the one step run for nothing: queued after a stop token or where the consumer closed, when
    # neither the budget nor the context had already ruled it out
    num_tokens = sum(len(e[0]) for e in events)
    room = num_tokens < params.max_tokens and len(prompt) + num_tokens <= max_len
    assert steps - ref_steps == (1 if room and events[-1][1] in ("stop", None) else 0)
    if len(states[0].tokens) + len(SECOND_TURN) + 4 <= max_len:
        turn2 = SamplingParams(max_tokens=4, **GREEDY)
        for state in states:
            runner.extend(state, SECOND_TURN)
        _assert_same_events(_run(runner, states[0], turn2)[0], _run(runner, states[1], turn2, pipelined=False)[0])
        _assert_same_state(*states)
    return [t for e in events for t in e[0]]


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_pipelined_equals_round_by_round(runner, kind):
    sampling = GREEDY if kind == "greedy" else SAMPLED
    for prompt in PROMPTS:
        ref = _compare(runner, prompt, SamplingParams(max_tokens=24, **sampling))
        assert len(ref) == 24
        for budget in (1, 2, 3, 7):
            assert _compare(runner, prompt, SamplingParams(max_tokens=budget, **sampling)) == ref[:budget]
        # stop ids that occur first at several positions (the first token, mid-way, the last)
        for stop in {ref[0], ref[len(ref) // 2], ref[-1]}:
            out = _compare(runner, prompt, SamplingParams(max_tokens=24, **sampling), stop_ids=[stop])
            assert out == ref[: ref.index(stop) + 1]


def test_seeded_sampling_is_sampled(runner):
    """The sampled cases above draw (they differ from greedy) and depend on the seed."""
    prompt = PROMPTS[0]
    greedy = _compare(runner, prompt, SamplingParams(max_tokens=24, **GREEDY))
    sampled = _compare(runner, prompt, SamplingParams(max_tokens=24, **SAMPLED))
    other_seed = _compare(runner, prompt, SamplingParams(max_tokens=24, **{**SAMPLED, "seed": 99}))
    assert sampled != greedy and sampled != other_seed


@pytest.mark.parametrize("room", [0, 1, 2, 5])
def test_context_end(runner, room):
    """The context ends before the budget: the last token is emitted, then an empty "length" event."""
    prompt = PROMPTS[0]
    max_len = len(prompt) + room
    _compare(runner, prompt, SamplingParams(max_tokens=24, **GREEDY), max_len=max_len)
    events = _run(runner, _prefilled(runner, prompt, max_len), SamplingParams(max_tokens=24, **GREEDY))[0]
    assert events[-1][:2] == ([], "length") and len(events) == room + 2


@pytest.mark.parametrize("close_after", [1, 2, 5])
def test_consumer_closing_between_rounds(runner, close_after):
    """A consumer that stops reading (a stop string, a disconnect) leaves the same state, with the
    step queued ahead discarded."""
    _compare(runner, PROMPTS[2], SamplingParams(max_tokens=24, **SAMPLED), close_after=close_after)


def test_run_rounds_pipelines_plain_decoding_only(runner, monkeypatch):
    calls = []
    real = generate.pipelined_rounds
    monkeypatch.setattr(generate, "pipelined_rounds", lambda *a: calls.append(1) or real(*a))
    state = _prefilled(runner, PROMPTS[0])
    spec, stats = SpecConfig(), SpecStats()
    plain = SamplingParams(max_tokens=6, **SAMPLED)
    penalized = SamplingParams(max_tokens=6, repetition_penalty=1.3, **SAMPLED)
    list(generate.run_rounds(runner, None, state, plain, spec, set(), stats))
    assert calls == [1] and stats.num_rounds == 5
    list(generate.run_rounds(runner, None, state, penalized, spec, set(), stats))  # the history lags
    assert calls == [1]
    with pytest.raises(ValueError, match="penalties"):
        TokenSelector(penalized, [1], runner.cfg.vocab_size, runner.device).select(state.last_logits[None], 0)


def test_select_equals_verify_without_drafts(runner):
    state = _prefilled(runner, PROMPTS[0])
    for sampling in (GREEDY, SAMPLED):
        selector = TokenSelector(SamplingParams(max_tokens=8, **sampling), [], runner.cfg.vocab_size, runner.device)
        for i in range(8):
            logits = state.last_logits[None] + i  # [1, V]: a different row per index
            picked = selector.select(logits, i)
            assert picked.shape == (1,) and picked.dtype == torch.long
            no_drafts = torch.zeros(0, dtype=torch.long, device=DEVICE)
            assert picked.tolist() == selector.verify(logits, no_drafts, None)[1]
            selector.record(picked.tolist())


def test_llm_sessions_continue_after_pipelined_turns(dense_ckpt):
    """Multi-turn with kept sessions (K = 0, pipelined, a stop mid-way) equals cold runs."""
    warm = nextn.LLM(model=dense_ckpt, device=DEVICE, num_speculative_tokens=0)
    cold = nextn.LLM(model=dense_ckpt, device=DEVICE, num_speculative_tokens=0)
    params = SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY)
    turn1 = PROMPTS[0]
    ref = cold.generate(prompt_token_ids=turn1, params=params).token_ids
    stopped = SamplingParams(max_tokens=16, stop_token_ids=(ref[6],), **GREEDY)
    reply = warm.generate(prompt_token_ids=turn1, params=stopped, use_sessions=True).token_ids
    assert reply == ref[: ref.index(ref[6]) + 1]
    turn2 = turn1 + reply + SECOND_TURN
    resumed = warm.generate(prompt_token_ids=turn2, params=params, use_sessions=True)
    assert resumed.cached_tokens == len(turn1) + len(reply) - 1  # the stop token was never stepped
    assert resumed.token_ids == cold.generate(prompt_token_ids=turn2, params=params).token_ids


def test_fast_runner_stop_and_second_turn(dense_ckpt):
    """The Triton step (FastCache; CUDA graphs on a GPU): the step queued after a stop is discarded."""
    pytest.importorskip("triton")
    fast = build_engine(load_model(dense_ckpt, device=DEVICE), SpecConfig(), "triton")[0]
    params = SamplingParams(max_tokens=5, **GREEDY)
    events = _run(fast, _prefilled(fast, PROMPTS[0]), params)[0]
    ref = [t for e in events for t in e[0]]
    assert _compare(fast, PROMPTS[0], params, stop_ids=[ref[2]]) == ref[: ref.index(ref[2]) + 1]
