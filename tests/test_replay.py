"""Teacher-forced replay: its draft chains are the live proposer's chains on the same context."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hf_fixtures import FIT_PROMPTS

import nextn
from nextn.cache.hybrid import ACCEPTED, NUM_GEN
from nextn.engine.device_round import Buffers, Member
from nextn.engine.scheduler import Request, RoundSettings
from nextn.sample.sampler import SlotSampler
from nextn.spec.replay import replay_rounds, trunk_pass


def _live_drafts(llm, context: list[int], pending: int, k: int) -> list[int]:
    """What the engine's proposer drafts after `context` with `pending` as the pending token."""
    engine = llm.engine
    req = Request(context, RoundSettings(nextn.SamplingParams(temperature=0)))
    engine.scheduler.add(req)
    engine.scheduler.admit()
    seq, cache = req.seq, engine.runner.slot(req.seq.slot)
    cache.reset()
    seq.heads = True
    with torch.inference_mode():
        engine.runner.extend(seq, context)
        engine.runner.catch_up(seq)
        buf, sampler = Buffers.of(cache), SlotSampler(cache)
        sampler.start(req.params, context)
        buf.verify_ids[0] = buf.head_ids[0] = pending
        buf.hidden[0] = seq.last_hidden
        cache.set(accepted=0, num_gen=1)
        engine.proposer.propose([Member(cache, sampler, buf, k)])
    engine.scheduler.finish(req, keep=False)
    assert cache.get(ACCEPTED) == 0 and cache.get(NUM_GEN) == 1
    return buf.verify_ids[1 : k + 1].tolist()


def test_replay_drafts_equal_live_drafts(dense_fitted_ckpt):
    llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=3)
    prompt = list(FIT_PROMPTS[0])
    greedy = nextn.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    text = prompt + llm.generate(prompt_token_ids=prompt, params=greedy).token_ids
    trunk = trunk_pass(llm.model, text)
    with torch.inference_mode():
        rounds = list(replay_rounds(llm.model, trunk, 3, range(1, len(text) - 3, 4)))
    assert len(rounds) > 3
    for p, drafts, targets in rounds:
        # live: tokens 0..p-1 committed, token p pending
        assert _live_drafts(llm, text[:p], text[p], 3) == drafts.tolist(), p
        # targets are the trunk's own greedy picks, and on its own greedy text they are the text
        if p >= len(prompt):
            assert targets.tolist() == text[p + 1 : p + 4]


def test_replay_cli_reports_rates(dense_fitted_ckpt, tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(
        "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 3
    )
    cmd = [
        sys.executable,
        "-m",
        "nextn.cli",
        "replay",
        "--model",
        str(dense_fitted_ckpt),
        "--file",
        str(f),
        "--k",
        "3",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rates = out["acceptance_per_position"]
    assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates) and rates[0] >= rates[1] >= rates[2]
    assert abs(out["mean_acceptance_length"] - (1 + sum(rates))) < 1e-9
    assert out["ppl"] > 1.0 and "replay:" in proc.stderr


def test_replay_refuses_bad_flags_before_resolving_or_loading(tmp_path, capsys, monkeypatch):
    """A negative --max-tokens sliced tokens off the end of the text (ids[:-5]) and replayed the
    rest as if asked. It, --k 0, --stride 0 and a missing --file were checked only after the model
    was resolved (a hub download for a hub id) and loaded; each is now a one-line error before."""
    from nextn.cli import main
    from nextn.spec import replay

    monkeypatch.setattr(replay, "load_model", lambda *a, **kw: pytest.fail("the model loaded"))
    monkeypatch.setattr("nextn.hub.resolve_model", lambda *a, **kw: pytest.fail("the model was resolved"))
    monkeypatch.setattr("nextn.hub.download", lambda *a, **kw: pytest.fail("the model downloaded"))
    f = tmp_path / "text.txt"
    f.write_text("def add(a, b):\n    return a + b\n" * 8)
    for argv, message in (
        (["--file", str(f), "--max-tokens", "-5"], "--max-tokens must be >= 1, got -5"),
        (["--file", str(f), "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--file", str(f), "--k", "0"], "--k and --stride must be >= 1"),
        (["--file", str(f), "--stride", "0"], "--k and --stride must be >= 1"),
        (["--file", str(tmp_path / "missing.txt")], "missing.txt: not a file"),
    ):
        for model in ([], ["--model", "org/tiny"]):
            assert main(["replay", *model, *argv]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and message in err, err


def test_files_written_at_the_end_are_checked_before_the_work(tmp_path, capsys, monkeypatch):
    """replay --dump-hidden into a missing folder was a SafetensorError traceback after the load and
    the trunk pass, a missing --draft-vocab an error after the load; draft-vocab --out naming a folder
    failed after counting the whole corpus. Each is now a one-line error before the work."""
    from nextn import commands
    from nextn.cli import main
    from nextn.spec import replay

    monkeypatch.setattr(replay, "load_model", lambda *a, **kw: pytest.fail("the model loaded"))
    monkeypatch.setattr(commands, "_local", lambda *a, **kw: pytest.fail("the model was resolved"), raising=True)
    f = tmp_path / "text.txt"
    f.write_text("def add(a, b):\n    return a + b\n" * 8)
    for argv, message in (
        (["--dump-hidden", str(tmp_path / "no" / "h.safetensors")], "h.safetensors: its folder does not exist"),
        (["--dump-hidden", str(tmp_path)], f"--dump-hidden {tmp_path}: a directory"),
    ):
        assert main(["replay", "--file", str(f), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    monkeypatch.undo()
    monkeypatch.setattr(replay, "load_model", lambda *a, **kw: pytest.fail("the model loaded"))
    assert main(["replay", "--file", str(f), "--draft-vocab", str(tmp_path / "v.json")]) == 2
    assert "No such file or directory" in capsys.readouterr().err
    monkeypatch.setattr("nextn.spec.draft_vocab.build_draft_vocab", lambda *a, **kw: pytest.fail("counted"))
    assert main(["draft-vocab", "--data", str(f), "--size", "8", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path}: a directory" in capsys.readouterr().err
