"""The Triton step path (nextn.engine.fast) on a tiny checkpoint: it matches the reference step,
its rows do not depend on the row count (decode == verify bitwise), rollback through FastCache
equals stepping token by token, and greedy speculative output equals plain greedy output.

On CPU the kernels run under Triton's interpreter (see triton_interp.py); on a GPU as CUDA graphs.
"""
from __future__ import annotations

import functools

import pytest
import torch
import triton_interp  # noqa: F401  (before triton)

pytest.importorskip("triton")

from hf_fixtures import FIT_PROMPTS  # noqa: E402

from nextn.config import SpecConfig  # noqa: E402
from nextn.core import SamplingParams, SpecStats  # noqa: E402
from nextn.engine.fast import build_engine  # noqa: E402
from nextn.engine.generate import run_rounds  # noqa: E402
from nextn.models.loader import load_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [7, 81, 3, 199, 42, 5, 260, 11, 90, 17]


def _model(ckpt, dtype):
    return load_model(ckpt, device=DEVICE, dtype=dtype)


def _prefilled(runner, prompt=PROMPT, max_len=64):
    state = runner.new_state(max_len)
    runner.extend(state, prompt)
    return state


def test_triton_step_matches_reference_step(dense_ckpt):
    ref_runner, _ = build_engine(_model(dense_ckpt, "float32"), SpecConfig(), "torch")
    fast_runner, _ = build_engine(_model(dense_ckpt, "float32"), SpecConfig(), "triton")
    ids = torch.tensor([5, 77, 300], device=DEVICE)
    ref_state, fast_state = _prefilled(ref_runner), _prefilled(fast_runner)
    ref_logits, ref_hidden = ref_runner.step(ref_state, ids)
    logits, hidden = fast_runner.step(fast_state, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
    ref_state.cache.commit(2)
    fast_state.cache.commit(2)
    fast_state.cache.materialize()  # the committed states come home from the step buffers
    for i in ref_state.cache.recurrent:
        torch.testing.assert_close(fast_state.cache.recurrent[i], ref_state.cache.recurrent[i], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fast_state.cache.conv[i], ref_state.cache.conv[i])


def test_verify_rows_equal_decode_steps_bitwise(dense_ckpt):
    """A verify of 4 tokens committing n == n single-token decodes: logits, hiddens and states."""
    runner, _ = build_engine(_model(dense_ckpt, "bfloat16"), SpecConfig(), "triton")
    ids = torch.tensor([5, 77, 300, 12], device=DEVICE)
    state = _prefilled(runner)
    verify_logits, verify_hidden = runner.step(state, ids)
    state.cache.commit(3)
    other = _prefilled(runner)
    for t in range(3):
        logits, hidden = runner.step(other, ids[t : t + 1])
        other.cache.commit(1)
        assert torch.equal(logits[0], verify_logits[t]), t
        assert torch.equal(hidden[0], verify_hidden[t]), t
    state.cache.materialize()
    other.cache.materialize()
    for i in state.cache.recurrent:
        assert torch.equal(state.cache.recurrent[i], other.cache.recurrent[i])
        assert torch.equal(state.cache.conv[i], other.cache.conv[i])
    for i in state.cache.kv:
        n = state.cache.seq_len
        assert torch.equal(state.cache.kv[i].key[:, :n], other.cache.kv[i].key[:, :n])


def test_discarded_step_leaves_the_committed_state(dense_ckpt):
    """The committed recurrent states stay in the step buffers after commit (FastCache.slots);
    a later step that is discarded, or a verify committing fewer tokens, must not overwrite them."""
    runner, _ = build_engine(_model(dense_ckpt, "bfloat16"), SpecConfig(), "triton")
    state, other = _prefilled(runner), _prefilled(runner)
    for st in (state, other):
        runner.step(st, torch.tensor([5], device=DEVICE))
        st.cache.commit(1)
    runner.step(state, torch.tensor([77, 300, 12], device=DEVICE))  # e.g. queued after a stop token
    state.cache.discard_step()
    logits, _ = runner.step(state, torch.tensor([9], device=DEVICE))
    other_logits, _ = runner.step(other, torch.tensor([9], device=DEVICE))
    assert torch.equal(logits, other_logits)
    for st in (state, other):
        st.cache.commit(1)
        st.cache.materialize()
    for i in state.cache.recurrent:
        assert torch.equal(state.cache.recurrent[i], other.cache.recurrent[i])
        assert torch.equal(state.cache.conv[i], other.cache.conv[i])


@functools.lru_cache(maxsize=4)
def _generate(ckpt, k, dtype, prompt, max_tokens):
    model = _model(ckpt, dtype)
    spec = SpecConfig(num_speculative_tokens=k)
    runner, proposer = build_engine(model, spec, "triton")
    state = _prefilled(runner, list(prompt), max_len=len(prompt) + max_tokens + 20)
    stats = SpecStats()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [t for ev in run_rounds(runner, proposer, state, params, spec, set(), stats) for t in ev.token_ids]
    return ids, stats


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_spec_equals_plain_bf16(dense_fitted_ckpt, k):
    prompt = tuple(FIT_PROMPTS[1])
    plain, _ = _generate(dense_fitted_ckpt, 0, "bfloat16", prompt, 12)
    spec, stats = _generate(dense_fitted_ckpt, k, "bfloat16", prompt, 12)
    assert spec == plain
    assert stats.num_drafted > 0


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_chain_graph_drafts_what_the_eager_chain_drafts(dense_fitted_ckpt):
    """The greedy chain replayed as one CUDA graph drafts the eager chain's tokens: same output,
    same acceptance at every draft position (the verify would hide wrong drafts; acceptance not)."""
    model = _model(dense_fitted_ckpt, "bfloat16")
    prompt = list(FIT_PROMPTS[1])
    spec = SpecConfig(num_speculative_tokens=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        runner, proposer = build_engine(model, spec, "triton")
        runner.use_graphs = graphs
        state = _prefilled(runner, prompt, max_len=len(prompt) + 40)
        stats = SpecStats()
        ids = [t for ev in run_rounds(runner, proposer, state, params, spec, set(), stats) for t in ev.token_ids]
        runs.append((ids, stats.accepted_per_position, stats.num_drafted))
        if graphs:
            assert state.cache.graphs.chain_graphs, "the graph chain did not run"
    assert runs[0] == runs[1]
    assert runs[0][2] > 0


def test_greedy_spec_equals_plain_bf16_moe(moe_fitted_ckpt):
    prompt = tuple(FIT_PROMPTS[0])
    plain, _ = _generate(moe_fitted_ckpt, 0, "bfloat16", prompt, 10)
    spec, stats = _generate(moe_fitted_ckpt, 2, "bfloat16", prompt, 10)
    assert spec == plain
    assert stats.num_drafted > 0
