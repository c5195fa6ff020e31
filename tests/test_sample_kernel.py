"""The one-launch sampling kernels (nextn.sample.triton_sample) against their references: the
temperature law and its draw (nextn.sample.pipeline.probs_from_logits, sample), the round's rejection
sampling (nextn.sample.verifier.verify_sampled), the slot sampler drafting and verifying through
them as through the reference, and a greedy round's accept and commit (nextn.engine.device_round).

On CPU the kernels run under Triton's interpreter (triton_interp.py); on a GPU compiled.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import triton_interp  # noqa: F401  (before triton)

pytest.importorskip("triton")

import nextn  # noqa: E402
from nextn.cache.hybrid import NUM_CTL, commit_table  # noqa: E402
from nextn.engine import device_round  # noqa: E402
from nextn.sample import triton_common, triton_sample, triton_wide, verifier  # noqa: E402
from nextn.sample.pipeline import (  # noqa: E402
    Law,  # noqa: E402
    RequestRng,
    SamplingParams,
    Stream,
    probs_from_logits,
    sample,
)
from nextn.sample.sampler import SlotSampler  # noqa: E402
from nextn.sample.triton_sample import MAX_V, GreedyGroup, accept_greedy, temperature_sample, verify_sampled  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [1, 7, 1000, 5003, 20000])
def test_temperature_sample_is_the_reference_law_and_draw(V, dtype):
    g = torch.Generator().manual_seed(V)
    N = 8
    logits = (torch.randn(N, V, generator=g) * 3).to(dtype)
    if V > 2:
        logits[1, : V // 2] = float("-inf")  # masked tokens (a ban, a grammar): never drawn
    u = torch.rand(N, generator=g, dtype=torch.float64)
    u[0] = 1.0 - 2.0**-53  # the top of the CDF: the last token with mass
    for t in (0.3, 1.0, 2.5):
        temperature = torch.tensor(t, device=DEVICE)
        probs, ids = temperature_sample(logits.to(DEVICE), Law(temperature), u.to(DEVICE))
        want = torch.softmax(logits.float() / torch.tensor(t), dim=-1)
        assert torch.allclose(probs.cpu(), want, rtol=1e-5, atol=1e-7)
        assert torch.equal(ids.cpu()[1:], sample(want, u)[1:])
        # at the CDF's top the two float64 sums may stop rising at different tail tokens (a tiny
        # mass is lost or kept by the order of the sum): either way a token with mass
        assert want[0, ids[0]] > 0
        if V > 2:
            assert ids[1] >= V // 2
        law, none = temperature_sample(logits.to(DEVICE), Law(temperature))
        assert none is None and torch.equal(law, probs)


FILTERS = [
    dict(top_k=8),
    dict(top_k=1),
    dict(top_k=100000),  # above V: every token
    dict(top_p=0.8),
    dict(top_k=50, top_p=0.3),
    dict(min_p=0.05),
    dict(top_k=12, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("V", [1000, 5003])
def test_the_filtered_law_keeps_what_the_reference_keeps(V, tied):
    """top-k, top-p and min-p (and their combinations) keep the tokens the reference's stable sort
    keeps, ties included (logits on a coarse grid tie often, at the cut too), and draw the same."""
    g = torch.Generator().manual_seed(V + tied)
    N = 6
    logits = torch.randn(N, V, generator=g) * 3
    if tied:
        logits = (logits * 2).round() / 2
    u = torch.rand(N, generator=g, dtype=torch.float64)
    for f in FILTERS:
        params = SamplingParams(temperature=0.8, **f)
        want = probs_from_logits(logits, params)
        dev = dict(
            top_k=torch.tensor(params.top_k, device=DEVICE) if "top_k" in f else None,
            top_p=torch.tensor(params.top_p, device=DEVICE) if "top_p" in f else None,
            min_p=torch.tensor(params.min_p, device=DEVICE) if "min_p" in f else None,
        )
        probs, ids = temperature_sample(logits.to(DEVICE), Law(torch.tensor(0.8, device=DEVICE), **dev), u.to(DEVICE))
        assert torch.equal(probs.cpu() > 0, want > 0), f
        assert torch.allclose(probs.cpu(), want, rtol=1e-5, atol=1e-7), f
        assert torch.equal(ids.cpu(), sample(want, u)), f
    assert (want > 0).sum(-1).max() < V  # the filters cut


def test_the_draw_never_lands_on_an_entry_without_mass():
    """`inverse_cdf`, the draw of both kernel families, given running sums as a GPU's parallel scan
    can leave them (run 113: padded entries of no mass summed one ulp above the last real entry,
    and a count of sums below the point returned an index past the row): the first entry with
    mass past the point, else the last entry with mass, wherever the sums stand."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(cdf_ptr, mass_ptr, t_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        positive = tl.load(mass_ptr + i) != 0
        tl.store(out_ptr, triton_common.inverse_cdf(tl.load(cdf_ptr + i), positive, tl.load(t_ptr)))

    def draw(cdf, mass, t):
        out = torch.zeros((), dtype=torch.long, device=DEVICE)
        cdf = torch.tensor(cdf, dtype=torch.float64, device=DEVICE)
        probe[(1,)](cdf, torch.tensor(mass, device=DEVICE), torch.tensor(t, dtype=torch.float64, device=DEVICE), out, 8)
        return int(out)

    mass = [1, 0, 1, 1, 0, 0, 0, 0]  # entries 4..7: no mass (padding)
    ulp_above = 0.75 + 2.0**-53
    for t, want in ((0.1, 0), (0.25, 2), (0.5, 3), (0.74, 3), (0.75, 3), (0.9, 3)):
        assert draw([0.25, 0.25, 0.5, 0.75, 0.75, 0.75, 0.75, 0.75], mass, t) == want, t
        assert draw([0.25, 0.25, 0.5, 0.75, ulp_above, ulp_above, ulp_above, ulp_above], mass, t) == want, t
    assert draw([0.2, 0.2, 0.5, 0.49, 0.49, 0.49, 0.49, 0.49], mass, 0.495) == 2  # a scan that falls by rounding


def test_rows_wider_than_one_program_are_refused():
    wide = torch.zeros(1, MAX_V + 1, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        temperature_sample(wide, Law(torch.tensor(1.0, device=DEVICE)))


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("K", [0, 1, 3, 5])
def test_fused_verify_is_the_reference_rejection_sampling(K, chunked):
    """n and the emitted ids equal verify_sampled's for sampled drafts, greedy drafts (q one-hot),
    drafts equal to the target (every one accepted), drafts of zero target mass, and every count of
    drafts that count (a gate's cut), the uniforms read from the request's table at its index;
    chunked: nextn.sample.triton_wide's kernels, the 300 columns in chunks of 64."""
    verify = partial(triton_wide.verify_sampled, chunk=64) if chunked else verify_sampled
    g = torch.Generator().manual_seed(K)
    V, table = 300, RequestRng(11).table(0, 64)
    for case in range(12):
        p = torch.softmax(torch.randn(K + 1, V, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(K, V, generator=g) * 2, -1)
        drafts = torch.randint(0, V, (K,), generator=g)
        if case % 3 == 1:  # q == p at the target's argmax: every draft accepted, the bonus drawn
            q, drafts = p[:K].clone(), p[:K].argmax(-1)
        if case % 3 == 2 and K:  # a draft the target gives no mass: rejected
            p[0, drafts[0]] = 0.0
        start = 3 * case
        for draft_probs in (q, None):
            for counted in range(K + 1):
                want = verifier.verify_sampled(
                    p,
                    draft_probs,
                    drafts,
                    table[Stream.ACCEPT, start : start + K],
                    table[Stream.SAMPLE, start : start + K + 1],
                    torch.tensor(counted),
                )
                for num in (torch.tensor(counted, device=DEVICE), counted):
                    n, out = verify(
                        p.to(DEVICE),
                        None if draft_probs is None else draft_probs.to(DEVICE),
                        drafts.to(DEVICE),
                        table.to(DEVICE),
                        torch.tensor(start, dtype=torch.int32, device=DEVICE),
                        num,
                    )
                    assert int(n) == int(want.num_accepted) and torch.equal(out.cpu(), want.out_ids), (case, counted)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("penalized", [False, True])
def test_the_slot_sampler_drafts_and_verifies_through_the_kernels_as_through_the_reference(
    dense_fitted_ckpt, penalized, wide, monkeypatch
):
    """A fast SlotSampler (the Triton backend's) draws the drafts, their q and the round's outcome
    the reference sampler draws, for a temperature law and filtered ones, with and without
    penalties; wide: with the vocabulary above MAX_V (lowered to the test model's size) it takes the
    chunked kernels (nextn.sample.triton_wide, at 64-column chunks)."""
    llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=3)
    V, cache, dev = llm.model.cfg.vocab_size, llm.engine.runner.slot(0), llm.engine.runner.device
    if wide:
        monkeypatch.setattr(triton_sample, "MAX_V", V - 1)
        monkeypatch.setattr(triton_wide, "CHUNK", 64)
        monkeypatch.setattr(triton_wide, "KCAP", 16)
    g = torch.Generator().manual_seed(5)
    extra = dict(repetition_penalty=1.3, frequency_penalty=0.2) if penalized else {}
    for params in (
        nextn.SamplingParams(temperature=0.8, seed=3, **extra),
        nextn.SamplingParams(temperature=0.8, top_k=9, seed=3),
        nextn.SamplingParams(temperature=0.8, top_k=9, top_p=0.9, seed=3),
    ):
        outcomes = []
        for fast in (False, True):
            sampler = SlotSampler(cache, 0.0, fast=fast)
            sampler.start(params, [1, 2, 3, 2])
            assert sampler.kernels is (None if not fast else triton_wide if wide else triton_sample)
            head = (torch.randn(3, V, generator=g.manual_seed(1)) * 2).to(dev)
            trunk = (torch.randn(4, V, generator=g) * 2).to(dev)
            ids, q = torch.zeros(4, dtype=torch.long, device=dev), torch.zeros(3, V, device=dev)
            with torch.inference_mode():
                for j in range(3):
                    u = torch.tensor([0.1 + 0.3 * j], dtype=torch.float64, device=dev)
                    sampler.draft(head[j : j + 1], ids[1 : 1 + j], u, ids[1 + j : 2 + j], q[j : j + 1])
                index = torch.tensor(2, dtype=torch.int32, device=dev)
                n, out = sampler.verify(trunk, ids[1:], q, torch.tensor(3, device=dev), index)
            outcomes.append((ids.clone(), q.clone(), int(n), out.clone()))
        (ids0, q0, n0, out0), (ids1, q1, n1, out1) = outcomes
        assert torch.equal(ids0, ids1) and n0 == n1 and torch.equal(out0, out1)
        assert torch.allclose(q0, q1, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("heads", [False, True])
def test_greedy_accept_kernel_is_its_reference_bitwise(heads):
    """One launch accepts and commits a batch's greedy members as device_round._accept_greedy's torch ops
    do: the pending token, head ids, counters and outcome rows of their slots, bit for bit; other
    slots untouched. Members draft 0..5 tokens, their drafts the argmax of the row before for a
    random prefix, a gate cutting one member's count, the group a subset of the batch."""
    from types import SimpleNamespace as NS

    g = torch.Generator().manual_seed(7 + heads)
    S, R, V = 6, 6, 40
    slots, ks, counts = [4, 0, 2, 5], [0, 3, 5, 2], [0, 2, 5, 2]  # a gate cut the second from 3 to 2
    index = [1, 2, 4, 5]  # the group's members' places in the batch (0 and 3: sampled members)
    offsets = [0, 3, 4, 8, 9, 15]  # each batch member's first packed row
    logits = torch.randn(18, V, generator=g).to(DEVICE)
    target = logits.argmax(-1).cpu()
    base = {
        "verify_ids": torch.randint(0, V, (S, R), generator=g),
        "head_ids": torch.randint(0, V, (S, R), generator=g),
        "ctl": torch.randint(0, 500, (S, NUM_CTL), generator=g, dtype=torch.int32),
        "out": torch.randint(-5, 5, (S, 2 + R + NUM_CTL), generator=g),
    }
    for slot, k, b in zip(slots, ks, index, strict=True):  # a random prefix of drafts matches
        keep = int(torch.randint(0, k + 1, (), generator=g))
        base["verify_ids"][slot, 1 : 1 + keep] = target[offsets[b] : offsets[b] + keep]
    befores = torch.randint(0, 500, (len(offsets), NUM_CTL), generator=g, dtype=torch.int32).to(DEVICE)
    ix = lambda v: torch.tensor(v, dtype=torch.long, device=DEVICE)  # noqa: E731
    runner = NS(index=ix, config=NS(kernels="torch"))
    fast, ref = ({k: v.clone().to(DEVICE) for k, v in base.items()} for _ in range(2))
    cache = NS(rows=7, cols=3)
    group = [
        NS(cache=NS(slot=slot, cache=NS(tensors=ref), rows=7, cols=3), buf=NS(verify_ids=ref["verify_ids"][slot]), k=k)
        for slot, k in zip(slots, ks, strict=True)
    ]

    class Batch(NS):  # the step batch's offsets and device slots (the sampled members' in slots 1 and 3)
        def __len__(self):
            return len(offsets)

    batch = Batch(offsets=offsets, slot_index=ix([1, 4, 0, 3, 2, 5]))
    members, num_drafts = [None] * len(offsets), [0] * len(offsets)  # the batch's (0 and 3: sampled members)
    for b, member, count in zip(index, group, counts, strict=True):
        members[b], num_drafts[b] = member, count
    verified = device_round._Verified(batch, befores, logits, ix(num_drafts), heads)
    device_round._accept_greedy(runner, verified, members, index)
    table = commit_table(cache.cols, True, True, logits.device)
    group = GreedyGroup(ix([offsets[b] for b in index]), ix(slots), ix(ks), ix(counts), ix(index))
    accept_greedy(logits.argmax(-1), group, befores, fast, table, heads)
    for name in base:
        assert torch.equal(fast[name], ref[name]), name
    n = fast["out"][slots, 0].tolist()
    assert 0 in n and max(n) >= 2 and not torch.equal(ref["ctl"], base["ctl"].to(DEVICE))  # cases that test something
    assert torch.equal(fast["verify_ids"][[1, 3]], base["verify_ids"][[1, 3]].to(DEVICE))


def test_keep_verify_rows_is_the_index_copy_pairs():
    """A round's verify rows kept in the slots in one launch (triton_sample.keep_verify_rows) as
    device_round's reference does it: each member's slot rows to prev_logits / prev_hidden, then its
    rows 0..k the verify's packed rows; other slots, and a member's rows past k, untouched. V and H
    not multiples of the block (several blocks of V a row), bf16 hiddens."""
    g = torch.Generator().manual_seed(3)
    S, R, V, H = 5, 4, 700, 96
    slots, ks = [3, 0, 4], [1, 3, 0]
    offsets = [0, 2, 6, 7]
    base = {
        "logits": torch.randn(S, R, V, generator=g),
        "prev_logits": torch.randn(S, R, V, generator=g),
        "hidden": torch.randn(S, R, H, generator=g).bfloat16(),
        "prev_hidden": torch.randn(S, R, H, generator=g).bfloat16(),
    }
    logits, hidden = torch.randn(offsets[-1], V, generator=g), torch.randn(offsets[-1], H, generator=g).bfloat16()
    fast, ref = ({k: v.clone().to(DEVICE) for k, v in base.items()} for _ in range(2))
    ix = lambda v: torch.tensor(v, dtype=torch.long, device=DEVICE)  # noqa: E731
    flat = ix([slot * R + i for slot, k in zip(slots, ks, strict=True) for i in range(k + 1)])
    for name, new in (("logits", logits), ("hidden", hidden)):
        ref[f"prev_{name}"].index_copy_(0, ix(slots), ref[name].index_select(0, ix(slots)))
        ref[name].flatten(0, 1).index_copy_(0, flat, new.to(DEVICE))
    triton_sample.keep_verify_rows(
        fast, logits.to(DEVICE), hidden.to(DEVICE), ix(slots), ix(offsets[:-1]), ix(ks), block=256
    )
    for name in base:
        assert torch.equal(fast[name], ref[name]), name
    assert torch.equal(fast["logits"][0, 3], logits[5].to(DEVICE))  # a member's last row, k = 3
    assert torch.equal(fast["logits"][3, 2:], base["logits"][3, 2:].to(DEVICE))  # past k: untouched
    assert torch.equal(fast["prev_logits"][1], base["prev_logits"][1].to(DEVICE))  # not a member's slot


def test_greedy_accept_kernel_restores_the_pads_counters():
    """With every member in the group, the fused accept also restores the pad members' counters
    (device_round._accept_greedy's torch.where over the committed counters): the pads' ctl rows are
    their befores, the others' are committed as without pads."""

    g = torch.Generator().manual_seed(11)
    S, R, V = 5, 4, 30
    slots, ks = [2, 0, 4, 1], [3, 3, 0, 2]
    offsets = [0, 4, 8, 9, 12]
    pads = torch.tensor([False, True, False, True], device=DEVICE)
    logits = torch.randn(offsets[-1], V, generator=g).to(DEVICE)
    base = {
        "verify_ids": torch.randint(0, V, (S, R), generator=g),
        "head_ids": torch.randint(0, V, (S, R), generator=g),
        "ctl": torch.randint(0, 500, (S, NUM_CTL), generator=g, dtype=torch.int32),
        "out": torch.randint(-5, 5, (S, 2 + R + NUM_CTL), generator=g),
    }
    befores = base["ctl"][slots].to(DEVICE)
    ix = lambda v: torch.tensor(v, dtype=torch.long, device=DEVICE)  # noqa: E731
    fast, ref = ({k: v.clone().to(DEVICE) for k, v in base.items()} for _ in range(2))
    index = list(range(len(slots)))
    group = GreedyGroup(ix(offsets[:-1]), ix(slots), ix(ks), ix(ks), ix(index))
    table = commit_table(3, True, True, logits.device)
    accept_greedy(logits.argmax(-1), group, befores, ref, table, True)
    ref["ctl"].index_copy_(0, ix(slots), torch.where(pads[:, None], befores, ref["ctl"].index_select(0, ix(slots))))
    accept_greedy(logits.argmax(-1), group, befores, fast, table, True, pads)
    for name in base:
        assert torch.equal(fast[name], ref[name]), name
    assert torch.equal(fast["ctl"][[0, 1]], befores[[1, 3]])  # the pads' slots: as the round started
    assert not torch.equal(fast["ctl"][[2, 4]], befores[[0, 2]])  # the others committed


@pytest.mark.parametrize("tables", [(), (4,), (4, 1)])
def test_followed_batch_refresh_in_one_launch_is_the_torch_ops(tables):
    """A followed step batch re-derived from its device slots by `triton_sample.follow_slots`
    (StepBatch.refresh(fused=True), a launch a flat-row table) equals the torch ops' refresh: the
    per-sequence slots (int32 and long), each row's slot and every flat-row table, for slots other
    than the ones the batch was made with."""
    from types import SimpleNamespace as NS

    from nextn.cache.hybrid import StepBatch

    ctl = torch.zeros(9, NUM_CTL, dtype=torch.int32, device=DEVICE)
    caches = [NS(slot=s, cache=NS(ctl=ctl)) for s in (0, 1, 2)]
    rows = [3, 1, 4]
    batches = [StepBatch(caches, rows) for _ in range(2)]
    src = torch.tensor([7, 2, 5], dtype=torch.int32, device=DEVICE)
    for batch, fused in zip(batches, (False, True), strict=True):
        for R in tables:
            batch.flat_rows(R)
        batch.follow(src)
        batch.refresh(caches, fused=fused)
    ref, fast = batches
    for name in ("seqs", "slot_index", "row_slot"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert fast._flat.keys() == ref._flat.keys() and all(torch.equal(fast._flat[R], ref._flat[R]) for R in tables)
    assert fast.slot_index.tolist() == [7, 2, 5] and fast.row_slot.tolist() == [7, 7, 7, 2, 5, 5, 5, 5]
    if 4 in tables:
        assert fast._flat[4].tolist() == [28, 29, 30, 8, 20, 21, 22, 23]
