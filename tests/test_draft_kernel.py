"""The gated greedy draft step (nextn.ops.triton_draft) against torch.argmax and its reference
(nextn.ops.draft), and the device flag that skips a cut chain's head steps (ModelRunner.when): a
flagged-off step writes nothing, a flagged-on one equals the plain call bitwise, and the engine
drafts through the fused step (no softmax) and skips what the gate cut.

On CPU the kernels run under Triton's interpreter (triton_interp.py); on a GPU compiled.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import triton_interp  # noqa: F401  (before triton)

pytest.importorskip("triton")

from hf_fixtures import FIT_PROMPTS  # noqa: E402

import nextn  # noqa: E402
from nextn.ops.draft import DraftGate, greedy_draft_reference  # noqa: E402
from nextn.ops.triton_draft import argmax_rows, greedy_draft  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tied_logits(n: int, V: int, dtype, seed: int) -> torch.Tensor:
    """[n, V] on a coarse grid (many ties, the row max among them), some rows' max repeated in a
    later block and one row constant."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(n, V, generator=g) * 2).round() / 2
    x[0, V // 2 :] = x[0].max()  # the max again further on: the first one wins
    if n > 2:
        x[2] = 0.25
    return x.to(dtype).to(DEVICE)


def _gate(n: int, live=None) -> DraftGate:
    live = torch.ones(n, dtype=torch.bool) if live is None else torch.tensor(live)
    counted = torch.arange(n) % 3
    return DraftGate(live.to(DEVICE), counted.to(DEVICE), 0.0, torch.zeros(1, dtype=torch.long, device=DEVICE), False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "V,block_v,max_splits", [(1, 4096, 64), (3, 4096, 64), (1000, 64, 64), (1000, 4096, 64), (5003, 1024, 64),
                             (5003, 256, 3), (1000, 64, 1)]
)  # fmt: skip
def test_greedy_draft_picks_torch_argmax(V, block_v, max_splits, dtype):
    """Picks equal torch.argmax bitwise (ties across and within tiles and runs, V not a power of
    two, runs of one tile or several, one run a row), through rows and d2t, written where at says,
    other cells untouched; a row whose first runs are all -inf too."""
    n = 5
    logits = _tied_logits(n, V, dtype, seed=V)
    logits[3, : 2 * V // 3] = float("-inf")
    rows = torch.tensor([4, 0, 2], device=DEVICE)
    at = torch.tensor([7, 1, 4], device=DEVICE)
    d2t = torch.arange(V, device=DEVICE) * 3 + 1
    for r, d in ((None, None), (rows, None), (rows, d2t)):
        m = n if r is None else r.numel()
        ids = torch.full((10,), -5, dtype=torch.long, device=DEVICE)
        cells = at[:m] if r is not None else torch.arange(m, device=DEVICE)
        greedy_draft(logits, ids, cells, r, d, block_v=block_v, max_splits=max_splits)
        want = torch.argmax(logits if r is None else logits[r], dim=-1)
        want = want if d is None else d[want]
        assert torch.equal(ids[cells], want)
        untouched = torch.ones(10, dtype=torch.bool, device=DEVICE)
        untouched[cells] = False
        assert (ids[untouched] == -5).all()


@pytest.mark.parametrize("V", [3, 5003, 70001])
def test_argmax_rows_is_torch_argmax(V):
    """A greedy round's pick (argmax_rows: the split kernel without a gate, each row's cell its own)
    equals torch.argmax bitwise: ties within and across runs (the first wins), a constant row, a
    row -inf but for its last columns, an all -inf row (index 0, as torch's)."""
    logits = _tied_logits(5, V, torch.float32, seed=V)
    logits[3, : V - 2] = float("-inf")
    logits[4] = float("-inf")
    out = torch.full((5,), -5, dtype=torch.long, device=DEVICE)
    assert argmax_rows(logits, out) is out
    assert torch.equal(out, torch.argmax(logits, dim=-1))
    assert torch.equal(argmax_rows(logits[1:3]), torch.argmax(logits[1:3], dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,block_v", [(7, 4096), (1000, 4096), (5003, 4096), (5003, 512)])
def test_greedy_draft_gate_matches_reference(V, block_v, dtype):
    """The gate's update equals the reference's: p_min set just below each row's probability
    keeps it, just above cuts it (so the kernel's probability, summed over runs of the row, is the
    softmax's within 1e-5 relative; a run of -inf adds nothing), a member already cut stays cut and
    counts nothing, head_steps counts the call."""
    n = 4
    logits = (torch.randn(n, V, generator=torch.Generator().manual_seed(V)) * 3).to(dtype).to(DEVICE)
    logits[1, : V // 2] = float("-inf")
    p = torch.softmax(logits.float(), -1).max(-1).values  # [n]
    rows = torch.tensor([3, 1, 0], device=DEVICE)
    for r in (None, rows):
        x = logits if r is None else logits[r]
        q = p if r is None else p[r]
        for scale in (1 - 1e-5, 1 + 1e-5):
            for p_min in q * scale:
                for first in (True, False) if r is None else (False,):
                    outs = []
                    for fn in (partial(greedy_draft, block_v=block_v), greedy_draft_reference):
                        gate = _gate(n, [True, False, True, True])._replace(p_min=float(p_min), first=first)
                        ids = torch.zeros(n, dtype=torch.long, device=DEVICE)
                        fn(logits, ids, torch.arange(x.shape[0], device=DEVICE), r, None, gate)
                        outs.append((ids, gate.live, gate.counted, gate.head_steps))
                    (ids, live, counted, steps), ref = outs
                    for a, b in zip(outs[0], ref, strict=True):
                        assert torch.equal(a, b), (p_min, first, r)
                    passed = q >= p_min
                    members = torch.arange(n, device=DEVICE) if r is None else r
                    was = torch.tensor([True, False, True, True], device=DEVICE)[members]
                    assert torch.equal(live[members], passed if first else passed & was)
                    assert int(steps) == 1


@pytest.mark.parametrize("fn", [greedy_draft, greedy_draft_reference])
def test_a_flagged_off_draft_writes_nothing(fn):
    n, V = 3, 300
    logits = _tied_logits(n, V, torch.float32, seed=1)
    at = torch.arange(n, device=DEVICE)
    results = []
    for flag in (None, False, True):
        ids = torch.full((n,), -1, dtype=torch.long, device=DEVICE)
        gate = _gate(n)._replace(p_min=0.01)
        run_if = None if flag is None else torch.tensor(flag, device=DEVICE)
        fn(logits, ids, at, gate=gate, run_if=run_if)
        results.append((ids, gate.live, gate.counted, gate.head_steps))
    untouched = (torch.full((n,), -1), torch.ones(n, dtype=torch.bool), torch.arange(n) % 3, torch.zeros(1))
    for a, b in zip(results[1], untouched, strict=True):
        assert torch.equal(a.cpu(), b.to(a.dtype)), "a flagged-off call wrote"
    for a, b in zip(results[2], results[0], strict=True):
        assert torch.equal(a, b)
    assert int(results[0][3]) == 1


# ---------------------------------------------------------------------------------------------
# the fused head step under run_if, and the engine's use of both


def _llm(ckpt, k: int, p_min: float = 0.0, kernels: str = "triton", **kw):
    return nextn.LLM(
        model=ckpt, device=DEVICE, dtype="bfloat16", kernels=kernels, num_speculative_tokens=k, p_min=p_min, **kw
    )


def test_a_flagged_off_head_step_writes_nothing(dense_ckpt):
    """runner.when without a conditional node runs the head step with its pred as run_if, which
    every kernel of the step reads: false, its logits, chained hiddens and draft K/V stay as they
    were; true, they equal the unflagged step's bitwise; run_if is unset after."""
    engine = _llm(dense_ckpt, 2, max_model_len=64).engine
    runner, cfg = engine.runner, engine.model.cfg
    H, V = cfg.hidden_size, cfg.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.tensor([5, 77, 300, 9], device=DEVICE)
    hidden = torch.randn(4, H, generator=g).to(DEVICE, runner.dtype)
    cache = runner.slot(0)
    outs, seen = {}, []
    for flag in (None, False, True):
        key, value = cache.draft_kv()[:2]
        key.fill_(0.5)
        value.fill_(0.5)
        logits = torch.full((1, V), 7.0, device=DEVICE)
        chained = torch.full((1, H), 3.0, device=DEVICE, dtype=runner.dtype)
        batch, row = runner.batch([cache], [4]), torch.tensor([2], device=DEVICE)
        pos = torch.tensor([6], dtype=torch.int32, device=DEVICE)

        def head(batch=batch, row=row, pos=pos, logits=logits, chained=chained):
            seen.append(runner.step.run_if)
            runner.step.head(batch, ids, hidden, pos, row, (logits, chained))

        with torch.inference_mode():
            head() if flag is None else runner.when(torch.tensor(flag, device=DEVICE), head)
        outs[flag] = (logits, chained, key.clone(), value.clone())
    assert seen[0] is None and [bool(f) for f in seen[1:]] == [False, True] and runner.step.run_if is None
    assert (outs[False][0] == 7).all() and (outs[False][1] == 3).all()
    assert (outs[False][2] == 0.5).all() and (outs[False][3] == 0.5).all()
    assert not (outs[None][2] == 0.5).all()  # the unflagged step wrote its rows' K
    for a, b in zip(outs[True], outs[None], strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter takes minutes per round of the fused step")
def test_the_engine_skips_cut_head_steps_with_the_flag(dense_fitted_ckpt):
    """The fused step in CUDA graphs (`when`'s flag): greedy spec with p_min equals plain, single
    and batched with another K, and head_steps counts the steps that ran only (the draft kernel
    reads the flag: a skipped step counts nothing)."""
    prompts, params = FIT_PROMPTS[:2], nextn.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = [_llm(dense_fitted_ckpt, 0).generate(prompt_token_ids=list(p), params=params).token_ids for p in prompts]
    llm = _llm(dense_fitted_ckpt, 4, p_min=0.5, trace=True)
    for _ in range(3):  # eager, captured, replayed
        steps = int(llm.engine.proposer.head_steps)
        out = llm.generate(prompt_token_ids=list(prompts[0]), params=params)
        assert out.token_ids == plain[0]
        assert 0 < out.spec.num_zero_draft_rounds and out.spec.num_drafted < 4 * out.spec.num_rounds
        assert int(llm.engine.proposer.head_steps) - steps == sum(1 + min(r.drafted, 3) for r in out.rounds)
    engine = _llm(dense_fitted_ckpt, 4, p_min=0.5, max_num_seqs=2).engine
    for _ in range(3):
        reqs = [engine.add(list(p), params, num_speculative_tokens=k) for p, k in zip(prompts, (4, 2), strict=True)]
        outs = {}
        while len(outs) < len(reqs):
            for req, ev in engine.step():
                if ev.output is not None:
                    outs[reqs.index(req)] = ev.output.token_ids
        assert engine.batch_sizes[2] > 0 and [outs[0], outs[1]] == plain


def test_plain_greedy_members_draft_through_the_fused_step(dense_fitted_ckpt, monkeypatch):
    """A gated plain-greedy draft takes the fused step (argmax, probability and gate in one op;
    the sampler's per-member draft, with its softmax, never runs); any logits transform (here a
    penalty) takes the sampler's draft."""
    from nextn.sample.pipeline import SamplerKind
    from nextn.sample.sampler import SlotSampler

    sampler = SlotSampler.__new__(SlotSampler)
    for kind, plain in (
        (SamplerKind(greedy=True, top_k=True), True),
        (SamplerKind(greedy=True, repetition=True), False),
        (SamplerKind(greedy=True, min_tokens=True), False),
        (SamplerKind(greedy=True, grammar=True), False),
        (SamplerKind(greedy=False), False),
    ):
        sampler.kind = kind
        assert sampler.plain_greedy == plain, kind
    params = nextn.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # the reference engine on the CPU, where runner.when skips a cut step (on a GPU it runs them all)
    ref = dict(model=dense_fitted_ckpt, device="cpu", dtype="bfloat16", kernels="torch")
    llm = nextn.LLM(**ref, num_speculative_tokens=3, p_min=0.5, trace=True)
    want = nextn.LLM(**ref, num_speculative_tokens=0).generate(prompt_token_ids=list(FIT_PROMPTS[0]), params=params)

    def no_draft(*a, **k):
        raise AssertionError("the sampler's draft ran")

    monkeypatch.setattr(SlotSampler, "draft", no_draft)
    out = llm.generate(prompt_token_ids=list(FIT_PROMPTS[0]), params=params)
    assert out.token_ids == want.token_ids and out.spec.num_drafted < 3 * out.spec.num_rounds
    assert int(llm.engine.proposer.head_steps) == sum(1 + min(r.drafted, 2) for r in out.rounds)
    penalized = nextn.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, repetition_penalty=1.1)
    with pytest.raises(AssertionError, match="the sampler's draft ran"):
        llm.generate(prompt_token_ids=list(FIT_PROMPTS[0]), params=penalized)


@pytest.mark.parametrize("reduced", [False, True])
def test_the_fused_draft_step_drafts_what_the_sampler_drafts(dense_fitted_ckpt, monkeypatch, reduced):
    """Greedy rounds gated at p_min draft, cut and emit the same through the fused step as through
    the sampler's per-member draft (softmax, gather, compare), over the full vocabulary and a
    draft vocabulary (picks mapped through d2t), alone and batched with another K."""
    from nextn.sample.sampler import SlotSampler
    from nextn.spec.draft_vocab import DraftVocab

    V = _llm(dense_fitted_ckpt, 0, kernels="torch").model.cfg.vocab_size
    vocab = DraftVocab.first(3 * V // 4, V) if reduced else None
    params = nextn.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run():
        engine = _llm(dense_fitted_ckpt, 4, p_min=0.5, kernels="torch", max_num_seqs=2, draft_vocab=vocab).engine
        outs = []
        for batch in ([0], [1], [0, 1]):
            reqs = [engine.add(list(FIT_PROMPTS[i]), params, num_speculative_tokens=4 - 2 * i) for i in batch]
            done = {}
            while len(done) < len(reqs):
                for req, ev in engine.step():
                    if ev.output is not None:
                        done[reqs.index(req)] = (ev.output.token_ids, ev.output.spec)
            outs.append([done[i] for i in range(len(reqs))])
        return outs

    fused = run()
    monkeypatch.setattr(SlotSampler, "plain_greedy", property(lambda self: False))
    assert run() == fused
    assert sum(spec.num_zero_draft_rounds for batch in fused for _, spec in batch) > 0
