"""Teacher-forced replay: its draft chains are the live proposer's chains on the same context."""
from __future__ import annotations

import json
import subprocess
import sys

import torch
from hf_fixtures import FIT_PROMPTS

import nextn
from nextn.engine.selector import TokenSelector
from nextn.spec.replay import replay_rounds, trunk_pass


def test_replay_drafts_equal_live_drafts(dense_fitted_ckpt):
    llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=3)
    prompt = list(FIT_PROMPTS[0])
    text = prompt + llm.generate(prompt_token_ids=prompt, params=nextn.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)).token_ids
    runner, proposer = llm.runner, llm.proposer
    hidden, picks, _ = trunk_pass(runner, text)
    greedy = nextn.SamplingParams(temperature=0)
    with torch.inference_mode():
        rounds = list(replay_rounds(runner, proposer, text, hidden, picks, 3, range(1, len(text) - 3, 4)))
    assert len(rounds) > 3
    for p, drafts, targets in rounds:
        state = runner.new_state(64)
        runner.extend(state, text[:p])  # live: tokens 0..p-1 committed, token p pending
        live = proposer.propose(state, text[p], 3, TokenSelector(greedy, text[:p], runner.cfg.vocab_size, "cpu"))
        assert live.token_ids.tolist() == drafts.tolist(), p
        # targets are the trunk's own greedy picks, and on its own greedy text they are the text
        if p >= len(prompt):
            assert targets.tolist() == text[p + 1 : p + 4]


def test_replay_cli_reports_rates(dense_fitted_ckpt, tmp_path):
    f = tmp_path / "text.txt"
    f.write_text("def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 3)
    cmd = [sys.executable, "-m", "nextn.cli", "replay", "--model", str(dense_fitted_ckpt), "--file", str(f),
           "--k", "3", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rates = out["acceptance_per_position"]
    assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates) and rates[0] >= rates[1] >= rates[2]
    assert abs(out["mean_acceptance_length"] - (1 + sum(rates))) < 1e-9
    assert out["ppl"] > 1.0 and "replay:" in proc.stderr
