"""The fused Triton step (nextn.models.qwen3_5_step) against the reference step on tiny checkpoints:
it computes what the module forward computes, its rows do not depend on the row count (a verify
row equals the decode of the same token, bitwise), a step that is not committed leaves the
committed state, and greedy speculative output equals plain greedy output in bf16 on every family.
On a GPU, rounds replayed as CUDA graphs emit what the same rounds run eagerly emit.

On CPU the kernels run under Triton's interpreter (see triton_interp.py); on a GPU as CUDA graphs.
"""

from __future__ import annotations

import functools

import pytest
import torch
import triton_interp  # noqa: F401  (before triton)

pytest.importorskip("triton")

from hf_fixtures import FIT_PROMPTS  # noqa: E402

import nextn  # noqa: E402
from nextn.config import FULL  # noqa: E402
from nextn.engine.sequence import Sequence  # noqa: E402
from nextn.ops import triton_attention, triton_gdn, triton_linear, triton_moe, triton_utils  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [7, 81, 3, 199, 42, 5, 260, 11, 90, 17]


@functools.lru_cache(maxsize=6)
def _engine(ckpt, dtype, kernels="triton", k=3):
    return nextn.LLM(
        model=ckpt,
        device=DEVICE,
        dtype=dtype,
        kernels=kernels,
        num_speculative_tokens=k,
        max_model_len=64,
        max_num_seqs=2,
    ).engine


def _prefilled(engine, slot, prompt=PROMPT):
    seq = Sequence(slot, heads=False)
    engine.runner.slot(slot).reset()
    engine.runner.extend(seq, prompt)
    return engine.runner.slot(slot)


def _step(engine, cache, ids):
    """A trunk step of ids (not committed): (logits [T, V], head-input hiddens [T, H])."""
    T, cfg = len(ids), engine.model.cfg
    logits = torch.empty(T, cfg.vocab_size, device=DEVICE)
    hidden = torch.empty(T, cfg.hidden_size, device=DEVICE, dtype=engine.runner.dtype)
    with torch.inference_mode():
        engine.runner.step.trunk(engine.runner.batch([cache], [T]), torch.tensor(ids, device=DEVICE), logits, hidden)
    return logits, hidden


def _gdn(engine):
    return [i for i, t in enumerate(engine.model.cfg.layer_types) if t != FULL]


@pytest.mark.parametrize("name", ["dense_ckpt", "next_ckpt"])
def test_triton_step_matches_reference_step(name, request):
    ckpt = request.getfixturevalue(name)
    ref, fast = _engine(ckpt, "float32", "torch"), _engine(ckpt, "float32")
    ref_cache, fast_cache = _prefilled(ref, 0), _prefilled(fast, 0)
    ref_out, out = _step(ref, ref_cache, [5, 77, 300]), _step(fast, fast_cache, [5, 77, 300])
    for x, y in zip(out, ref_out, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    ref_cache.commit(2)
    fast_cache.commit(2)
    fast.runner.fold([fast_cache.slot])
    ref.runner.fold([ref_cache.slot])
    for i in _gdn(ref):
        for x, y in zip(fast_cache.committed_gdn(i), ref_cache.committed_gdn(i), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_triton_head_step_matches_reference(dense_ckpt):
    ref, fast = _engine(dense_ckpt, "float32", "torch"), _engine(dense_ckpt, "float32")
    H, V = ref.model.cfg.hidden_size, ref.model.cfg.vocab_size
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.tensor([5, 77, 300, 9], device=DEVICE)
    hidden = torch.randn(4, H, generator=g, device=DEVICE)
    outs = []
    for engine in (ref, fast):
        cache = engine.runner.slot(0)
        for t in cache.draft_kv()[:2]:  # key, value
            t.zero_()
        logits, chained = torch.empty(1, V, device=DEVICE), torch.empty(1, H, device=DEVICE)
        pos = torch.tensor([6], dtype=torch.int32, device=DEVICE)
        with torch.inference_mode():
            batch, row = engine.runner.batch([cache], [4]), torch.tensor([2], device=DEVICE)
            engine.runner.step.head(batch, ids, hidden, pos, row, (logits, chained))
        outs.append((logits, chained, cache.draft_kv()[0][6:10].clone()))
    for x, y in zip(*outs, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_verify_rows_equal_decode_steps_bitwise(dense_ckpt):
    """A verify of 4 tokens committing 3 == 3 single-token decodes: logits, hiddens and states."""
    engine = _engine(dense_ckpt, "bfloat16")
    ids = [5, 77, 300, 12]
    a, b = _prefilled(engine, 0), _prefilled(engine, 1)
    verify_logits, verify_hidden = _step(engine, a, ids)
    a.commit(3)
    for t in range(3):
        logits, hidden = _step(engine, b, ids[t : t + 1])
        b.commit(1)
        assert torch.equal(logits[0], verify_logits[t]) and torch.equal(hidden[0], verify_hidden[t]), t
    engine.runner.fold([a.slot, b.slot])  # the pending rows as the engine's step folds them
    for i in _gdn(engine):
        for x, y in zip(a.committed_gdn(i), b.committed_gdn(i), strict=True):
            assert torch.equal(x, y)
    n = a.seq_len
    for i in (i for i, t in enumerate(engine.model.cfg.layer_types) if t == FULL):
        assert torch.equal(a.kv(i)[0][:n], b.kv(i)[0][:n])


@pytest.mark.parametrize("name", ["moe_fitted_ckpt", "next_ckpt"])
def test_programmatic_dependent_launches_keep_the_step_bits(name, request, monkeypatch):
    """On Hopper the step's kernels are programmatic dependent launches: each starts before the one
    ahead of it has finished, waits for it in-kernel, and may read what earlier launches wrote before
    that wait (the rule in nextn.ops.triton_utils.pdl_supported). A decode and a 4-row verify give
    the bits of the same steps with every launch plain; a kernel that read an input before the launch
    writing it had finished would differ. (On the CPU both runs are plain: the test runs on a GPU.)"""
    if not triton_utils.pdl_supported(torch.empty(1, device=DEVICE)):
        pytest.skip("programmatic dependent launches need a GPU of compute capability 9 or later")
    engine = _engine(request.getfixturevalue(name), "bfloat16")

    def steps():
        cache = _prefilled(engine, 0)
        return [t for ids in ([5], [5, 9, 13, 2]) for t in _step(engine, cache, ids)]

    modules = (triton_linear, triton_moe, triton_gdn, triton_attention)
    answers = []  # what the launches were told when they asked whether they may be dependents

    def spy(tensor, real):
        answers.append(real(tensor))
        return answers[-1]

    for module in modules:
        monkeypatch.setattr(module, "pdl_supported", functools.partial(spy, real=module.pdl_supported))
    dependent = steps()
    assert any(answers)  # the step did launch dependents: the comparison below is not plain against plain
    for module in modules:
        monkeypatch.setattr(module, "pdl_supported", lambda tensor: False)
    plain = steps()
    assert all(torch.isfinite(t).all() for t in plain)
    for a, b in zip(dependent, plain, strict=True):
        assert torch.equal(a, b)


def test_a_step_not_committed_leaves_the_committed_state(dense_ckpt):
    """The committed recurrent state stays in the step buffers after commit (ctl STATE_AT); a later
    step that is not kept (a round queued after a stop) must not overwrite it."""
    engine = _engine(dense_ckpt, "bfloat16")
    a, b = _prefilled(engine, 0), _prefilled(engine, 1)
    for cache in (a, b):
        _step(engine, cache, [5])
        cache.commit(1)
    _step(engine, a, [77, 300, 12])  # not committed
    assert torch.equal(_step(engine, a, [9])[0], _step(engine, b, [9])[0])
    for cache in (a, b):
        cache.commit(1)
    engine.runner.fold([a.slot, b.slot])  # the pending rows as the engine's step folds them
    for i in _gdn(engine):
        for x, y in zip(a.committed_gdn(i), b.committed_gdn(i), strict=True):
            assert torch.equal(x, y)


def _generate(ckpt, k, prompt, max_tokens, graphs=True):
    engine = _engine(ckpt, "bfloat16", k=k)
    engine.runner.use_graphs = graphs and DEVICE == "cuda"
    llm = nextn.LLM.of_engine(engine)  # the engine above, through the API's loop
    out = llm.generate(
        prompt_token_ids=list(prompt),
        params=nextn.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    return out.token_ids, out.spec


@pytest.mark.parametrize(
    "name,ks,prompt,n",
    [("dense_fitted_ckpt", (1, 3), 1, 8), ("moe_fitted_ckpt", (2,), 0, 8), ("next_ckpt", (2,), 0, 6)],
)
def test_greedy_spec_equals_plain_bf16(name, ks, prompt, n, request):
    """Each K against one plain run of n tokens (the dense K = 1 and K = 3 share theirs). On these
    prompts the fitted heads' drafts are accepted and rejected (K = 3: every round a partial
    accept; K = 1 accepts each of its drafts; MoE K = 2: partial and full accepts); the random
    head's are all rejected, so each of Qwen3-Next's 5 rounds rolls its states back and the next
    one runs from them (past the conv window's 3 carried columns)."""
    ckpt = request.getfixturevalue(name)
    plain, _ = _generate(ckpt, 0, FIT_PROMPTS[prompt], n)
    accepted = rejected = 0
    for k in ks:
        spec, stats = _generate(ckpt, k, FIT_PROMPTS[prompt], n)
        assert spec == plain, k
        assert stats.num_drafted > 0
        accepted, rejected = accepted + stats.num_accepted, rejected + stats.num_drafted - stats.num_accepted
    assert rejected > 0
    if name != "next_ckpt":  # fitted heads: drafts are accepted
        assert accepted > 0


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_rounds_equal_eager_rounds(dense_fitted_ckpt, temperature):
    """Rounds replayed as CUDA graphs draft, accept and emit what the same rounds run eagerly do."""
    engine = _engine(dense_fitted_ckpt, "bfloat16", k=3)
    llm = nextn.LLM.of_engine(engine)
    params = nextn.SamplingParams(max_tokens=24, temperature=temperature, seed=7, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        engine.runner.use_graphs = graphs
        out = llm.generate(prompt_token_ids=list(FIT_PROMPTS[1]), params=params)
        runs.append((out.token_ids, out.spec.accepted_per_position, out.num_drafted))
    engine.runner.use_graphs = True
    assert any(g is not None for g in engine.runner.graphs.values()), "no round was replayed from a graph"
    assert runs[0] == runs[1] and runs[0][2] > 0
