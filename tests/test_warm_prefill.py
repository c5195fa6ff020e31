"""The engine compiles a "steps" prefill's kernel variants before any request
(ModelRunner.warm_prefill, run at start where rounds are graphed), so no request waits on a compile:
a served request that met a new variant waited a second or more for it (bench/NOTES.md, run 145's
p99 TTFT of 2.3 s). On the CPU the interpreter compiles nothing, so the keys a GPU would compile
are computed from each launch (tests/compile_keys.py)."""

from __future__ import annotations

import torch
from compile_keys import CompileKeys

import nextn
from nextn.engine import runner as runner_module
from nextn.ops import triton_linear


def _llm(ckpt):
    return nextn.LLM(
        model=str(ckpt),
        device="cpu",
        dtype="bfloat16",
        kernels="triton",
        num_speculative_tokens=2,
        max_num_seqs=3,
        max_model_len=512,
        prefill="steps",
    )


def _outputs(engine, prompts):
    params = nextn.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    reqs = [engine.add(p, params, detokenize=False) for p in prompts]
    done = {}
    while engine.has_work:
        for r, ev in engine.step():
            if ev.output is not None:
                done[r.request_id] = ev.output.token_ids
    return [done[r.request_id] for r in reqs]


def test_prefill_after_the_warm_up_compiles_nothing(dense_ckpt, monkeypatch):
    """After warm_prefill, prefills of one row, a few rows and past WIDE_ROWS (the GEMMs' wide
    tiles; 32 rows here, so the interpreter's prompts stay short), one and several pieces a step,
    launch no kernel variant the warm-up did not; and the warm-up leaves no trace: the requests'
    outputs equal an unwarmed engine's."""
    monkeypatch.setattr(triton_linear, "WIDE_ROWS", 32)  # (the name skinny_linear reads)
    monkeypatch.setattr(runner_module, "WIDE_ROWS", 32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (1, 9, 40, 20)]
    cold = _outputs(_llm(dense_ckpt).engine, prompts)
    engine = _llm(dense_ckpt).engine
    runner = engine.runner
    with CompileKeys() as keys:
        runner.warm_prefill(heads=True)
        warmed = set(keys.seen)
        prefill = runner.prefill
        launched: set = set()

        def recorded(pieces):
            keys.seen.clear()
            prefill(pieces)
            launched.update(keys.seen)

        runner.prefill = recorded
        out = _outputs(engine, prompts)
    assert out == cold
    assert len({k[0] for k in warmed}) >= 4, warmed  # the trunk's and the head's kernels
    assert launched and launched <= warmed, sorted(launched - warmed)


def test_a_compile_after_the_warm_up_is_counted_and_logged(monkeypatch, caplog):
    """watch_compiles counts every compile (Triton's post-compile hook, chained after one already
    set) and logs those made while no engine warms up, once one has: a second engine's warm-up in
    the same process (an LLM beside another) is not a request waiting."""
    from types import SimpleNamespace

    from triton import knobs

    from nextn.ops import triton_utils

    chained = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: chained.append(kw["fn"].name))
    monkeypatch.setattr(triton_utils, "interpreting", lambda: False)
    for name, value in dict(count=0, warming=0, settled=False, installed=False).items():
        monkeypatch.setattr(triton_utils._Compiles, name, value)

    def compile_(name):
        knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name=name), compile={"key": name, "num_warps": 4})

    triton_utils.watch_compiles(warming=True)
    compile_("warm_a")
    triton_utils.watch_compiles(warming=False)
    compile_("late_a")
    triton_utils.watch_compiles(warming=True)  # a second engine warms up
    compile_("warm_b")
    triton_utils.watch_compiles(warming=False)
    compile_("late_b")
    assert triton_utils.compile_count() == 4 and chained == ["warm_a", "late_a", "warm_b", "late_b"]
    logged = [r.getMessage() for r in caplog.records if "after the warm-up" in r.getMessage()]
    assert len(logged) == 2 and "late_a" in logged[0] and "late_b" in logged[1], logged
