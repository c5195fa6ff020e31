"""Continuous batching: every running request takes part in one batched round per engine step,
and a request's output is bitwise what it is alone, whatever runs beside it: greedy and seeded
sampled, K = 0, 1 or 3, prompts of different lengths admitted at different times, their prompts
riding the running requests' rounds (mixed steps). On the CPU the
reference modules in float32; on a GPU the Triton step in bfloat16, rounds as CUDA graphs."""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import pytest
import torch
from hf_fixtures import FIT_PROMPTS

import nextn
from nextn.cache import StepBatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"

_P = [list(p) for p in FIT_PROMPTS]
_SAMPLED = dict(temperature=0.8, top_k=20)
# (prompt, sampling, K, engine step at which it arrives)
CASES = [
    (_P[0], dict(temperature=0.0), 3, 0),
    (_P[1], dict(_SAMPLED, seed=1), 3, 0),
    (_P[2], dict(temperature=0.0), 0, 1),
    (_P[0][:7], dict(_SAMPLED, seed=2), 1, 2),
    (_P[1] + _P[2], dict(temperature=0.0), 1, 4),
    ([17], dict(_SAMPLED, seed=3), 0, 5),
    (_P[2] + _P[0], dict(temperature=0.0, repetition_penalty=1.3), 3, 7),
    (_P[1][:4], dict(temperature=0.7, top_p=0.9, seed=4), 3, 9),
]


def _engine(ckpt, device: str = DEVICE, dtype: str = DTYPE, **settings):
    """The module's engine (K=3, 8 sequences of 96 tokens), settings overriding or adding to it."""
    settings = dict(num_speculative_tokens=3, max_model_len=96, max_num_seqs=8) | settings
    return nextn.LLM(model=ckpt, device=device, dtype=dtype, **settings).engine


@pytest.fixture(scope="module")
def engine(dense_fitted_ckpt):
    return _engine(dense_fitted_ckpt)


def _run(engine, items: list[tuple[int, int]]) -> dict[int, tuple[list[int], int]]:
    """Run CASES[i] for each (i, arrival step): i -> (tokens, drafts counted)."""
    reqs, outputs, step = {}, {}, 0
    while len(outputs) < len(items):
        for i, arrival in items:
            if arrival <= step and i not in reqs:
                prompt, sampling, k, _ = CASES[i]
                params = nextn.SamplingParams(max_tokens=14 + 2 * i, ignore_eos=True, **sampling)
                reqs[i] = engine.add(prompt, params, num_speculative_tokens=k)
        for req, ev in engine.step():
            if isinstance(ev, BaseException):
                raise ev
            if ev.output is not None:
                i = next(i for i, r in reqs.items() if r is req)
                outputs[i] = (ev.output.token_ids, ev.output.spec.num_drafted)
        step += 1
    return outputs


def test_each_request_equals_itself_alone(engine):
    alone = {i: _run(engine, [(i, 0)])[i] for i in range(len(CASES))}
    engine.batch_sizes.clear()
    mixed = engine.time.mixed_steps
    together = _run(engine, [(i, case[3]) for i, case in enumerate(CASES)])
    for i, case in enumerate(CASES):
        assert alone[i][0] == together[i][0], f"request {i}: batched output differs from its output alone"
        assert (together[i][1] > 0) == (case[2] > 0)  # K per request: plain requests draft nothing
    assert max(engine.batch_sizes) >= 6, engine.batch_sizes  # the requests did share rounds
    # the late prompts rode the running requests' rounds (mixed steps: "chunked" prefill, LLM's default)
    assert engine.config.prefill == "chunked" and engine.time.mixed_steps - mixed >= 4


def _uncached(ckpt, device: str, dtype: str):
    """An engine as the module's, without the prefix cache (a run again of the same prompts then
    prefills them again, in the same pieces: the same round keys)."""
    return _engine(ckpt, device, dtype, enable_prefix_caching=False)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_mixed_rounds_replay_their_graphs(dense_fitted_ckpt):
    """On a GPU the mixed steps' rounds are CUDA graphs too, keyed by the members' Ks (and sampler
    kinds) and the pieces' rows: the same arrivals run a third time (other slots) replay them, and
    every request still emits what it emits alone."""
    engine = _uncached(dense_fitted_ckpt, DEVICE, DTYPE)
    keys: list = []
    run = engine.runner.run
    engine.runner.run = lambda key, fn, *a, **kw: keys.append(key) or run(key, fn, *a, **kw)
    alone = {i: _run(engine, [(i, 0)])[i][0] for i in range(len(CASES))}
    items = [(i, case[3]) for i, case in enumerate(CASES)]
    for _ in range(2):  # a key runs eagerly the first time, is captured the second
        _run(engine, items)
    keys.clear()
    third = _run(engine, items)
    mixed = [key for key in keys if key[0] == "mixed round"]
    replayed = [key for key in mixed if engine.runner.graphs.get(key) is not None]
    assert mixed and replayed, (mixed, engine.runner.graph_counts)
    assert {i: out[0] for i, out in third.items()} == alone


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_steps_wait_for_the_gpu_only_where_they_mean_to(dense_fitted_ckpt):
    """After a warm-up, the engine's steps (requests starting and finishing one by one, mixed steps,
    graphs replayed, sampled members with penalties) make no implicit synchronizing call from nextn:
    torch.cuda.set_sync_debug_mode flags each (a host value copied into a device tensor, a host
    read), not the deliberate waits (a round's read on its copy's event, a prefill pass's end).
    One drains the rounds queued ahead (run 203: a request's finish and start each did so)."""
    engine = _uncached(dense_fitted_ckpt, DEVICE, DTYPE)
    items = [(i, case[3]) for i, case in enumerate(CASES)]
    for _ in range(2):  # keys run eagerly, then are captured
        _run(engine, items)
    root, flagged = str(Path(nextn.__file__).parent), []

    def record(message, category, filename, lineno, file=None, line=None):
        ours = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack() if f.filename.startswith(root)]
        if ours:
            flagged.append(ours[-1])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _run(engine, items)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert flagged == []


class _FakeGraph:
    """A stand-in for torch.cuda.CUDAGraph on the CPU: its capture runs the work (the real one
    records it, then the first replay runs it), its replays run nothing (`_graphed`)."""

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        pass


def _graphed(engine, monkeypatch) -> list:
    """The engine's runner taking its graph paths on the CPU (runner.run's keys: eager first run,
    capture, replays), each replay standing in for by running the work eagerly; returns the list
    of what was made during a capture (none may be: a capture must read only what the key's
    first run made, or a GPU copies host values into it while capturing, which fails)."""
    runner, made = engine.runner, []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(runner, "_capture", lambda graph, fn: fn())
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    made_once, run = runner._made_once, runner.run

    def watched(table, key, make):
        new = key not in table and not (runner._mixing and (id(table), key) in runner._mixed_made)
        if new and runner._capturing is not None:
            made.append(key)
        return made_once(table, key, make)

    def replaying(key, fn, *a, **kw):
        replay = runner.graphs.get(key) is not None
        run(key, fn, *a, **kw)
        if replay:  # (the fake replay ran nothing)
            fn()

    monkeypatch.setattr(runner, "_made_once", watched)
    monkeypatch.setattr(runner, "run", replaying)
    runner.use_graphs = True
    return made


def test_mixed_rounds_capture_only_what_their_first_run_made(dense_fitted_ckpt, monkeypatch):
    """A mixed step's round is keyed by its pieces' rows too: run a second time it is captured,
    and its capture must find every index and batch its first run made (what its runs make is
    kept apart from the rounds' tables: nextn.engine.runner._made_once). On the CPU with the
    graph paths taken (`_graphed`): the same arrivals three times capture mixed rounds, nothing
    is made while capturing, and every request still emits what it emits alone."""
    engine = _uncached(dense_fitted_ckpt, "cpu", "float32")
    alone = {i: _run(engine, [(i, 0)])[i][0] for i in range(len(CASES))}
    made = _graphed(engine, monkeypatch)
    items = [(i, case[3]) for i, case in enumerate(CASES)]
    runs = [_run(engine, items) for _ in range(3)]
    captured = [key for key, graph in engine.runner.graphs.items() if key[0] == "mixed round" and graph is not None]
    assert captured and engine.runner.graph_counts["captures"] > len(captured)  # (plain rounds' too)
    assert made == [], made
    for outputs in runs:
        assert {i: out[0] for i, out in outputs.items()} == alone


@pytest.mark.parametrize("max_num_seqs", [4, 3])
def test_a_mixed_rounds_graph_serves_any_split_of_its_pieces(dense_fitted_ckpt, monkeypatch, max_num_seqs):
    """A chunked mixed step's round is keyed by its pieces' count, total rows and chunks, not their split
    (StepBatch.sizes), and a pad piece on a slot no request holds fills their rows to a bucket
    (rounds._pad_piece; with 3 request slots the stream and a pair hold them all, so the pad takes the
    pool's scratch slot, nextn.config.SCRATCH_SLOTS):
    pairs of prompts of 40 + 64, 50 + 54, 44 + 60 and 30 + 70 tokens riding one running request's rounds
    are one key (3 pieces, 128 rows, 4 chunks), run eagerly, captured and replayed, each split written
    into the graph's tensors before it runs (StepBatch.resplit, whose device tensors tests/test_cache.py
    checks; on the CPU the graph paths taken with a replay re-running the work, `_graphed`); every
    request emits what it emits alone."""
    engine = _engine(dense_fitted_ckpt, max_num_batched_tokens=140, max_num_seqs=max_num_seqs,
                     enable_prefix_caching=False, max_model_len=128)  # fmt: skip
    stream = ((_P[0] + _P[1] + _P[2]) * 4)[:20]
    pairs = [[((_P[0] + _P[2]) * 8)[d : d + n] for d, n in zip((0, 3), split, strict=True)]
             for split in ((40, 64), (50, 54), (44, 60), (30, 70))]  # fmt: skip
    long = nextn.SamplingParams(max_tokens=72, ignore_eos=True, temperature=0.0)
    short = nextn.SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)

    def alone(prompt, params):
        return engine_output(engine, prompt, dict(temperature=0.0), 3, params.max_tokens, ignore_eos=True)

    expected = [alone(stream, long)] + [alone(p, short) for pair in pairs for p in pair]
    made = _graphed(engine, monkeypatch) if DEVICE == "cpu" else []
    engine.runner.pad_rounds = True  # (on with graphs)
    splits: dict = {}
    resplit = engine.runner.resplit

    def watched(caches, rows, pieces_from, chunked, chunks=None):
        key = StepBatch.sizes(rows, pieces_from, chunked, chunks)
        splits.setdefault(key, set()).add(tuple(rows[pieces_from:]))
        resplit(caches, rows, pieces_from, chunked, chunks)

    monkeypatch.setattr(engine.runner, "resplit", watched)
    reqs, outputs, arrived, n = [engine.add(stream, long, num_speculative_tokens=3)], {}, 0, 1 + 2 * len(pairs)
    while len(outputs) < n:
        for req, ev in engine.step():
            if isinstance(ev, BaseException):
                raise ev
            if ev.output is not None:
                outputs[reqs.index(req)] = ev.output.token_ids
        if arrived < len(pairs) and all(i in outputs for i in range(1, len(reqs))):  # a pair at a time
            reqs += [engine.add(p, short, num_speculative_tokens=3) for p in pairs[arrived]]
            arrived += 1
        assert 0 not in outputs or len(outputs) == n, "the stream ended before every pair rode it"
    assert [outputs[i] for i in range(n)] == expected
    shared = [key for key, seen in splits.items() if len(seen) == len(pairs)]
    assert shared and shared[0][-1] == ("pieces", 3, 128, 4), splits  # the four splits and their pads: one key
    counts = engine.runner.graph_counts
    assert counts["captures"] and counts["replays"], counts
    assert made == [], made


def test_a_request_asking_for_more_drafts_than_the_engine_is_refused(engine):
    with pytest.raises(ValueError, match="num_speculative_tokens=4"):
        engine.add([1, 2], nextn.SamplingParams(max_tokens=2), num_speculative_tokens=4)


def test_a_long_prompt_is_prefilled_over_steps_while_a_stream_runs(dense_fitted_ckpt):
    """With a small token budget a long prompt is prefilled a chunk per step (a whole chunk of the
    chunked delta rule, 64 tokens, where the budget leaves fewer); the running stream gets a round
    every step meanwhile; both outputs equal their outputs alone, bitwise: the prompt's and the
    tokens' logprobs too (a prompt asking for prompt logprobs prefills apart from the rounds)."""
    engine = _engine(dense_fitted_ckpt, max_model_len=192, max_num_seqs=2, max_num_batched_tokens=32)
    short, long = _P[1], (_P[0] + _P[1] + _P[2]) * 4 + _P[0]  # 11 and 158 tokens
    params = nextn.SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0, logprobs=2, prompt_logprobs=2)

    def result(out):
        return out.token_ids, out.logprobs, out.prompt_logprobs

    def alone(prompt):
        req = engine.add(prompt, params)
        while True:
            for r, ev in engine.step():
                if r is req and ev.output is not None:
                    return result(ev.output)

    expected = [alone(short), alone(long)]
    stream = engine.add(short, params)
    outputs: dict = {}
    while not engine.live:  # the stream is running
        engine.step()
    late = engine.add(long, params)
    prefill_steps = 0
    while len(outputs) < 2:
        prefilling = late.request_id in engine.prefilling or late in engine.scheduler.waiting
        events = engine.step()
        stream_events = [ev for r, ev in events if r is stream]
        if prefilling and stream.request_id not in outputs:
            prefill_steps += 1
            assert stream_events, "the stream stalled while a prompt was prefilled"
        for r, ev in events:
            if ev.output is not None:
                outputs[r.request_id] = result(ev.output)
    assert prefill_steps >= 3  # 158 tokens in chunks of 64, one a step (the budget leaves 28)
    assert [outputs[stream.request_id], outputs[late.request_id]] == expected


def test_min_tokens_bans_stop_tokens_until_reached(engine):
    """min_tokens: a stop token plain greedy emits early is not taken before min_tokens tokens,
    on both sides of speculation (spec == plain under the ban)."""
    prompt = _P[0]
    free = engine_output(engine, prompt, dict(temperature=0.0), k=0, max_tokens=24)
    stop = free[2]  # plain greedy emits it third
    outs = []
    for k in (0, 3):
        params = dict(temperature=0.0, min_tokens=10)
        outs.append(engine_output(engine, prompt, params, k=k, max_tokens=24, stop_token_ids=[stop]))
    assert outs[0] == outs[1]
    assert len(outs[0]) > 10 and stop not in outs[0][:10]
    assert outs[0][:2] == free[:2]  # the ban changes nothing before the stop token's first chance


def engine_output(engine, prompt, sampling, k, max_tokens, whole=False, **kw):
    """The request's token ids (whole: its RequestOutput)."""
    params = nextn.SamplingParams(max_tokens=max_tokens, **sampling, **kw)
    req = engine.add(prompt, params, num_speculative_tokens=k)
    while True:
        for r, ev in engine.step():
            if isinstance(ev, BaseException):
                raise ev
            if r is req and ev.output is not None:
                return ev.output if whole else ev.output.token_ids


def test_ignore_eos_keeps_the_stop_token_ids(engine):
    """ignore_eos ignores EOS alone (vLLM's): a request's stop_token_ids still end it (they were
    dropped with EOS), at K = 0 and 3 alike."""
    free = engine_output(engine, _P[0], dict(temperature=0.0), k=0, max_tokens=24, ignore_eos=True)
    stop = free[5]
    expected = free[: free.index(stop) + 1]
    for k in (0, 3):
        kw = dict(ignore_eos=True, stop_token_ids=[stop])
        assert engine_output(engine, _P[0], dict(temperature=0.0), k=k, max_tokens=24, **kw) == expected


def test_min_tokens_holds_stop_strings_back(engine):
    """min_tokens: a stop string is looked for from the min_tokens-th token on (vLLM's); one that
    ends in the text of the first min_tokens - 1 tokens does not end the request (it did)."""
    tok = engine.tokenizer
    free = engine_output(engine, _P[1], dict(temperature=0.0), k=0, max_tokens=32, ignore_eos=True)
    text = tok.decode(free)
    stop = tok.decode(free[:3])[len(tok.decode(free[:1])) :]  # the text of tokens 2 and 3
    assert stop and text.find(stop) < len(tok.decode(free[:3]))  # a hit without min_tokens
    floor = len(tok.decode(free[:9]))  # min_tokens 10
    later = text.find(stop, 0)
    while 0 <= later and later + len(stop) <= floor:
        later = text.find(stop, later + 1)
    expected = text if later < 0 else text[:later]
    for k in (0, 3):
        kw = dict(ignore_eos=True, stop=[stop], min_tokens=10)
        out = engine_output(engine, _P[1], dict(temperature=0.0), k=k, max_tokens=32, whole=True, **kw)
        assert out.text == expected and len(out.token_ids) >= 10


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(engine):
    """SamplingParams.include_stop_str_in_output (vLLM's): the text runs through the stop string, its
    tokens those the text without it keeps; streamed deltas add up to it, at K = 0 and 3 alike."""
    tok = engine.tokenizer
    free = engine_output(engine, _P[1], dict(temperature=0.0), k=0, max_tokens=32, ignore_eos=True)
    text = tok.decode(free)
    stop = text[len(tok.decode(free[:4])) :][:3]
    assert stop.strip()
    for k in (0, 3):
        kw = dict(ignore_eos=True, stop=[stop], temperature=0.0)
        cut = engine_output(engine, _P[1], kw, k=k, max_tokens=32, whole=True)
        params = nextn.SamplingParams(max_tokens=32, include_stop_str_in_output=True, **kw)
        req, deltas = engine.add(_P[1], params, num_speculative_tokens=k), []
        while not deltas or deltas[-1].output is None:
            deltas += [ev for r, ev in engine.step() if r is req]
        kept = deltas[-1].output
        assert cut.text == text[: text.find(stop)] and kept.text == cut.text + stop
        assert kept.token_ids == cut.token_ids and "".join(ev.text for ev in deltas) == kept.text


def test_stop_reason_names_what_ended_the_output(engine):
    """vLLM's stop_reason: the stop string, or the request's stop token id, that ended the output;
    None at max_tokens."""
    tok = engine.tokenizer
    greedy = dict(temperature=0.0)
    free = engine_output(engine, _P[0], greedy, k=3, max_tokens=24, ignore_eos=True, whole=True)
    assert free.finish_reason == "length" and free.stop_reason is None
    by_id = engine_output(engine, _P[0], greedy, k=3, max_tokens=24, ignore_eos=True, whole=True,
                          stop_token_ids=[free.token_ids[5]])  # fmt: skip
    assert by_id.stop_reason == free.token_ids[5] == by_id.outputs[0].stop_reason
    stop = tok.decode(free.token_ids)[len(tok.decode(free.token_ids[:6])) :][:2]
    by_text = engine_output(engine, _P[0], greedy, k=3, max_tokens=24, ignore_eos=True, whole=True,
                            stop=["\x00never", stop])  # fmt: skip
    assert by_text.finish_reason == "stop" and by_text.stop_reason == stop


def test_a_stop_string_ending_in_a_split_character_keeps_that_character():
    """The tokens kept for a stop string's text cover its last character whole: a character split
    over tokens decodes to "\ufffd" until its last byte, which counted as reaching it."""
    from nextn.config import DEFAULT_MODEL_DIR
    from nextn.engine.detokenizer import Detokenizer
    from nextn.tokenizer import Tokenizer

    tok = Tokenizer(DEFAULT_MODEL_DIR)
    ids = tok.encode("naïve café au lait")
    assert "\ufffd" in "".join(tok.decode(ids[:n]) for n in range(len(ids)))  # "é" spans tokens
    n = Detokenizer(tok, nextn.SamplingParams())._covering(ids, len("naïve café"))
    assert tok.decode(ids[:n]).startswith("naïve café")


def test_prompt_ids_from_numpy_or_torch_are_token_ids(dense_ckpt):
    """Ids of an array (numpy's or torch's integers) were refused as "out of range [0, V)" although
    in range, and a list holding an array failed numpy's broadcast of `p == []`; they run as the same
    Python ints, and what is not an integer is named as such."""
    import numpy as np

    llm = nextn.LLM(model=dense_ckpt, num_speculative_tokens=2, max_model_len=32, max_num_seqs=2)
    params = nextn.SamplingParams(max_tokens=4, temperature=0)
    ref = llm.generate(prompt_token_ids=[5, 6, 7], params=params).token_ids
    for ids in (np.array([5, 6, 7]), [np.int64(5), np.int32(6), 7], torch.tensor([5, 6, 7])):
        assert llm.generate(prompt_token_ids=ids, params=params).token_ids == ref
    assert llm.generate([[np.int64(5), 6, 7]], params)[0].token_ids == ref
    with pytest.raises(nextn.RequestError, match="must be integers, got \\[True\\]"):
        llm.generate(prompt_token_ids=[True, 6], params=params)
    with pytest.raises(nextn.RequestError, match="a str or a list of token ids, got ndarray"):
        llm.generate([np.array([5, 6, 7])], params)


def test_a_request_failing_mid_output_fails_alone(engine, monkeypatch):
    """A grammar llguidance fails on once its first token is consumed (a RequestError read with its
    round) failed every request of its batch; the others now run on, as they run alone. (The limits
    refuse this regex up front: lifted here, to reach the engine's own guard.)"""
    monkeypatch.setattr(nextn.grammar.limits, "MAX_REPEAT_PRODUCT", 10**7)
    bad = nextn.SamplingParams(max_tokens=6, temperature=0, structured_outputs={"regex": "a{1000}{1000}"})
    free = [(_P[0], dict(temperature=0.0)), (_P[1], dict(_SAMPLED, seed=5))]
    alone = [engine_output(engine, p, sampling, k=3, max_tokens=12, ignore_eos=True) for p, sampling in free]
    params = [nextn.SamplingParams(max_tokens=12, ignore_eos=True, **sampling) for _, sampling in free]
    reqs = [engine.add(free[0][0], params[0]), engine.add(_P[2], bad), engine.add(free[1][0], params[1])]
    results = {}
    while len(results) < 3:
        for req, ev in engine.step():
            if isinstance(ev, BaseException) or ev.output is not None:
                results[req.request_id] = ev
    assert isinstance(results[reqs[1].request_id], nextn.RequestError)
    assert [results[r.request_id].output.token_ids for r in (reqs[0], reqs[2])] == alone
    assert not engine.has_work and len(engine.scheduler.free) == engine.scheduler.num_slots


def test_a_request_whose_host_work_fails_fails_alone(engine):
    """A request's own host work after its round (decoding, stop strings, logprobs) raising went out
    of the engine's step and failed every request beside it; it now ends that request alone (its
    slot back), and the others run on as they run alone."""
    free = [(_P[0], dict(temperature=0.0)), (_P[1], dict(_SAMPLED, seed=5))]
    alone = [engine_output(engine, p, sampling, k=3, max_tokens=12, ignore_eos=True) for p, sampling in free]
    params = [nextn.SamplingParams(max_tokens=12, ignore_eos=True, **sampling) for _, sampling in free]
    reqs = [engine.add(free[0][0], params[0]), engine.add(_P[2], params[0]), engine.add(free[1][0], params[1])]
    results = {}
    while reqs[1].request_id not in engine.live:
        for _, ev in engine.step():
            assert ev.output is None
    engine.live[reqs[1].request_id].detok.decoder.push = lambda ids: 1 / 0  # its next round's decode fails
    while len(results) < 3:
        for req, ev in engine.step():
            if isinstance(ev, BaseException) or ev.output is not None:
                results[req.request_id] = ev
    assert isinstance(results[reqs[1].request_id], ZeroDivisionError)
    assert [results[r.request_id].output.token_ids for r in (reqs[0], reqs[2])] == alone
    assert not engine.has_work and len(engine.scheduler.free) == engine.scheduler.num_slots


def test_open_streams_and_generate_interleave(engine, monkeypatch):
    """Each LLM loop stepped the engine for its own request and dropped the events of the others: a
    stream left open across a generate (or another stream) never got its output and stepped an idle
    engine forever. Now every request's events wait for their reader; each equals its output alone."""
    llm = nextn.LLM.of_engine(engine)  # the module's engine, through the API's loops
    params = [nextn.SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True, temperature=0.0) for i in range(3)]
    alone = [llm.generate(prompt_token_ids=_P[i], params=params[i]).token_ids for i in range(3)]
    step = engine.step

    def guarded():
        assert engine.has_work, "stepped an idle engine: a request's events were lost"
        return step()

    monkeypatch.setattr(engine, "step", guarded)
    first, second = llm.stream(_P[0], params[0]), llm.stream(_P[1], params[1])
    head = [next(first), next(second), next(first)]
    third = llm.generate([_P[2]], params[2])[0]  # runs the open streams' rounds too
    streamed = [head[0::2] + list(first), head[1:2] + list(second)]
    assert [sum((ev.token_ids for ev in evs), []) for evs in streamed] + [third.token_ids] == alone
    assert [evs[-1].output.token_ids for evs in streamed] == alone[:2]
    assert not llm._boxes and not engine.has_work


def test_a_stream_dropped_before_its_first_event_frees_its_slot(engine):
    """LLM.stream queues its request at once; a stream dropped unread never ran its cleanup, so the
    request kept a slot, ran beside later requests and piled its events up. The next step aborts it."""
    import gc

    llm = nextn.LLM.of_engine(engine)
    params = nextn.SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
    alone = llm.generate(prompt_token_ids=_P[1], params=params).token_ids
    dropped = llm.stream(_P[0], params)
    del dropped
    gc.collect()
    assert llm.generate(prompt_token_ids=_P[1], params=params).token_ids == alone
    assert not llm._boxes and not engine.has_work
    assert len(engine.scheduler.free) == engine.scheduler.num_slots
