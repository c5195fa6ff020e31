"""Rounds are CUDA graphs keyed by the batch's size and Ks (and sampler kinds, for rounds not all
plain greedy), not by which slots run: the slots are device values the graph reads
(nextn.cache.StepBatch.follow; a sampled member's work on copies gathered at its slot:
nextn.engine.device_round.Lane), so once a batch size was seen, a batch of other slots replays its graph.
On the CPU, the same keyed batches run eagerly: their slot tensors follow the requests whatever
slots they hold."""

from __future__ import annotations

import pytest
import torch
import triton_interp  # noqa: F401  (before triton: the Triton test runs under the interpreter on CPU)

import nextn
from nextn.config import SCRATCH_SLOTS

CUDA = torch.cuda.is_available()
PROMPTS = [[5, 9, 40, 7], [11, 3, 2, 8, 90], [4, 4, 61]]


def _run(engine, prompts, params):
    """Outputs of the prompts run together (params: one for all, or a list, one each), and the
    slots they ran in."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [engine.add(p, q) for p, q in zip(prompts, each, strict=True)]
    outputs = {}
    while len(outputs) < len(reqs):
        for r, ev in engine.step():
            if ev.output is not None:
                outputs[r.request_id] = ev.output.token_ids
    return [outputs[r.request_id] for r in reqs], {r.seq.slot for r in reqs}


def _check(device: str, dtype: str):
    """The same batch three times (freed slots go to the back of the free list, so the runs change
    slots): every run equals the requests alone. A round key seen once is captured the second time
    it is seen, so after two runs every key of the batch has its graph. Returns the graph counts
    before and after the third run."""
    params = nextn.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm = nextn.LLM(device=device, dtype=dtype, num_speculative_tokens=3, max_num_seqs=6)
    engine = llm.engine
    alone = [_run(engine, [p], params)[0][0] for p in PROMPTS]
    first, _ = _run(engine, PROMPTS, params)
    second, slots = _run(engine, PROMPTS, params)
    counts = dict(engine.runner.graph_counts)
    third, other_slots = _run(engine, PROMPTS, params)
    assert first == second == third == alone
    assert slots != other_slots, (slots, other_slots)
    return counts, dict(engine.runner.graph_counts)


def _sampled(max_tokens: int = 16) -> list[nextn.SamplingParams]:
    """Seeded sampled requests (temperature, top_p, a penalty) and a greedy one with a penalty."""
    common = dict(max_tokens=max_tokens, ignore_eos=True)
    return [
        nextn.SamplingParams(temperature=0.8, top_p=0.9, seed=7, **common),
        nextn.SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.3, seed=11, **common),
        nextn.SamplingParams(temperature=0.0, presence_penalty=0.7, **common),
    ]


def _check_sampled(device: str, dtype: str, max_tokens: int = 16, **options):
    """`_check` for `_sampled` requests: the batch three times in rotating slots equals each alone;
    returns the graph counts before and after the third run, and the round keys each run launched."""
    params = _sampled(max_tokens)
    llm = nextn.LLM(device=device, dtype=dtype, num_speculative_tokens=3, max_num_seqs=6, **options)
    engine = llm.engine
    keys: list = []  # the keys runner.run is called with, the current run's
    run = engine.runner.run
    engine.runner.run = lambda key, fn, *a, **kw: keys.append(key) or run(key, fn, *a, **kw)
    alone = [_run(engine, [p], [q])[0][0] for p, q in zip(PROMPTS, params, strict=True)]
    seen = []
    for _ in range(2):
        keys.clear()
        out, slots = _run(engine, PROMPTS, params)
        seen.append((out, slots, set(keys)))
    counts = dict(engine.runner.graph_counts)
    keys.clear()
    third, other_slots = _run(engine, PROMPTS, params)
    assert seen[0][0] == seen[1][0] == third == alone
    assert seen[1][1] != other_slots, (seen[1][1], other_slots)
    return counts, dict(engine.runner.graph_counts), [s[2] for s in seen] + [set(keys)]


def test_sampled_rounds_are_keyed_without_their_slots():
    """Seeded sampled requests (and greedy with a penalty) batched in rotating slots emit what they
    emit alone, and their rounds' keys name sizes, Ks and sampler kinds, not slots: a run in other
    slots launches the same keys (so on a GPU it replays their graphs)."""
    _, _, keys = _check_sampled("cpu", "float32")
    assert any(key[0] == "round" for key in keys[1])  # rounds that are not plain greedy ran
    assert keys[1] == keys[2], keys[1] ^ keys[2]


def test_sampled_rounds_follow_their_slots_with_the_triton_kernels(dense_ckpt):
    """The same under the Triton kernels (the interpreter on the CPU; a tiny checkpoint): the lanes'
    uniforms window is what the fused draft and verify read."""
    _, _, keys = _check_sampled("cpu", "float32", 5, model=dense_ckpt, kernels="triton", max_model_len=64)
    assert keys[1] == keys[2], keys[1] ^ keys[2]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_new_sampled_batch_composition_replays_a_graph():
    """On a GPU, seeded sampled requests run again in other slots capture nothing and run nothing
    eagerly: their rounds replay the graphs keyed by sizes, Ks and sampler kinds."""
    before, after, _ = _check_sampled("cuda", "bfloat16")
    assert after["captures"] == before["captures"] and after["eager"] == before["eager"], (before, after)
    assert after["replays"] > before["replays"]


def test_keyed_batches_follow_their_slots_on_the_cpu():
    """Eager (CPU): a batch in other slots emits what the requests emit alone; every round ran eagerly."""
    before, after = _check("cpu", "float32")
    assert after["captures"] == before["captures"] == 0 and after["eager"] > before["eager"]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_new_batch_composition_replays_a_graph():
    """On a GPU, a batch whose round keys (sizes and Ks) have graphs, run again in other slots than
    the run before, captures nothing and runs nothing eagerly: its rounds replay the graphs of their
    sizes, and emit what they emit alone."""
    before, after = _check("cuda", "bfloat16")
    assert after["captures"] == before["captures"] and after["eager"] == before["eager"], (before, after)
    assert after["replays"] > before["replays"]


def test_pad_members_change_nothing():
    """Rounds padded to their size bucket with members on spare slots (on by default with graphs;
    here on the CPU, forced): three requests run as a batch of four, and each emits what it emits
    alone, greedy and with drafts accepted in different numbers; a pad's slot then serves a request."""
    params = nextn.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm = nextn.LLM(device="cpu", num_speculative_tokens=3, max_num_seqs=6)
    engine = llm.engine
    alone = [_run(engine, [p], params)[0][0] for p in PROMPTS + [[9, 9, 1, 4]]]
    engine.runner.pad_rounds = True
    together, _ = _run(engine, PROMPTS, params)
    assert 4 in engine.runner._slot_sets and 3 not in engine.runner._slot_sets  # padded: one graph size for 3
    assert together == alone[:3]
    # every slot has run as a pad or a request by now: a request in any of them is still itself
    assert _run(engine, PROMPTS + [[9, 9, 1, 4]], params)[0] == alone
    # a kept session's slot serves as a pad and keeps its sequence: its next turn equals a cold run
    first = engine.add([3, 14, 15, 92], params, use_sessions=True)
    turn = None
    while turn is None:
        turn = next((ev.output for r, ev in engine.step() if r is first and ev.output is not None), None)
    session = first.seq.slot
    assert session in engine.scheduler.sessions
    _, slots = _run(engine, PROMPTS, params)  # three requests, padded to four: the spare slots include it
    follow = [3, 14, 15, 92] + turn.token_ids + [7, 7]
    cold_ids = _run(engine, [follow], params)[0][0]
    warm = engine.add(follow, params, use_sessions=True)
    out = None
    while out is None and engine.has_work:
        out = next((ev.output for r, ev in engine.step() if r is warm and ev.output is not None), None)
    assert warm.seq.slot == session and out.cached_tokens > 4 and out.token_ids == cold_ids


def test_a_batch_past_the_last_full_bucket_pads_to_the_pool():
    """A pool of 6 request slots: five requests pad to 6 (their bucket, 8, is more than the pool holds;
    not to 7 with the scratch slot: rounds pad to the request slots' count), so every batch size still
    has a graph to replay; and they emit what they emit alone."""
    params = nextn.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = nextn.LLM(device="cpu", num_speculative_tokens=2, max_num_seqs=6)
    engine = llm.engine
    prompts = PROMPTS + [[9, 9, 1, 4], [30, 31, 32]]
    alone = [_run(engine, [p], params)[0][0] for p in prompts]
    engine.runner.pad_rounds = True
    assert engine.runner.pool.sequences == 6 == engine.runner.pool.num_slots - SCRATCH_SLOTS
    together, _ = _run(engine, prompts, params)
    assert 6 in engine.runner._slot_sets and 5 not in engine.runner._slot_sets and 8 not in engine.runner._slot_sets
    assert together == alone


LONG_PROMPT = [(7 * i + 3) % 200 + 5 for i in range(150)]  # 150 tokens: pieces over several steps


def _steps(engine, outputs: dict, until) -> None:
    """Engine steps, the outputs that finish kept in `outputs`, until `until()` holds."""
    while not until():
        for r, ev in engine.step():
            if ev.output is not None:
                outputs[r.request_id] = ev.output.token_ids


def _three_decoding(prefill: str, monkeypatch):
    """Every slot of a pool of four taken: three requests decoding (pad_rounds forced, as with
    graphs), then LONG_PROMPT added (32-token steps: its prompt in pieces over several steps).
    Returns the engine, the four outputs alone, the decoders and the late request, the outputs
    so far, and the list of the slots pads take (from now on)."""
    import nextn.engine.rounds as rounds

    params = nextn.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = nextn.LLM(
        device="cpu",
        num_speculative_tokens=3,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        prefill=prefill,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    alone = [_run(engine, [p], params)[0][0] for p in PROMPTS + [LONG_PROMPT]]
    engine.runner.pad_rounds = True
    padded_on: list[int] = []  # the slots pads took
    pads = rounds._pads
    monkeypatch.setattr(rounds, "_pads", lambda *a: [padded_on.append(m.cache.slot) or m for m in pads(*a)])
    reqs = [engine.add(p, params) for p in PROMPTS]
    outputs: dict = {}
    _steps(engine, outputs, lambda: all(r.request_id in engine.live for r in reqs))
    late = engine.add(LONG_PROMPT, params)
    padded_on.clear()
    return engine, alone, reqs, late, outputs, padded_on


def test_pads_on_a_prefilling_slot_change_nothing(monkeypatch):
    """With every slot taken (three decoding, one prefilling a long prompt a piece a step, apart
    from their rounds: "steps"), the decoders' rounds still pad to their bucket: the pad sits on
    the prefilling request's slot. The prefilling request, and the decoders, emit what they emit
    alone."""
    engine, alone, reqs, late, outputs, padded_on = _three_decoding("steps", monkeypatch)
    engine.step()  # admitted: a piece prefilled
    assert late.request_id in engine.prefilling and engine.scheduler.free == []
    padded_on.clear()
    engine.step()  # the three decoders' round, padded onto the prefilling slot
    assert late.request_id in engine.prefilling and padded_on == [late.seq.slot]
    _steps(engine, outputs, lambda: len(outputs) == 4)
    assert [outputs[r.request_id] for r in reqs + [late]] == alone


def test_pads_never_take_a_riding_slot(monkeypatch):
    """Under "chunked" prefill a long prompt's pieces (64, 64 and 22 rows) ride the decoders' rounds
    (mixed steps, graphed like any round, the pieces' slots followed after the members'): a pad
    there never takes the riding slot (the pool's one spare slot), and every request emits what it
    emits alone."""
    engine, alone, reqs, late, outputs, padded_on = _three_decoding("chunked", monkeypatch)
    mixed = engine.time.mixed_steps
    _steps(engine, outputs, lambda: late.request_id in engine.live)
    assert engine.time.mixed_steps - mixed == 3 and late.seq.slot not in padded_on
    _steps(engine, outputs, lambda: len(outputs) == 4)
    assert [outputs[r.request_id] for r in reqs + [late]] == alone


def test_warm_up_rounds_leave_the_slots_empty():
    """The start-up warm-up (rounds of pad members at every batch bucket and K; on a GPU it captures
    their graphs) runs here eagerly: afterwards every slot's counters are as they were and requests
    emit what they emitted before it."""
    from nextn.cache.hybrid import SEQ_LEN
    from nextn.engine.rounds import warm_up

    params = nextn.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = nextn.LLM(device="cpu", num_speculative_tokens=3, max_num_seqs=4)
    engine = llm.engine
    expected, _ = _run(engine, PROMPTS, params)
    eager, ctl = engine.runner.graph_counts["eager"], engine.runner.pool.cache.ctl.clone()
    assert ctl[:, SEQ_LEN].any()  # the slots hold the sequences run before
    assert warm_up(engine.runner, engine.proposer, 4, [0, 3]) == 0  # (no graphs on the CPU)
    assert engine.runner.graph_counts["eager"] - eager == 3 * 2 * 2  # sizes 1, 2, 4; K 0 and 3; twice each
    assert torch.equal(engine.runner.pool.cache.ctl, ctl)
    assert _run(engine, PROMPTS, params)[0] == expected
