"""Draft control and what it reports: the p_min gate inside the chain (zero-draft rounds, head
steps skipped, output unchanged greedy, exact in law sampled), the adaptive-K law, the per-round
diagnostics (--trace, usage, /metrics, bench), the telemetry's delta and merge, the hidden
convention, sessions continued with an empty suffix, replay's NLL and hidden dump, and graph
memory counted with the sessions it serves. Each test fails if its feature is taken out."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from hf_fixtures import FIT_PROMPTS, hf_hidden_states, hf_logits
from test_sampling import DRAFT, NUM_TOKENS, PROMPT, SPEC_FILTERS, TARGET, VOCAB, _rows_probs, exact_law, tv_threshold

import nextn
from nextn.cli import main
from nextn.core import RequestOutput, SpecStats
from nextn.engine.runner import GraphMemory
from nextn.sample.pipeline import RequestRng, Stream, sample
from nextn.sample.sampler import SlotSampler
from nextn.sample.verifier import gate_draft_probs, verify_sampled
from nextn.spec.adaptive import AdaptiveK

GREEDY = nextn.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _generate(llm, prompt, params=GREEDY):
    return llm.generate(prompt_token_ids=list(prompt), params=params)


# ---------------------------------------------------------------------------------------------
# the gate, greedy


def test_p_min_cuts_chains_on_the_device_and_keeps_output(dense_fitted_ckpt):
    """K=4 on a fitted head: at p_min 0 every round drafts 4 and none is zero-draft; at 0.5 draft
    1 is cut in some rounds (they verify the pending token alone), drafts per round fall, head
    steps stop once the chain is cut (the "mask" gate runs them all), and output is plain's."""
    prompt = FIT_PROMPTS[0]
    ref = _generate(nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0), prompt).token_ids
    runs = {}
    for p_min, gate in ((0.0, "skip"), (0.5, "skip"), (0.5, "mask")):
        llm = _with_gate(nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=4, p_min=p_min, trace=True), gate)
        out = _generate(llm, prompt)
        assert out.token_ids == ref, (p_min, gate)
        s, steps = out.spec, llm.engine.proposer.head_steps
        assert sum(s.accept_length_histogram) == s.num_rounds == len(out.rounds)
        assert sum(r.zero_draft for r in out.rounds) == s.num_zero_draft_rounds
        assert all(r.drafted == 0 for r in out.rounds if r.zero_draft)
        assert sum(r.drafted for r in out.rounds) == s.num_drafted
        runs[p_min, gate] = (s, out.rounds, None if steps is None else int(steps))
    plain, _, _ = runs[0.0, "skip"]
    assert plain.num_zero_draft_rounds == 0 and plain.num_drafted == 4 * plain.num_rounds
    (gated, rounds, steps), (masked, _, all_steps) = runs[0.5, "skip"], runs[0.5, "mask"]
    assert 0 < gated.num_zero_draft_rounds < gated.num_rounds and gated.num_drafted < 4 * gated.num_rounds
    # the first pass, then a chain step per draft that passed while the chain goes on
    assert steps == sum(1 + min(r.drafted, 3) for r in rounds) < 4 * gated.num_rounds
    assert all_steps == 4 * masked.num_rounds and masked == gated


def test_a_round_cut_to_its_first_token_is_not_zero_draft(dense_fitted_ckpt):
    """Without a gate no round verifies the pending token alone, whatever max_tokens cuts: a round
    that drafted 3 but emits only its first token (the budget's end) counts no drafts, yet it is
    not a zero-draft round. Some max_tokens here ends a request that way."""
    llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=3, trace=True)
    cut_to_one = 0
    for max_tokens in range(2, 14):
        params = nextn.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = _generate(llm, FIT_PROMPTS[0], params)
        assert out.spec.num_zero_draft_rounds == 0, max_tokens
        assert not any(r.zero_draft for r in out.rounds)
        cut_to_one += out.rounds[-1].drafted == 0
    assert cut_to_one > 0  # the case under test happened


def _with_gate(llm, gate: str):
    """The LLM with its engine rebuilt under SpecConfig.draft_gate = gate (a bench setting)."""
    from dataclasses import replace

    from nextn.engine.engine import Engine

    llm.config = replace(llm.config, spec=replace(llm.config.spec, draft_gate=gate))
    llm.engine = Engine(llm.model, llm.tokenizer, llm.config)
    return llm


def test_p_min_in_a_batch_of_requests(dense_fitted_ckpt):
    """Requests batched in one round, with their own K (some chains end before others), are cut
    at their own drafts: each drafts, counts and emits what it does alone (greedy: plain's)."""
    sampled = nextn.SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=9, ignore_eos=True)
    cases = [
        (FIT_PROMPTS[0], GREEDY, 3),
        (FIT_PROMPTS[1], GREEDY, 1),
        (FIT_PROMPTS[2], sampled, 2),
        ([17, 5], GREEDY, 3),
    ]
    engine = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=3, p_min=0.5, max_num_seqs=4).engine

    def run(items):
        reqs = {i: engine.add(list(cases[i][0]), cases[i][1], num_speculative_tokens=cases[i][2]) for i in items}
        outs = {}
        while len(outs) < len(reqs):
            for req, ev in engine.step():
                if ev.output is not None:
                    outs[next(i for i, r in reqs.items() if r is req)] = ev.output
        return outs

    alone = {i: run([i])[i] for i in range(len(cases))}
    engine.batch_sizes.clear()
    together = run(range(len(cases)))
    assert engine.batch_sizes[4] > 0
    plain = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0)
    for i, (prompt, params, _) in enumerate(cases):
        assert together[i].token_ids == alone[i].token_ids and together[i].spec == alone[i].spec
        if params is GREEDY:
            assert together[i].token_ids == _generate(plain, prompt).token_ids
    assert sum(o.spec.num_zero_draft_rounds for o in together.values()) > 0
    assert sum(o.num_drafted > 0 for o in together.values()) >= 2


def test_the_gate_keeps_a_cut_member_cut():
    """A member's drafts count up to its first cut, whatever the others' chains do after it."""
    from nextn.spec.proposer import _Gate

    gate = _Gate(torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long))
    idx = lambda *i: torch.tensor(i)  # noqa: E731
    gate.cut(None, torch.tensor([True, False, True]))
    gate.cut(idx(0, 1), torch.tensor([True, True]))  # member 1 passes after its cut: still cut
    assert gate.counted.tolist() == [2, 0, 1] and not gate.still_drafting(idx(1)) and gate.still_drafting(None)
    gate.cut(idx(0, 2), torch.tensor([False, True]))
    assert gate.counted.tolist() == [2, 0, 2] and gate.live.tolist() == [False, False, True]
    gate.cut(idx(2), torch.tensor([False]))
    assert not gate.still_drafting(None) and gate.counted.tolist() == [2, 0, 2]


# ---------------------------------------------------------------------------------------------
# the gate, sampled: a draft the gate keeps has the law q restricted to what the gate lets through


def _gated_generate(params, k: int, seed: int, p_min: float, restrict: bool) -> tuple:
    """The spec loop of test_sampling with a gate on the draft head's own probability (before the
    filters, as the sampler's): the chain stops at the first draft below p_min; the kept drafts
    are verified against q restricted by the gate (restrict) or against q itself (biased)."""
    rng, out = RequestRng(seed), []
    while len(out) < NUM_TOKENS:
        i, drafts, qs = len(out), [], []
        for j in range(k):
            q = _rows_probs(DRAFT, out, drafts, params)[-1].clone()  # [V]
            x = int(sample(q, rng.uniform(i + j, Stream.DRAFT)))
            head = torch.softmax(DRAFT[(PROMPT + out + drafts)[-1]], -1)  # [V]
            if head[x] < p_min:
                break
            if restrict:
                gate_draft_probs(q[None], (head >= p_min)[None])
            drafts.append(x)
            qs.append(q)
        p = _rows_probs(TARGET, out, drafts, params)  # [n+1, V]
        q = torch.stack(qs) if qs else torch.zeros(0, VOCAB)
        u_acc = torch.tensor([rng.uniform(i + j, Stream.ACCEPT) for j in range(len(drafts))], dtype=torch.float64)
        u_res = torch.tensor([rng.uniform(i + j, Stream.SAMPLE) for j in range(len(drafts) + 1)], dtype=torch.float64)
        n, ids = verify_sampled(p, q, torch.tensor(drafts, dtype=torch.long), u_acc, u_res)
        out += ids[: int(n) + 1].tolist()
    return tuple(out[:NUM_TOKENS])


@pytest.mark.parametrize("name", ["plain", "top_k"])
def test_gated_sampled_drafting_is_exact_in_law(name):
    params, draws = SPEC_FILTERS[name], 2000
    law, limit = exact_law(params), None
    tvs = {}
    for restrict in (True, False):
        counts = np.zeros_like(law)
        for seed in range(draws):
            counts[_gated_generate(params, 2, seed, 0.4, restrict)] += 1
        tvs[restrict] = 0.5 * np.abs(counts / draws - law).sum()
    limit = tv_threshold(law, draws)
    assert tvs[True] < limit < tvs[False], (tvs, limit)  # exact restricted; the unrestricted q is caught


def test_the_sampler_restricts_a_gated_draft_law(dense_fitted_ckpt):
    llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=2)
    V, cache = llm.model.cfg.vocab_size, llm.engine.runner.slot(0)
    params = nextn.SamplingParams(temperature=0.9, top_k=8, seed=3)
    logits = torch.full((1, V), -10.0)
    logits[0, :8] = torch.tensor([4.0, 3.5, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5])
    head = torch.softmax(logits, -1)[0]
    qs = {}
    for p_min in (0.0, 0.2):
        sampler = SlotSampler(cache, p_min)
        sampler.start(params, [1, 2, 3])
        token, q = torch.zeros(1, dtype=torch.long), torch.zeros(1, V)
        with torch.inference_mode():
            confidence = sampler.draft(logits, token[:0], torch.tensor([0.1], dtype=torch.float64), token, q)
        assert (confidence is None) == (p_min == 0.0)
        qs[p_min] = q[0]
    assert head[2] < 0.2 <= head[1] and qs[0.0][2] > 0  # the filtered law keeps low-confidence tokens
    expected = torch.where(head >= 0.2, qs[0.0], 0.0)
    assert torch.allclose(qs[0.2], expected / expected.sum())


# ---------------------------------------------------------------------------------------------
# adaptive K


def test_adaptive_k_follows_the_law():
    """The next round drafts accepted + 1 within [floor, cap]: floor 4 / 2 / 1 by hidden size, cap
    min(K, 7), a floor of 4 relaxes to 1 from 1024 committed tokens."""

    def drive(k, hidden, script):
        law, ks = AdaptiveK(k, True, hidden), []
        for accepted, committed in script:
            ks.append(law.k)
            law.update(accepted, committed)
        return ks + [law.k]

    script = [(0, 100), (7, 200), (2, 300), (5, 400), (0, 1100), (3, 1200)]
    assert drive(8, 4096, script) == [7, 4, 7, 4, 6, 1, 4]  # cap 7 (K 8), floor 4, relaxed at 1100
    assert drive(8, 3000, script) == [7, 2, 7, 3, 6, 2, 4]  # floor 2 stays at long context
    assert drive(8, 384, script) == [7, 1, 7, 3, 6, 1, 4]
    assert drive(3, 4096, [(0, 10), (3, 20)]) == [3, 3, 3]  # a floor above K is K
    assert drive(0, 4096, [(0, 10)]) == [0, 0]  # plain decoding stays plain
    fixed = AdaptiveK(8, False, 4096)
    fixed.update(0, 10)
    assert fixed.k == 8  # off: K stays


def test_the_engine_drafts_the_k_the_law_chooses(dense_fitted_ckpt):
    prompt = FIT_PROMPTS[1]
    ref = _generate(nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0), prompt).token_ids
    llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=6, adaptive_k=True, trace=True)
    out = _generate(llm, prompt)
    assert out.token_ids == ref
    law, committed = AdaptiveK(6, True, llm.model.cfg.hidden_size), len(prompt)
    for i, r in enumerate(out.rounds):  # the last round may be cut by max_tokens: it counts what it emitted
        assert r.k == law.k and (r.drafted == r.k or i == len(out.rounds) - 1)
        committed += r.accepted + 1
        law.update(r.accepted, committed)
    assert len({r.k for r in out.rounds}) > 1


def test_draft_controls_without_drafts_are_refused(dense_ckpt):
    """LLM(num_speculative_tokens=0, p_min=0.5) (or adaptive_k=True) ran plain decoding and ignored
    the setting; the CLI refuses those flags at K=0, and so does the configuration itself. Bench
    runs its plain baseline beside gated spec runs without the gate."""
    from nextn.config import SpecConfig

    for setting in (dict(p_min=0.5), dict(adaptive_k=True)):
        with pytest.raises(ValueError, match=f"{next(iter(setting))} would do nothing"):
            nextn.LLM(model=dense_ckpt, num_speculative_tokens=0, **setting)
    with pytest.raises(ValueError, match="p_min and adaptive_k would do nothing"):
        SpecConfig(0, p_min=0.2, adaptive=True)
    assert SpecConfig(2, p_min=0.2, adaptive=True).p_min == 0.2


def test_config_counts_are_integers():
    """LLM(num_speculative_tokens=True) ran as K=1 and LLM(max_model_len=2.5) failed inside a
    tensor allocation: counts are integers (numpy's too), named when they are not."""
    import numpy as np

    from nextn.config import EngineConfig, SpecConfig

    for kwargs, name in (
        (dict(num_speculative_tokens=True), "num_speculative_tokens"),
        (dict(num_speculative_tokens=2.0), "num_speculative_tokens"),
        (dict(max_model_len=2.5), "max_model_len"),
        (dict(max_num_seqs=True), "max_num_seqs"),
    ):
        with pytest.raises(ValueError, match=f"{name} must be an integer, got"):
            nextn.LLM(**kwargs)
    with pytest.raises(ValueError, match="p_min must be a number, got '0.5'"):
        SpecConfig(2, p_min="0.5")
    assert EngineConfig("m", max_model_len=np.int64(64), spec=SpecConfig(np.int32(3))).max_model_len == 64


# ---------------------------------------------------------------------------------------------
# what is reported


def test_generate_json_trace_usage_and_metrics(dense_fitted_ckpt, capsys):
    argv = ["generate", str(dense_fitted_ckpt), "--prompt-ids", ",".join(map(str, FIT_PROMPTS[0]))]
    argv += ["--max-tokens", "24", "--temperature", "0", "--ignore-eos", "--spec-k", "3", "--p-min", "0.5"]
    assert main([*argv, "--json", "--trace"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["accept_length_histogram"]) == 4 and sum(out["accept_length_histogram"]) == out["num_rounds"]
    assert out["num_zero_draft_rounds"] > 0 and len(out["rounds"]) == out["num_rounds"]
    assert sum(r["zero_draft"] for r in out["rounds"]) == out["num_zero_draft_rounds"]
    assert all(r["k"] == 3 and min(r["draft_s"], r["verify_s"], r["commit_s"]) > 0 for r in out["rounds"])

    from nextn.server.metrics import Metrics
    from nextn.server.responses import spec_usage

    stats = SpecStats()
    for drafted, accepted in ((3, 3), (0, 0), (3, 1), (0, 0)):
        stats.record_round(drafted, accepted)
    usage = spec_usage(stats, 3)
    assert usage.num_zero_draft_rounds == 2 and usage.accept_length_histogram == [2, 1, 0, 1]
    metrics = Metrics(3)
    metrics.finished(RequestOutput([1, 2], "", "length", 3, 0, stats, 0.1, 0.1), 0.2)
    text = metrics.render()
    assert "nextn:spec_decode_num_zero_draft_rounds_total 2" in text
    for le, count in (("0", 2), ("1", 3), ("2", 3), ("3", 4), ("+Inf", 4)):
        assert f'nextn:spec_decode_accept_length_bucket{{le="{le}"}} {count}' in text
    assert "nextn:spec_decode_accept_length_sum 4" in text and "nextn:spec_decode_accept_length_count 4" in text


def test_the_counts_are_of_the_tokens_emitted(dense_fitted_ckpt):
    """A round cut by max_tokens or a stop string counts what it emitted: the first token plus each
    round's 1 + accepted is the output's length (it counted the whole verify before), in the
    stats and in the trace."""
    llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=4, trace=True)
    prompt = list(FIT_PROMPTS[0])
    full = _generate(llm, prompt)
    assert full.spec.num_accepted > full.spec.num_rounds  # rounds emit several tokens: the cases below cut some
    cases = [dict(max_tokens=n) for n in range(2, 14)]
    text = full.text
    for j in range(2, 14):  # stop strings: a token's text that the output has not shown before
        piece = llm.tokenizer.decode(full.token_ids[j : j + 1])
        if piece.strip() and piece not in llm.tokenizer.decode(full.token_ids[:j]):
            cases.append(dict(stop=piece))
    assert len(cases) > 14, text
    cut = 0
    for case in cases:
        out = _generate(llm, prompt, nextn.SamplingParams(**{**GREEDY.__dict__, **case}))
        spec = out.spec
        assert 1 + spec.num_rounds + spec.num_accepted == len(out.token_ids), (case, spec)
        assert spec.num_accepted <= spec.num_drafted and sum(spec.accept_length_histogram) == spec.num_rounds
        assert [sum(r.accepted for r in out.rounds), len(out.rounds)] == [spec.num_accepted, spec.num_rounds]
        cut += len(out.token_ids) < len(full.token_ids)
    assert cut == len(cases)


def _rounds(stats: SpecStats, rounds) -> SpecStats:
    for drafted, accepted in rounds:
        stats.record_round(drafted, accepted)
    return stats


def test_telemetry_delta_isolates_what_was_counted_since():
    """The reference design's tests: a snapshot, more rounds, the delta is exactly those rounds."""
    t = _rounds(SpecStats(), [(3, 3), (3, 1)])
    before = SpecStats()
    before.merge(t)
    _rounds(t, [(3, 2)])
    d = t.delta_since(before)
    assert (d.num_rounds, d.num_drafted, d.num_accepted) == (1, 3, 2)
    assert d.drafted_per_position[:4] == [1, 1, 1, 0] and d.accepted_per_position[:3] == [1, 1, 0]
    assert d.accept_length_histogram[:4] == [0, 0, 1, 0] and d.num_zero_draft_rounds == 0


def test_telemetry_merge_accumulates_fieldwise():
    d1, d2 = _rounds(SpecStats(), [(3, 3), (3, 1)]), _rounds(SpecStats(), [(0, 0), (2, 0)])
    agg = SpecStats()
    agg.merge(d1)
    agg.merge(d2)
    assert agg == _rounds(SpecStats(), [(3, 3), (3, 1), (0, 0), (2, 0)])
    assert (agg.num_rounds, agg.num_drafted, agg.num_accepted, agg.num_zero_draft_rounds) == (4, 8, 4, 1)
    assert agg.drafted_per_position[:3] == [3, 3, 2] and agg.accept_length_histogram[:4] == [2, 1, 0, 1]


def test_telemetry_delta_saturates_never_goes_negative():
    """A diff against the wrong snapshot gives zeros, never negative counts (it feeds /metrics)."""
    small, big = _rounds(SpecStats(), [(2, 1)]), _rounds(SpecStats(), [(3, 3)] * 5)
    d = small.delta_since(big)
    assert (d.num_rounds, d.num_drafted, d.num_accepted) == (0, 0, 0)
    assert d.drafted_per_position == d.accepted_per_position == [0] * len(d.drafted_per_position)
    assert min(d.accept_length_histogram) == 0 and d.accept_length_histogram[1] == 1  # small's own bucket


# ---------------------------------------------------------------------------------------------
# the hidden convention


def test_the_heads_input_follows_the_hidden_convention(dense_fitted_ckpt):
    """The head is fed the trunk's hidden after the final norm by default and before it with
    hidden_after_norm=False, from a prefill and from the rounds (transformers' hiddens)."""
    prompt = list(FIT_PROMPTS[0])
    seen = {}
    for after in (True, False):
        llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=3, hidden_after_norm=after)
        out = llm.generate(
            prompt_token_ids=prompt, params=nextn.SamplingParams(max_tokens=9, temperature=0), use_sessions=True
        )
        (seq,) = llm.engine.scheduler.sessions.values()
        assert seq.tokens == prompt + out.token_ids[:-1] and seq.checkpoint.num_tokens == len(prompt)
        seen[after] = (seq.checkpoint.last_hidden, seq.last_hidden, seq.tokens)
    pre, post = hf_hidden_states(dense_fitted_ckpt, seen[True][2])
    assert not torch.allclose(pre[-1], post[-1], atol=1e-2)
    for after, want in ((True, post), (False, pre)):
        prefilled, decoded, _ = seen[after]
        assert torch.allclose(prefilled, want[len(prompt) - 1], atol=1e-4), after
        assert torch.allclose(decoded, want[-1], atol=1e-4), after


# ---------------------------------------------------------------------------------------------
# sessions


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_k=20, seed=5)])
def test_a_prompt_equal_to_a_kept_session_continues_it(dense_fitted_ckpt, sampling):
    """Nothing to prefill: the prompt is exactly the session's tokens (it resumes), or exactly its
    prompt-end checkpoint (it rewinds); either emits what a cold run of the prompt emits."""
    kw = dict(model=dense_fitted_ckpt, num_speculative_tokens=3, prefill="steps")
    warm, cold = nextn.LLM(**kw), nextn.LLM(**kw)
    params = nextn.SamplingParams(max_tokens=12, ignore_eos=True, **sampling)
    rng = random.Random(2)
    prompt = [rng.randrange(340) for _ in range(23)]
    warm.generate(prompt_token_ids=prompt, params=params, use_sessions=True)
    for rewinds in (1, 0):  # the first prompt again (its checkpoint), then the session as it stands
        before = warm.engine.scheduler.counters.rewinds
        out = warm.generate(prompt_token_ids=prompt, params=params, use_sessions=True)
        assert out.cached_tokens == len(prompt) and warm.engine.scheduler.counters.rewinds - before == rewinds
        assert out.token_ids == cold.generate(prompt_token_ids=prompt, params=params).token_ids
        (seq,) = warm.engine.scheduler.sessions.values()
        assert seq.tokens == prompt + out.token_ids[:-1]
        prompt = seq.tokens.copy()


def test_graph_memory_is_counted_with_the_sessions_it_serves(dense_ckpt):
    """What each capture added is kept by the slots its graph serves; a kept session's memory on
    /metrics counts its graphs; past the budget the runner starts over (graphs and counts)."""
    ledger = GraphMemory(budget=1000)
    ledger.add(("round", 0), (0,), 300)
    ledger.add(("round", 0, 1), (0, 1), 200)
    ledger.add(("prefill", 2), (2,), 100)
    assert ledger.total == 600 and ledger.of({0}) == 500 and ledger.of({1, 2}) == 300 and ledger.of(set()) == 0
    assert not ledger.full()
    ledger.add(("round", 3), (3,), 400)
    assert ledger.full()

    from nextn.engine.core import EngineCore

    llm = nextn.LLM(model=dense_ckpt, num_speculative_tokens=2, max_num_seqs=3)
    assert llm.engine.pool.graph_budget > 0
    llm.generate(prompt_token_ids=[5, 6, 7], params=GREEDY, use_sessions=True)
    (slot,) = llm.engine.scheduler.sessions
    llm.engine.runner.graph_memory.add(("round", slot), (slot,), 12345)  # on a GPU, measured at capture
    llm.engine.runner.graph_memory.add(("round", slot + 1), (slot + 1,), 999)  # a slot not kept
    # what the engine core sends /metrics with each step
    assert EngineCore(llm.engine).stats().session_memory_bytes == llm.engine.pool.slot_nbytes + 12345


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_a_resumed_session_replays_its_graphs(dense_fitted_ckpt):
    """Turn 2 of a kept session runs the rounds turn 1 captured (the same graphs, nothing
    recaptured), their memory counted with the session, and emits what a cold engine emits."""
    kw = dict(model=dense_fitted_ckpt, device="cuda", dtype="bfloat16", num_speculative_tokens=3, prefill="steps")
    warm, cold = nextn.LLM(**kw), nextn.LLM(**kw)
    params = nextn.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = list(FIT_PROMPTS[0])
    reply = warm.generate(prompt_token_ids=prompt, params=params, use_sessions=True).token_ids
    runner = warm.engine.runner
    rounds = {k: g for k, g in runner.graphs.items() if k[0] == "round" and g is not None}
    (slot,) = warm.engine.scheduler.sessions
    assert rounds and runner.graph_memory.of({slot}) > 0
    turn2 = prompt + reply + [40, 7, 250]
    out = warm.generate(prompt_token_ids=turn2, params=params, use_sessions=True)
    assert out.cached_tokens >= len(prompt) + len(reply) - 1
    assert out.token_ids == cold.generate(prompt_token_ids=turn2, params=params).token_ids
    after = {k: g for k, g in runner.graphs.items() if k[0] == "round" and g is not None}
    assert after == rounds  # the same CUDAGraph objects: replayed, not recaptured


# ---------------------------------------------------------------------------------------------
# replay


def test_replay_nll_equals_transformers_loss_and_dumps_bf16(dense_fitted_ckpt, tmp_path, monkeypatch):
    from safetensors import safe_open

    import nextn.spec.replay as replay_mod
    from nextn.models.loader import load_model

    monkeypatch.setattr(replay_mod, "CHUNK", 16)  # forwards across chunk boundaries
    rng = random.Random(3)
    ids = [rng.randrange(340) for _ in range(41)]
    model, dump = load_model(dense_fitted_ckpt), tmp_path / "hidden.safetensors"
    settings = replay_mod.ReplaySettings(2, stride=5, dump_hidden=str(dump))
    result = replay_mod.replay(model, ids, settings, progress=False)
    logits = hf_logits(dense_fitted_ckpt, ids)
    loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
    assert result.nll == pytest.approx(loss, rel=1e-4)
    with safe_open(str(dump), "pt") as f:
        hidden, input_ids = f.get_tensor("hidden"), f.get_tensor("input_ids")
    assert hidden.dtype == torch.bfloat16 and input_ids.tolist() == ids
    _, post = hf_hidden_states(dense_fitted_ckpt, ids)
    assert hidden.shape == post.shape and torch.allclose(hidden.float(), post, atol=2e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# bench


def test_bench_reports_the_gate_and_the_round_split(dense_fitted_ckpt):
    from nextn.bench import offline as bench
    from nextn.models.loader import load_model

    model = load_model(dense_fitted_ckpt)
    cfg = bench.BenchConfig(
        spec_ks=[4], prompt_len=12, gen_len=24, iters=1, repeats=1, p_mins=[0.0, 0.5], temperatures=[0.7]
    )
    prompt = list(FIT_PROMPTS[0])
    res = bench.run_bench(model, "dense", cfg, log=lambda s: None, prompt=prompt)
    gated = res["p_min_runs"][0.5]
    assert res["spec_equals_plain"] == {4: True} and gated["spec_equals_plain"] == {4: True}
    assert res["num_zero_draft_rounds"][4] == 0 and gated["num_zero_draft_rounds"][4] > 0
    assert res["head_steps_per_round"][4] == 4 and 1 <= gated["head_steps_per_round"][4] < 4
    for out in (res, gated):
        assert len(out["accept_length_histogram"][4]) == 5
        assert set(out["round_split_ms"][4]) == {"draft", "verify", "commit"}
        assert all(v > 0 for v in out["round_split_ms"][4].values())
    sampled = res["sampled"][0.7]  # the sampled runs at each gate too
    sampled_gated = sampled["p_min_runs"][0.5]
    assert sampled["p_min"] == 0.0 and sampled_gated["p_min"] == 0.5
    assert sampled["num_zero_draft_rounds"][4] == 0 and sampled_gated["num_zero_draft_rounds"][4] > 0
