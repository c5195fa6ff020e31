"""The host loop of rounds (nextn.engine.rounds): each round queued on the device before the host
reads the one before (`ahead`) against one round at a time: the same events (tokens, finish
reasons, acceptance) and the same slot state afterwards, bitwise, whether the request ends by the
budget, a stop token, the context, or the consumer closing it, for plain decoding and with drafts
accepted; and a second turn on either state continues identically. A request that ends inside a
round leaves exactly its emitted tokens but the last committed, which is what a cold prefill of
those tokens leaves (greedy: the same next tokens)."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import FIT_PROMPTS

import nextn
from nextn.config import FULL
from nextn.core import SamplingParams
from nextn.engine.rounds import RequestRounds
from nextn.engine.scheduler import RoundSettings
from nextn.engine.sequence import Sequence

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CUDA: Triton rounds replayed as CUDA graphs
PROMPTS = [list(FIT_PROMPTS[0]), [17], list(FIT_PROMPTS[1])]
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=1234)
SECOND_TURN = [40, 7, 250]


@pytest.fixture(scope="module", params=[0, 3], ids=["plain", "spec3"])
def engine(request, dense_fitted_ckpt):
    return nextn.LLM(
        model=dense_fitted_ckpt, device=DEVICE, num_speculative_tokens=request.param, max_model_len=96, max_num_seqs=2
    ).engine


def _prefilled(engine, slot, prompt):
    seq = Sequence(slot, heads=engine.proposer is not None)
    engine.runner.slot(slot).reset()
    engine.runner.extend(seq, prompt)
    return seq


def _run(engine, seq, params, ahead, stop_ids=(), close_after=None):
    rounds = RequestRounds(engine.runner, engine.proposer, seq, RoundSettings(params, frozenset(stop_ids)), ahead=ahead)
    stats = rounds.stats
    events = []
    while True:
        r = rounds.next()
        events.append((r.token_ids, r.finish_reason))
        if r.finish_reason is not None or len(events) == close_after:
            break
    rounds.close()
    return events, (stats.num_rounds, stats.num_drafted, stats.num_accepted, stats.accepted_per_position)


def _state(engine, seq) -> list:
    """Everything a later turn reads of the slot."""
    engine.runner.fold([seq.slot])  # the pending GDN rows as the engine's step folds them
    cache, cfg = engine.runner.slot(seq.slot), engine.model.cfg
    n = len(seq.tokens)
    out = [
        seq.tokens,
        seq.draft_len,
        seq.pending_ids,
        cache.ctl.tolist(),
        seq.last_hidden,
        seq.last_logits,
        seq.pending_hidden,
    ]
    for i, kind in enumerate(cfg.layer_types):
        if kind == FULL:
            out += [t[:n] for t in cache.kv(i) if t is not None]
        else:
            out += list(cache.committed_gdn(i))
    if seq.heads:
        out += [t[: seq.draft_len] for t in cache.draft_kv() if t is not None]
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
        else:
            assert x == y


def _compare(engine, prompt, params, stop_ids=(), close_after=None):
    """Both loops on fresh slots, then a second turn on each; assert everything equal. Returns the
    first turn's tokens."""
    seqs = [_prefilled(engine, slot, prompt) for slot in (0, 1)]
    runs = [
        _run(engine, seq, params, ahead, stop_ids, close_after) for seq, ahead in zip(seqs, (True, False), strict=True)
    ]
    assert runs[0] == runs[1]
    _assert_same(_state(engine, seqs[0]), _state(engine, seqs[1]))
    tokens = [t for ids, _ in runs[0][0] for t in ids]
    assert seqs[0].tokens == prompt + tokens[:-1]
    if len(seqs[0].tokens) + len(SECOND_TURN) + 8 <= engine.config.max_model_len:
        turn2 = SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY)
        for seq in seqs:
            engine.runner.extend(seq, tokens[-1:] + SECOND_TURN)
        assert _run(engine, seqs[0], turn2, True) == _run(engine, seqs[1], turn2, False)
        _assert_same(_state(engine, seqs[0]), _state(engine, seqs[1]))
    return tokens


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_ahead_equals_one_round_at_a_time(engine, kind):
    sampling = GREEDY if kind == "greedy" else SAMPLED
    for prompt in PROMPTS:
        ref = _compare(engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True, **sampling))
        assert len(ref) == 24
        for budget in (1, 2, 3, 7):
            out = _compare(engine, prompt, SamplingParams(max_tokens=budget, ignore_eos=True, **sampling))
            assert out == ref[:budget]
        # stop ids that occur first at several positions (the first token, mid-way, the last)
        for stop in {ref[0], ref[len(ref) // 2], ref[-1]}:
            out = _compare(engine, prompt, SamplingParams(max_tokens=24, **sampling), stop_ids=[stop])
            assert out == ref[: ref.index(stop) + 1]


def test_sampled_cases_draw(engine):
    """The sampled cases above draw (they differ from greedy) and depend on the seed."""
    prompt = PROMPTS[0]
    greedy = _compare(engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY))
    sampled = _compare(engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True, **SAMPLED))
    other_seed = _compare(engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True, **{**SAMPLED, "seed": 99}))
    assert sampled != greedy and sampled != other_seed


@pytest.mark.parametrize("room", [0, 1, 2, 5])
def test_context_end(engine, room):
    """The context ends before the budget: the tokens up to it (committed: all of the context, the
    last token pending), then "length"."""
    prompt = list(range(3, 3 + engine.config.max_model_len - room))
    _compare(engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY))
    events, _ = _run(engine, _prefilled(engine, 0, prompt), SamplingParams(max_tokens=24, ignore_eos=True), True)
    assert events[-1][1] == "length" and sum(len(ids) for ids, _ in events) == room + 1


@pytest.mark.parametrize("close_after", [1, 2, 5])
def test_consumer_closing_between_rounds(engine, close_after):
    """A consumer that stops reading (a disconnect) leaves the same state, the round queued ahead not kept."""
    _compare(engine, PROMPTS[2], SamplingParams(max_tokens=24, ignore_eos=True, **SAMPLED), close_after=close_after)


def test_a_closed_request_leaves_what_a_cold_prefill_leaves(engine):
    """Greedy: after a request stopped inside a round, the slot continues exactly like a slot
    prefilled cold with the same tokens."""
    prompt = PROMPTS[0]
    ref = _compare(engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY))
    stop = ref[len(ref) // 2]
    warm = _prefilled(engine, 0, prompt)
    _run(engine, warm, SamplingParams(max_tokens=24, **GREEDY), True, stop_ids=[stop])
    cold = _prefilled(engine, 1, warm.tokens)
    assert cold.tokens == warm.tokens
    turn2 = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
    for seq in (warm, cold):
        engine.runner.extend(seq, [stop] + SECOND_TURN)
    assert _run(engine, warm, turn2, True)[0] == _run(engine, cold, turn2, True)[0]


def test_runner_tables_stay_bounded_with_graphs(dense_ckpt):
    """Eager rounds (constrained ones) add step batches and index tensors that no graph count
    bounds: past 8 * MAX_GRAPHS entries the runner starts over, graphs included (never mid-capture)."""
    from nextn.engine import runner as runner_mod

    runner = nextn.LLM(model=dense_ckpt, device="cpu", max_model_len=64, max_num_seqs=1).engine.runner
    drops = []

    def drop_graphs():  # what the CUDA one does, without a device to synchronize
        drops.append(len(runner._indices))
        runner._indices.clear()

    runner.use_graphs, runner.drop_graphs = True, drop_graphs
    limit = 8 * runner_mod.MAX_GRAPHS
    for i in range(limit + 5):
        runner.index([i])
    assert drops == [limit] and len(runner._indices) == 5
    runner._capturing = object()  # inside a capture the table grows rather than drop what the graph reads
    for i in range(limit):
        runner.index([-i - 1])
    assert drops == [limit] and len(runner._indices) == limit + 5
