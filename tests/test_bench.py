"""`nextn bench` on CPU with tiny models: the report's keys, exactness, and random presets."""

from __future__ import annotations

import json

import pytest
import torch
from hf_fixtures import tiny_preset

from nextn.bench import measure as bench_measure
from nextn.bench import offline as bench
from nextn.cli import main
from nextn.config import DEFAULT_MODEL_DIR
from nextn.models import random_weights


def test_run_bench_on_a_checkpoint(dense_fitted_ckpt):
    from nextn.models.loader import load_model

    model = load_model(dense_fitted_ckpt)
    cfg = bench_measure.BenchConfig(spec_ks=[1, 2], prompt_len=12, gen_len=10, iters=2, repeats=2)
    res = bench.run_bench(model, "dense", cfg, log=lambda s: None)
    assert res["spec_equals_plain"] == {1: True, 2: True}
    assert res["plain_runs_agree"] and len(res["decode_tokens_per_s_runs"]) == 2
    runs = res["spec_tokens_per_s_runs"][2]
    assert len(runs) == 2 and min(runs) <= res["spec_tokens_per_s"][2] <= max(runs)
    assert set(res["verify_cost_ratio"]) == {1, 2}
    assert res["draft_cost_ratio"] > 0 and res["decode_tokens_per_s"] > 0 and res["prefill_tokens_per_s"] > 0
    assert res["weight_bytes_per_token"] > 0
    assert set(res["round_overhead"]) == {1, 2}


def test_the_draft_step_cost_counts_its_pick(dense_fitted_ckpt, monkeypatch):
    """draft_cost_ratio times a greedy round's draft step whole: the head step and its pick (the
    argmax kernel a round runs after it, on the head's one row of logits), which round_overhead had
    hidden (run 165)."""
    from nextn.models.loader import load_model
    from nextn.spec import proposer as proposer_mod

    picks = []
    original = proposer_mod.MTPProposer.__init__

    def spy_init(self, *a, **kw):
        original(self, *a, **kw)
        pick = self.greedy_draft
        self.greedy_draft = lambda logits, ids, at, rows, d2t, *rest: (
            picks.append((logits, d2t)) or pick(logits, ids, at, rows, d2t, *rest)
        )

    monkeypatch.setattr(proposer_mod.MTPProposer, "__init__", spy_init)
    cfg = bench_measure.BenchConfig(spec_ks=[1], prompt_len=12, gen_len=4, iters=2, repeats=1)
    model = load_model(dense_fitted_ckpt)
    costs = bench_measure.Bench(model, list(range(5, 17)), cfg).step_costs([1])
    assert costs["head_step_ms"] > 0 and picks and all(logits.shape[0] == 1 and d2t is None for logits, d2t in picks)


def test_acceptance_profile_and_sampled_runs(dense_ckpt):
    """Drafts that follow a profile are accepted exactly as often as it says (a random head alone
    accepts nothing), output stays plain greedy's; sampled runs report their own speed-up."""
    from nextn.models.loader import load_model

    model = load_model(dense_ckpt)
    cfg = bench_measure.BenchConfig(
        spec_ks=[2], prompt_len=8, gen_len=11, iters=1, repeats=1, temperatures=[0.7], acceptance_profile=[1.0, 0.0]
    )
    res = bench.run_bench(model, "dense", cfg, log=lambda s: None)
    assert res["profile_equals_plain"] == {2: True} and res["spec_equals_plain"] == {2: True}
    assert res["profile_mean_acceptance_length"][2] == 2.0  # every round: draft 1 right, draft 2 wrong
    assert res["profile_accepted_per_position"][2] == [1.0, 0.0]
    assert res["mean_acceptance_length"][2] < 1.5  # the random head alone
    assert set(res["sampled_spec_speedup"]) == {2} and res["sampled"][0.7]["decode_tokens_per_s"] > 0
    sampled = res["sampled"][0.7]  # per position: the counts the acceptance rate is made of
    per_position, rounds = sampled["accepted_per_position"][2], sampled["num_rounds"][2]
    assert len(per_position) == 2 and per_position[0] >= per_position[1] and rounds > 0
    assert sum(per_position) / (2 * rounds) == pytest.approx(sampled["acceptance_rate"][2])


def test_random_preset_builds_and_decodes(monkeypatch, tmp_path):
    tiny = tiny_preset(vocab_size=300)
    monkeypatch.setitem(random_weights.PRESETS, "tiny", tiny)
    model = random_weights.random_model("tiny", "cpu", "float32")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    out = tmp_path / "res.json"
    rc = main(
        [
            "bench",
            "--random-weights",
            "tiny",
            "--spec-k",
            "1",
            "--prompt-len",
            "8",
            "--gen-len",
            "6",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["spec_equals_plain"] == {"1": True}
    assert (tmp_path / "res_tokens_per_s.png").is_file() or pytest.importorskip("matplotlib") is None


def test_bench_without_a_model_runs_the_bundled_one(monkeypatch):
    """As the usage line says: neither MODEL nor --random-weights is the bundled checkpoint."""
    models = []
    monkeypatch.setattr(bench, "_bench", lambda args, cfg, prompt_text: models.append(args.model) or {})
    assert main(["bench", "--spec-k", "0", "--prompt-len", "4", "--gen-len", "2", "--log-level", "warning"]) == 0
    assert models == [str(DEFAULT_MODEL_DIR)]


def test_bench_tunes_unless_told_not_to(monkeypatch):
    """--no-tune: the skinny GEMM's table configs, as serve runs them (a served / offline ratio on the same
    configs); by default the bench measures its own first (a GPU's triton runs)."""
    tunes = []
    monkeypatch.setattr(bench, "_bench", lambda args, cfg, prompt_text: tunes.append(cfg.tune) or {})
    argv = ["bench", "--spec-k", "0", "--prompt-len", "4", "--gen-len", "2", "--log-level", "warning"]
    assert main(argv) == 0 and main([*argv, "--no-tune"]) == 0
    assert tunes == [True, False]


def test_weight_bytes_count_routed_experts_only(moe_ckpt):
    from nextn.models.loader import load_model

    model = load_model(moe_ckpt)
    cfg = model.cfg
    dense_part = random_weights.weight_bytes_per_token(model)
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n and not n.startswith("mtp."))
    all_trunk = sum(
        p.numel() * 4
        for n, p in model.named_parameters()
        if not n.startswith("mtp.") and n != "model.embed_tokens.weight"
    )
    expected = all_trunk - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    expected += (model.lm_head_weight.numel() * 4 if cfg.tie_word_embeddings else 0) + cfg.hidden_size * 4
    assert dense_part == expected


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kernels", "triton"], "kernels='triton' needs a CUDA device"),
        (["--draft-vocab-size", "0"], "a draft vocabulary size must be in 1..352, got 0"),
        (["--draft-vocab-size", "353"], "a draft vocabulary size must be in 1..352, got 353"),
        (["--draft-vocab", "missing.json"], "[Errno 2] No such file or directory: 'missing.json'"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
        (["--json", "."], "--json .: a directory; give the report's file name"),
    ],
    ids=("triton-on-cpu", "vocab-size-0", "vocab-size-past", "vocab-file", "tp-0", "json-dir"),
)
def test_bench_checks_its_settings_before_loading(argv, message, dense_ckpt, capsys, monkeypatch, tmp_path):
    """Each was refused only after the model loaded (a --json folder: after every run, the report lost)."""
    monkeypatch.setattr(bench, "load_model", lambda *a, **kw: pytest.fail("the model loaded"))
    monkeypatch.setattr("nextn.ops.triton_utils.interpreting", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", str(dense_ckpt), "--device", "cpu", "--spec-k", "1", *argv, "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nextn: error: {message}"), err


def test_bench_checks_its_flags_before_a_download(capsys, monkeypatch, tmp_path):
    """A hub id was fetched (the whole checkpoint) before a flag that needs no model was refused."""
    monkeypatch.setattr("nextn.hub.download", lambda *a: pytest.fail("the model downloaded"))
    monkeypatch.chdir(tmp_path)
    for argv, message in (
        (["--spec-k", "16"], "--spec-k values must be in 0..15, got 16"),
        (["--p-min", "1"], "--p-min takes values in [0, 1), got [1.0]"),
        (["--prompt-file", "missing.txt"], "--prompt-file missing.txt: not a file"),
        (["--json", "."], "--json .: a directory"),
    ):
        assert main(["bench", "org/tiny", "--device", "cpu", *argv, "--log-level", "warning"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"nextn: error: {message}"), err
