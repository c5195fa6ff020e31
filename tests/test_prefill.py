"""Prefill in steps ("steps", the server's default): one step over every prompt piece of an engine
step, any number of rows per sequence, with the decode step's per-row arithmetic. A prompt
prefilled whole, in uneven pieces batched beside another prompt's, or decoded one token a step
leaves the same bits in its slot: K/V, GDN states, the trunk's last hidden and logits, and the
MTP head's draft K/V. That is what makes a resumed session (and a cached prefix) equal a cold run.

On CPU the Triton kernels run under Triton's interpreter (triton_interp.py); on a GPU natively.
"""

from __future__ import annotations

import functools
from itertools import pairwise

import pytest
import torch
import triton_interp  # noqa: F401  (before triton)
from bit_patterns import bits

import nextn
from nextn.config import FULL
from nextn.engine.riding import Piece
from nextn.engine.sequence import Sequence

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [(7 * i + 3) % 251 + 2 for i in range(22)]
OTHER = [(11 * i + 5) % 241 + 3 for i in range(13)]
LONG = [(5 * i + 1) % 239 + 4 for i in range(80)]  # (past a chunk of the delta rule: 64 rows)


@functools.lru_cache(maxsize=4)
def _engine(ckpt, kernels, prefill="steps"):
    if kernels == "triton":
        pytest.importorskip("triton")
    llm = nextn.LLM(
        model=ckpt,
        device=DEVICE,
        dtype="bfloat16",
        kernels=kernels,
        num_speculative_tokens=2,
        max_model_len=96,
        max_num_seqs=3,
        prefill=prefill,
    )
    return llm.engine


def _fresh(runner, slot):
    runner.slot(slot).reset()
    return Sequence(slot, heads=True)


def _state(runner, seq):
    """Everything the slot holds for its committed tokens, on the host."""
    runner.fold([seq.slot])  # pending GDN rows as the step folds them
    cache, n, cfg = runner.slot(seq.slot), len(seq.tokens), runner.cfg
    out = {"hidden": seq.last_hidden, "logits": seq.last_logits}
    for i, kind in enumerate(cfg.layer_types):
        if kind == FULL:
            kv = cache.kv(i)
            out[f"kv{i}"] = torch.cat([kv.key[:n].flatten(), kv.value[:n].flatten()])
        else:
            conv, state = cache.committed_gdn(i)
            out[f"conv{i}"], out[f"state{i}"] = conv.clone(), state.clone()
    draft = cache.draft_kv()
    out["draft"] = torch.cat([draft.key[: n - 1].flatten(), draft.value[: n - 1].flatten()])
    return {k: v.float().cpu() for k, v in out.items()}


def _decoded(runner, seq, prompt):
    """The prompt one token a step (a prefill piece of one row: a decode's rows)."""
    for t in prompt:
        runner.prefill([Piece(seq, [t])])


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_prefill_steps_are_bitwise_whatever_the_pieces(dense_fitted_ckpt, kernels):
    engine = _engine(dense_fitted_ckpt, kernels)
    runner = engine.runner
    with torch.inference_mode():
        whole = _fresh(runner, 0)
        runner.prefill([Piece(whole, PROMPT)])
        expected = _state(runner, whole)
        # uneven pieces, batched with another sequence's pieces in the same steps
        split, other = _fresh(runner, 1), _fresh(runner, 2)
        cuts = [0, 1, 19, len(PROMPT)]  # (a piece of more rows than a verify's STEP_ROWS)
        other_cuts = [0, 9, 10, len(OTHER)]
        for (lo, hi), (olo, ohi) in zip(pairwise(cuts), pairwise(other_cuts), strict=True):
            runner.prefill([Piece(other, OTHER[olo:ohi]), Piece(split, PROMPT[lo:hi])])
        got = _state(runner, split)
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"{name}: pieces differ from a whole prefill"
        # one token a step: the decode's arithmetic
        decoded = _fresh(runner, 1)
        _decoded(runner, decoded, PROMPT)
        got = _state(runner, decoded)
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"{name}: a one-row-a-step prefill differs from a whole one"
        # the other sequence too equals its whole prefill
        alone = _fresh(runner, 0)
        runner.prefill([Piece(alone, OTHER)])
        mine, theirs = _state(runner, alone), _state(runner, other)
        assert all(torch.equal(mine[name], theirs[name]) for name in mine)


def test_a_resumed_session_equals_a_cold_run(dense_fitted_ckpt):
    """A kept session's next turn (its first turn's prompt and output cached, the rest prefilled in
    one step) emits what a cold run of the whole prompt, prefilled in one step, emits."""
    engine = _engine(dense_fitted_ckpt, "torch")
    params = nextn.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = engine.add(PROMPT[:14], params, use_sessions=True)
    out = None
    while out is None:
        for r, ev in engine.step():
            if r is first and ev.output is not None:
                out = ev.output
    resumed_prompt = PROMPT[:14] + out.token_ids + OTHER[:9]
    outputs = {}
    for use_sessions in (True, False):
        req = engine.add(resumed_prompt, params, use_sessions=use_sessions)
        while req.request_id not in outputs:
            for r, ev in engine.step():
                if r is req and ev.output is not None:
                    outputs[r.request_id] = (ev.output.token_ids, ev.output.cached_tokens)
    (warm, cached), (cold, none) = outputs.values()
    assert cached > 14 and none == 0
    assert warm == cold


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_mixed_step_gives_each_sequence_its_own_step(dense_fitted_ckpt, kernels, chunked):
    """A mixed trunk step (verify rows of one sequence, then a prompt piece of another: StepBatch's
    pieces_from) gives each what its own step gives, bit for bit: the verify's logits and hiddens,
    the piece's last logits and hiddens, and every cache buffer the two steps write (the verify's
    GDN states, gates and window, the piece's last state and columns, both sequences' K/V); so does
    one whose piece runs the chunked rule (StepBatch.chunked) against its chunked step alone."""
    from nextn.cache import StepBatch

    engine = _engine(dense_fitted_ckpt, kernels)
    runner, V, H = engine.runner, engine.runner.cfg.vocab_size, engine.runner.cfg.hidden_size
    with torch.inference_mode():
        verifying, piece = _fresh(runner, 0), _fresh(runner, 1)
        runner.prefill([Piece(verifying, PROMPT), Piece(piece, OTHER[:4])])
        slots, R, rest = [runner.slot(0), runner.slot(1)], runner.slot(0).rows, OTHER[4:]
        v_ids, n = [PROMPT[3], PROMPT[5], PROMPT[8]][:R], len(rest)
        ids = torch.tensor(v_ids + rest, device=DEVICE)
        tensors = runner.pool.cache.tensors
        before = {k: t.clone() for k, t in tensors.items()}
        top = max(len(PROMPT) + R, 4 + n)

        def buffers(rows):
            return torch.empty(rows, V, device=DEVICE), torch.empty(R + n, H, device=DEVICE, dtype=torch.bfloat16)

        # each alone: a verify step (every state kept), then a prefill step of the piece (its last kept)
        lv, hv = buffers(R)
        runner.step.trunk(StepBatch(slots[:1], [R]), ids[:R], lv, hv[:R])
        lp, hp = buffers(1)
        last = torch.tensor([n - 1], device=DEVICE)
        piece_step = StepBatch(slots[1:], [n], max_pos=top, chunked=chunked)
        runner.step.trunk(piece_step, ids[R:], lp, hp[:n], store_all=False, logit_rows=last)
        alone = {k: t.clone() for k, t in tensors.items()}
        for k, t in tensors.items():
            t.copy_(before[k])
        # one mixed step
        lm, hm = buffers(R + 1)
        rows = torch.tensor([*range(R), R + n - 1], device=DEVICE)
        mixed = StepBatch(slots, [R, n], max_pos=top, pieces_from=1, chunked=chunked)
        runner.step.trunk(mixed, ids, lm, hm, logit_rows=rows)
        assert torch.equal(lm[:R], lv) and torch.equal(lm[R:], lp)
        assert torch.equal(hm[:R], hv[:R]) and torch.equal(hm[R:], hp[:n])
        for k, t in tensors.items():
            assert torch.equal(bits(t), bits(alone[k])), k
        assert not all(torch.equal(bits(alone[k]), bits(before[k])) for k in tensors)  # (the steps wrote)
        with pytest.raises(ValueError, match="mixed step"):
            runner.step.trunk(StepBatch(slots, [R, n], pieces_from=1), ids, lm, hm, store_all=False)
        with pytest.raises(ValueError, match="no pieces from 2"):
            StepBatch(slots, [R, n], pieces_from=2)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_resplit_mixed_step_with_a_pad_piece_gives_each_sequence_its_own_step(dense_fitted_ckpt, kernels):
    """A chunked mixed step as a mixed round's graph runs it: made for one split of its pieces (a piece
    of 40 rows and a pad of 24 on a reset slot, 2 chunks in all), then resplit to the step's own (the
    piece's 9 rows, a pad of 55: StepBatch.resplit, the chunk layout and every split tensor rewritten,
    the slot tensors refreshed as a replay refreshes them) gives the verify rows and the piece what
    their own steps give, bit for bit, and the two sequences' slots what those steps write: the pad
    changes no row but its own (the Triton step reads the split from the device tensors alone)."""
    from nextn.cache import StepBatch

    engine = _engine(dense_fitted_ckpt, kernels, "chunked")
    runner, V, H = engine.runner, engine.runner.cfg.vocab_size, engine.runner.cfg.hidden_size
    with torch.inference_mode():
        verifying, piece, _ = _fresh(runner, 0), _fresh(runner, 1), _fresh(runner, 2)
        runner.prefill([Piece(verifying, PROMPT), Piece(piece, OTHER[:4])])
        slots, R, rest = [runner.slot(s) for s in range(3)], runner.slot(0).rows, OTHER[4:]
        v_ids, n, pad = [PROMPT[3], PROMPT[5], PROMPT[8]][:R], len(rest), 64 - len(rest)
        ids = torch.tensor(v_ids + rest + [0] * pad, device=DEVICE)
        tensors = runner.pool.cache.tensors
        before = {k: t.clone() for k, t in tensors.items()}
        top = len(PROMPT) + 64

        def buffers(rows):
            return torch.empty(rows, V, device=DEVICE), torch.empty(R + n + pad, H, device=DEVICE, dtype=torch.bfloat16)

        lv, hv = buffers(R)
        runner.step.trunk(StepBatch(slots[:1], [R]), ids[:R], lv, hv[:R])
        lp, hp = buffers(1)
        alone_piece = StepBatch(slots[1:2], [n], max_pos=top, chunked=True)
        last = torch.tensor([n - 1], device=DEVICE)
        runner.step.trunk(alone_piece, ids[R : R + n], lp, hp[:n], store_all=False, logit_rows=last)
        alone = {k: t.clone() for k, t in tensors.items()}
        for k, t in tensors.items():
            t.copy_(before[k])
        mixed = StepBatch(slots, [R, 40, 24], max_pos=top, pieces_from=1, chunked=True, chunks=2)
        layout, _ = mixed.chunk_layout(1, 3), mixed.flat_rows(R)
        mixed.follow(torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE))
        assert StepBatch.sizes([R, 40, 24], 1, True, 2) == StepBatch.sizes([R, n, pad], 1, True, 2)
        mixed.resplit([R, n, pad])
        mixed.refresh(slots, fused=kernels == "triton")
        assert layout.starts.tolist() == [0, 1, 2] and mixed.chunk_layout(1, 3) is layout
        lm, hm = buffers(R + 1)
        rows = torch.tensor([*range(R), R + n - 1], device=DEVICE)
        runner.step.trunk(mixed, ids, lm, hm, logit_rows=rows)
        assert torch.equal(lm[:R], lv) and torch.equal(lm[R:], lp)
        assert torch.equal(hm[:R], hv[:R]) and torch.equal(hm[R : R + n], hp[:n])
        for k, t in tensors.items():  # (slot 2, the pad's, holds what the pad wrote)
            assert torch.equal(bits(t[:2]), bits(alone[k][:2])), k


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_chunked_pieces_are_each_alone_and_cut_at_whole_chunks(dense_fitted_ckpt, kernels):
    """Prompt pieces whose GDN rows run by the chunked delta rule (StepBatch.chunked: tensor-core chunks
    of 64 rows from each piece's first) give each piece what it gives alone, beside a piece of
    another length (padded to it in the Triton step), bit for bit: its K/V, last GDN state and conv
    columns, last hidden and logits, draft K/V. A prompt cut at a whole chunk ends where the whole
    prompt does. Its bits are not the decode step's (a "steps" prefill, the recurrence row by row),
    but its values are, within what summing otherwise moves (the GDN states to 1e-3; whereas the
    Triton and torch kernels of this bfloat16 model differ by 0.3 in a hidden, either way)."""
    runner = _engine(dense_fitted_ckpt, kernels, "chunked").runner
    with torch.inference_mode():
        whole = _fresh(runner, 0)
        runner.prefill([Piece(whole, LONG)])
        expected = _state(runner, whole)
        cut, other = _fresh(runner, 1), _fresh(runner, 2)
        runner.prefill([Piece(cut, LONG[:64]), Piece(other, OTHER)])
        runner.prefill([Piece(cut, LONG[64:])])
        got = _state(runner, cut)
        for name, value in expected.items():
            assert torch.equal(bits(got[name]), bits(value)), f"{name}: a cut at 64 rows differs from the whole prompt"
        alone = _fresh(runner, 0)
        runner.prefill([Piece(alone, OTHER)])
        mine, theirs = _state(runner, alone), _state(runner, other)
        for name, value in mine.items():
            assert torch.equal(bits(theirs[name]), bits(value)), f"{name}: a piece beside another differs from alone"
        stepping = _engine(dense_fitted_ckpt, kernels).runner  # ("steps": the recurrence)
        steps = _fresh(stepping, 1)
        stepping.prefill([Piece(steps, LONG)])
        recurrent = _state(stepping, steps)
        gdn = [name for name in expected if name.startswith("state")]
        assert not all(torch.equal(bits(recurrent[name]), bits(expected[name])) for name in gdn)
        for name, value in expected.items():  # (the same recurrence, summed otherwise)
            tol = 1e-3 if name in gdn else 5e-2
            torch.testing.assert_close(recurrent[name], value, rtol=tol, atol=tol, msg=name)
