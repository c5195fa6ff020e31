"""Greedy MTP speculative decoding: token-identical to plain greedy decoding, whatever K, where
the drafts are rejected (random heads) and where they are accepted (fitted heads)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hf_fixtures import FIT_PROMPTS, hf_hidden_states, hf_mtp_logits

import nextn
from nextn.cache import KV
from nextn.models.loader import load_model

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = [[7, 81, 3, 199, 42, 5, 260, 11], [17], [5, 5, 5, 5, 9, 300, 2]]


def _run(llm, prompt, **kw):
    return llm.generate(prompt_token_ids=prompt, params=nextn.SamplingParams(**{**GREEDY, **kw}))


@pytest.mark.parametrize("name", ["dense_ckpt", "moe_ckpt", "next_ckpt", "vlm_ckpt"])
def test_spec_equals_plain_for_every_k(name, request):
    ckpt = request.getfixturevalue(name)
    plain = nextn.LLM(model=ckpt, num_speculative_tokens=0)
    spec = {k: nextn.LLM(model=ckpt, num_speculative_tokens=k) for k in range(1, 9)}
    for prompt in PROMPTS:
        ref = _run(plain, prompt, max_tokens=24).token_ids
        for k, llm in spec.items():
            out = _run(llm, prompt, max_tokens=24)
            assert out.token_ids == ref, (k, prompt)
            assert out.num_drafted > 0


@pytest.mark.parametrize("name", ["dense_fitted_ckpt", "moe_fitted_ckpt"])
def test_spec_equals_plain_with_accepted_drafts(name, request):
    """A head that predicts: drafts are accepted (partial and full rounds) and output is unchanged."""
    ckpt = request.getfixturevalue(name)
    plain = nextn.LLM(model=ckpt, num_speculative_tokens=0)
    accepted = 0
    for k in (1, 2, 3, 4, 8):
        llm = nextn.LLM(model=ckpt, num_speculative_tokens=k)
        for prompt in FIT_PROMPTS:
            out = _run(llm, list(prompt), max_tokens=32)
            assert out.token_ids == _run(plain, list(prompt), max_tokens=32).token_ids, (k, prompt)
            assert sum(out.spec.drafted_per_position) == out.num_drafted
            assert sum(out.spec.accepted_per_position) == out.num_accepted
            accepted += out.num_accepted
    assert accepted > 0


@pytest.mark.parametrize("after_norm", [True, False])
def test_mtp_head_logits_match_transformers(dense_ckpt, after_norm):
    """The head over a fresh draft K/V (rows 1..T-1) equals transformers' MtpModel."""
    model = load_model(dense_ckpt)
    ids = [7, 81, 3, 199, 42, 5, 260, 11, 90, 14]
    pre, post = hf_hidden_states(dense_ckpt, ids)
    hidden = post if after_norm else pre
    ref = hf_mtp_logits(dense_ckpt, ids, hidden)
    cfg = model.cfg
    kv = KV(*(torch.zeros(32, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2)))
    with torch.no_grad():
        ours = model.head_rows(kv, torch.tensor(ids[1:]), hidden[:-1], 1, last_only=False).logits
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_stop_token_and_budget_falling_mid_round(dense_fitted_ckpt):
    prompt = list(FIT_PROMPTS[0])
    plain = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0)
    spec = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=4)
    ref = _run(plain, prompt, max_tokens=32).token_ids
    for budget in range(1, 12):  # every cut position inside K=4 rounds
        out = _run(spec, prompt, max_tokens=budget)
        assert out.token_ids == ref[:budget] and out.finish_reason == "length"
    for stop in set(ref[2:20]):
        cut = ref.index(stop) + 1
        out = _run(spec, prompt, max_tokens=32, stop_token_ids=(stop,), ignore_eos=False)
        assert out.token_ids == ref[:cut] and out.finish_reason == "stop"


def test_one_token_prompt_and_k_beyond_budget(dense_fitted_ckpt):
    plain = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0)
    spec = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=8)
    for prompt in ([346], [17]):
        for budget in (1, 2, 3, 5):
            assert _run(spec, prompt, max_tokens=budget).token_ids == _run(plain, prompt, max_tokens=budget).token_ids
    assert _run(spec, [346], max_tokens=0).token_ids == []


def test_p_min_and_adaptive_k_keep_output(dense_fitted_ckpt):
    prompt = list(FIT_PROMPTS[1])
    ref = _run(nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0), prompt, max_tokens=32).token_ids
    gated = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=4, p_min=0.999999)
    out = _run(gated, prompt, max_tokens=32)
    assert out.token_ids == ref
    assert out.spec.num_zero_draft_rounds > 0 and out.num_drafted < 4 * out.spec.num_rounds  # cut chains
    adaptive = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=6, adaptive_k=True)
    assert _run(adaptive, prompt, max_tokens=32).token_ids == ref


def test_hidden_before_norm_is_selectable_and_exact(dense_fitted_ckpt):
    prompt = list(FIT_PROMPTS[0])
    ref = _run(nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0), prompt, max_tokens=24).token_ids
    pre = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=3, hidden_after_norm=False)
    assert _run(pre, prompt, max_tokens=24).token_ids == ref


def test_cli_generate_spec_json(dense_fitted_ckpt):
    """The issue's command line: --spec-k K emits the --spec-k 0 tokens, with the JSON counters."""
    outs = {}
    for k in (0, 2):
        cmd = [
            sys.executable,
            "-m",
            "nextn.cli",
            "generate",
            "--model",
            str(dense_fitted_ckpt),
            "--prompt-ids",
            ",".join(map(str, FIT_PROMPTS[0])),
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--ignore-eos",
            "--spec-k",
            str(k),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--json",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
        outs[k] = json.loads(proc.stdout.strip().splitlines()[-1])
        assert ("mean acceptance length" if k else "plain decoding") in proc.stderr
    assert outs[2]["token_ids"] == outs[0]["token_ids"] and len(outs[0]["token_ids"]) == 24
    for key in (
        "text",
        "num_drafted",
        "num_accepted",
        "drafted_per_position",
        "accepted_per_position",
        "decode_tokens_per_s",
        "prefill_tokens_per_s",
    ):
        assert key in outs[2]
    assert outs[2]["num_accepted"] > 0 and outs[0]["num_drafted"] == 0


def test_bundled_model_spec_equals_plain_with_acceptance():
    """The bundled model (a head that predicts): K = 1..8 emit the plain tokens, and drafts are accepted."""
    plain = nextn.LLM(num_speculative_tokens=0)
    prompt = plain.tokenizer.encode(
        'import os\n\n\ndef list_python_files(root):\n    """Return the .py files under root."""\n'
    )
    ref = _run(plain, prompt, max_tokens=48).token_ids
    for k in range(1, 9):
        out = _run(nextn.LLM(num_speculative_tokens=k), prompt, max_tokens=48)
        assert out.token_ids == ref, k
        assert out.num_accepted > 0.3 * out.num_drafted, (k, out.num_accepted, out.num_drafted)
