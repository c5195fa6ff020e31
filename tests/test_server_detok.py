"""Detokenizing and stop strings in the API process (nextn.server.outputs over
nextn.engine.detokenizer): the engine core sends token ids only, and a stop string found in the API
ends the request in the core (AbortRequest with the tokens kept; Engine.stop).

Every served request equals the same request through `LLM` alone (cold, no sessions): its events'
token ids and text deltas, text, finish and stop reasons, logprobs and spec counts (greedy and
seeded; stop strings spanning tokens and spanning rounds of several tokens, kept or not;
min_tokens), with the core on a thread of this process (where the API's stop reaches the core
before its next step) and in a process of its own (where the core runs on past the stop). A
session continuing the cut text equals a cold run either way. The tiny dense checkpoint with its
MTP head fitted (hf_fixtures.FIT_PROMPTS: drafts are accepted, so rounds carry several tokens), in
prefill "steps" (resumed == cold bitwise).
"""

from __future__ import annotations

import asyncio
import os

import hf_fixtures
import pytest

from nextn import LLM, SamplingParams
from nextn.config.engine_args import EngineArgs
from nextn.engine.core import AbortRequest, RequestEvent
from nextn.server.core_client import CoreProcess
from nextn.server.metrics import Metrics
from nextn.server.worker import EngineWorker, Job, ThreadCore

ARGS = dict(max_model_len=512, prefill="steps")
PROMPTS = [list(p) for p in hf_fixtures.FIT_PROMPTS]


@pytest.fixture(scope="module")
def cold(dense_fitted_ckpt) -> LLM:
    return LLM(model=dense_fitted_ckpt, **ARGS)


def start(core) -> EngineWorker:
    worker = EngineWorker(core, 16, Metrics(core.model.num_speculative_tokens))
    worker.start()
    return worker


@pytest.fixture(scope="module")
def thread_worker(dense_fitted_ckpt):
    worker = start(ThreadCore(LLM(model=dense_fitted_ckpt, **ARGS)))
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def process_worker(dense_fitted_ckpt):
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned child reads it when it imports torch
    try:
        core = CoreProcess.launch(EngineArgs.of(model=str(dense_fitted_ckpt), **ARGS), "warning")
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
    worker = start(core)
    yield worker
    worker.stop()


@pytest.fixture(params=["thread", "process"])
def worker(request) -> EngineWorker:
    return request.getfixturevalue(f"{request.param}_worker")


def served(worker: EngineWorker, ids: list[int], params: SamplingParams):
    """(each event's (token ids, text), the output) of a job through the worker and its core."""

    async def run():
        job = Job(list(ids), params, asyncio.get_running_loop())
        worker.submit(job)
        return [ev async for ev in job.events()]

    events = asyncio.run(asyncio.wait_for(run(), 120))
    return [(ev.token_ids, ev.text) for ev in events], events[-1].output


def alone(llm: LLM, ids: list[int], params: SamplingParams):
    events = list(llm.stream(list(ids), params))
    return [(ev.token_ids, ev.text) for ev in events], events[-1].output


def fields(out) -> tuple:
    # (top_logprobs pairs cross the process boundary as msgpack arrays: lists, not tuples)
    logprobs = out.logprobs and [dict(e, top_logprobs=[list(t) for t in e["top_logprobs"]]) for e in out.logprobs]
    return (out.token_ids, out.text, out.finish_reason, out.stop_reason, logprobs, out.spec, out.prompt_tokens)


def token_boundaries(llm: LLM, events) -> tuple[str, list[int], set[int]]:
    """The full text, the text length after each token, and those that end a round."""
    ids, ends, rounds = [], [], set()
    for round_ids, _ in events:
        for t in round_ids:
            ids.append(t)
            ends.append(len(llm.tokenizer.decode(ids).rstrip("\ufffd")))
        rounds.add(ends[-1])
    return llm.tokenizer.decode(ids), ends, rounds


def stop_across(text: str, ends: list[int], wanted) -> str | None:
    """A 2-character stop string whose first occurrence straddles a token boundary `wanted` accepts."""
    for p in ends:
        s = text[p - 1 : p + 1]
        if 4 <= p < len(text) - 1 and s.strip() and "\ufffd" not in s and text.find(s) == p - 1 and wanted(p):
            return s
    return None


def cases(cold: LLM) -> tuple[list[tuple[list[int], SamplingParams]], int, int]:
    """Greedy and seeded requests, with stop strings spanning tokens inside a round and across
    rounds; and how many of each kind of stop string were found."""
    out, num_across, num_inside = [], 0, 0
    for prompt, sampling in ((PROMPTS[0], {}), (PROMPTS[1], {}), (PROMPTS[2], dict(temperature=0.8, seed=7))):
        base = dict(max_tokens=32, ignore_eos=True, logprobs=1, temperature=0.0) | sampling
        events, _ = alone(cold, prompt, SamplingParams(**base))
        text, ends, round_ends = token_boundaries(cold, events)
        out.append((prompt, SamplingParams(**base)))
        across = stop_across(text, ends, round_ends.__contains__)
        inside = stop_across(text, ends, lambda p, r=round_ends: p not in r)
        num_across, num_inside = num_across + (across is not None), num_inside + (inside is not None)
        for stop in filter(None, (across, inside)):
            for keep in (False, True):
                out.append((prompt, SamplingParams(**base, stop=[stop], include_stop_str_in_output=keep)))
        if across is not None:  # min_tokens past the first occurrence: a later one (or none) ends it
            first = next(i for i, e in enumerate(ends) if e > text.find(across) + 1)
            out.append((prompt, SamplingParams(**base, stop=[across, "\x00never"], min_tokens=first + 2)))
    return out, num_across, num_inside


def test_served_requests_equal_llm_alone(worker, cold):
    todo, num_across, num_inside = cases(cold)
    assert num_across >= 2 and num_inside >= 1  # (a stop string inside a round: one of several tokens)
    multi, reasons = 0, set()
    for prompt, params in todo:
        ref_events, ref = alone(cold, prompt, params)
        events, out = served(worker, prompt, params)
        assert events == ref_events, params
        assert fields(out) == fields(ref), params
        multi += max(len(ids) for ids, _ in ref_events) > 1
        reasons.add((ref.finish_reason, ref.stop_reason is not None))
    assert multi >= len(todo) - 2  # rounds of several tokens (the head's drafts accepted)
    assert {("stop", True), ("length", False)} <= reasons


def record_core(worker: EngineWorker, monkeypatch) -> tuple[list, list]:
    """What the API sends the core and the core's events, as they cross."""
    sent, events = [], []
    send = worker.core.send
    monkeypatch.setattr(worker.core, "send", lambda msg: (sent.append(msg), send(msg))[1])
    if isinstance(worker.core, ThreadCore):  # its loop holds the worker's on_outputs: the loop body's calls
        core = worker.core.core
        for name in ("apply", "step"):
            monkeypatch.setattr(core, name, recorded(getattr(core, name), events))
    else:
        on_outputs = worker.on_outputs
        monkeypatch.setattr(worker, "on_outputs", lambda out: (events.extend(out.events), on_outputs(out))[1])
    return sent, events


def recorded(method, into: list):
    def call(*args):
        out = method(*args)
        into.extend(out)
        return out

    return call


def stopped_early(cold: LLM, prompt: list[int]) -> tuple[SamplingParams, str]:
    """A long greedy request and a stop string its text reaches within a few rounds."""
    events, _ = alone(cold, prompt, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))
    text, ends, _ = token_boundaries(cold, events)
    stop = stop_across(text, ends, lambda p: True)
    return SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.0, stop=[stop]), stop


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_stop_string_ends_the_request_in_the_core_and_sessions_stay_exact(kind, cold, request, monkeypatch):
    """The core sends token ids and no text (its outputs' text is empty, and the engine's
    detokenizer is never built for a served request); the API's stop string comes back to the core
    as an abort with the tokens kept, and the core ends the request there (its output: those
    tokens; far short of max_tokens). The next turn, extending the cut text, equals a cold run."""
    worker = request.getfixturevalue(f"{kind}_worker")
    prompt = PROMPTS[0]
    params, stop = stopped_early(cold, prompt)
    ref = cold.generate(prompt, params)
    turn2 = prompt + ref.token_ids + [5, 9, 11]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    ref2 = cold.generate(turn2, greedy)
    sent, events = record_core(worker, monkeypatch)

    def refused(*a, **k):
        raise AssertionError("the engine core detokenized a served request")

    if kind == "thread":  # (the process core's engine is out of reach: its events show it)
        monkeypatch.setattr("nextn.engine.engine.Detokenizer", refused)
    _, out = served(worker, prompt, params)
    assert fields(out) == fields(ref) and out.finish_reason == "stop" and out.stop_reason == stop
    assert "text" not in RequestEvent.__struct_fields__
    assert all(ev.output is None or ev.output.text == "" for ev in events)
    stops = [msg for msg in sent if isinstance(msg, AbortRequest)]
    assert [msg.num_tokens for msg in stops] == [len(ref.token_ids)]
    (last,) = [ev for ev in events if ev.request_id == stops[0].request_id and ev.output is not None]
    assert last.output.token_ids == ref.token_ids  # the core ended it at the stop string
    ran = sum(len(ev.token_ids) for ev in events if ev.request_id == stops[0].request_id)
    assert ran < params.max_tokens // 2
    if kind == "thread":  # the abort reached the core before its next step: not a round more
        assert ran < len(ref.token_ids) + cold.num_speculative_tokens + 1
    if kind == "thread":  # the abort came before the core's next step: its slot holds exactly the cut text
        (seq,) = [s for s in worker.core.core.engine.scheduler.sessions.values() if s.tokens[: len(prompt)] == prompt]
        assert seq.tokens == prompt + ref.token_ids[:-1]

    _, resumed = served(worker, turn2, greedy)
    assert fields(resumed) == fields(ref2)
    assert resumed.cached_tokens >= len(prompt)
