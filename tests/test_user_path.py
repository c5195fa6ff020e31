"""The user path (issue 17): install, find a model (directory, hub id, cache, offline), load it
(streamed, checked, with clear errors), the defaults (device, dtype, generation_config sampling),
the vLLM-shaped Python API and the CLI around it (positional MODEL, --speculative-config,
--version, --log-level, one-line errors). Tiny random checkpoints from tests/hf_fixtures.py; the
hub is huggingface_hub's own code over a local cache, or a local fake: no network."""

from __future__ import annotations

import ast
import json
import logging
import re
import shutil
import subprocess
import sys
import tomllib
import weakref
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import hf_fixtures
import numpy as np
import pytest
import torch

import nextn
from nextn.cli import main, parse_args
from nextn.config import DEFAULT_MODEL_DIR, resolve_device, resolve_dtype
from nextn.config.model import ConfigError
from nextn.core import SamplingParams
from nextn.engine.llm import RequestError
from nextn.hub import ModelNotFoundError, is_hub_id, resolve_model
from nextn.models import loader
from nextn.models.loader import CheckpointError, load_model
from nextn.tokenizer import TokenizerError

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ([5, 17, 42, 8, 99], [3, 1, 4, 1, 5, 9, 2, 6], [200, 201])
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
CPU_TORCH = not torch.backends.cuda.is_built()


@pytest.fixture
def ckpt(dense_ckpt, tmp_path) -> Path:
    """A copy of dense_ckpt this test may edit."""
    return Path(shutil.copytree(dense_ckpt, tmp_path / "ckpt"))


@pytest.fixture(autouse=True)
def _nextn_log_level():
    """main() sets the nextn logger's level; put it back."""
    level = logging.getLogger("nextn").level
    yield
    logging.getLogger("nextn").setLevel(level)


def _with_generation_config(ckpt: Path, **values) -> Path:
    path = ckpt / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return ckpt


def _cli_json(capsys, *argv) -> dict:
    assert main(["generate", *argv, "--json", "--log-level", "warning"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# --- the CLI


def test_cli_takes_a_positional_model_and_the_checkpoints_sampling_defaults(ckpt, capsys):
    _with_generation_config(ckpt, temperature=0.0, max_new_tokens=6)
    ids = ",".join(map(str, PROMPTS[0]))
    out = _cli_json(capsys, str(ckpt), "--prompt-ids", ids, "--ignore-eos")
    greedy6 = nextn.LLM(ckpt, max_model_len=256).generate(
        prompt_token_ids=list(PROMPTS[0]), params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    assert out["token_ids"] == greedy6.token_ids  # greedy and 6 tokens: generation_config's, not T=1 and 256
    assert _cli_json(capsys, "--model", str(ckpt), "--prompt-ids", ids, "--ignore-eos")["token_ids"] == out["token_ids"]
    assert (
        _cli_json(capsys, str(ckpt), "--prompt-ids", ids, "--ignore-eos", "--max-tokens", "3")["token_ids"]
        == (
            out["token_ids"][:3]  # the request's own value wins
        )
    )
    with pytest.raises(SystemExit, match="2"):
        main(["generate", str(ckpt), "--model", str(ckpt) + "x", "--prompt-ids", ids])
    assert f"MODEL {ckpt} and --model {ckpt}x disagree" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "x"],
        ["serve"],
        ["replay", "--file", "f.py"],
        ["bench", "--spec-k", "1"],
        ["train", "--out", "run"],
    ],
    ids=lambda a: a[0],
)
def test_every_command_takes_a_positional_model(argv):
    args = parse_args([argv[0], "org/model", *argv[1:]])
    assert args.model == "org/model" and args._origins["model"][0] == "MODEL"
    args = parse_args([*argv, "--model", "org/model"])
    assert args.model == "org/model" and args._origins["model"][0] == "--model"


def test_replay_resolves_its_positional_model(ckpt, tmp_path, capsys):
    text = tmp_path / "text.py"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 8)
    assert main(["replay", str(ckpt), "--file", str(text), "--k", "2", "--max-tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == str(ckpt) and out["num_tokens"] == 24


def test_cli_speculative_config_sets_k(ckpt, capsys):
    ids = ",".join(map(str, PROMPTS[1]))
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    out = _cli_json(capsys, str(ckpt), "--prompt-ids", ids, "--speculative-config", spec, "--max-tokens", "4")
    assert out["num_speculative_tokens"] == 2
    with pytest.raises(SystemExit) as e:
        main(["generate", str(ckpt), "--prompt-ids", ids, "--speculative-config", "{not json"])
    assert e.value.code == 2 and "not JSON" in capsys.readouterr().err


def test_version_is_the_installed_packages(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"nextn {nextn.__version__}"
    assert metadata.version("nextn") == nextn.__version__  # pyproject.toml reads it from nextn/__init__.py


def test_log_level_gates_nextns_messages(ckpt, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    ids = ",".join(map(str, PROMPTS[2]))
    _cli_json(capsys, str(ckpt), "--prompt-ids", ids, "--max-tokens", "2")  # --log-level warning
    assert not [r for r in caplog.records if r.name.startswith("nextn") and r.levelno < logging.WARNING]
    assert main(["generate", str(ckpt), "--prompt-ids", ids, "--max-tokens", "2", "--log-level", "info"]) == 0
    assert any(r.name == "nextn.models.loader" and "loaded" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not CPU_TORCH, reason="needs a CPU-only build of torch")
def test_cuda_on_a_cpu_only_torch_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "nextn.cli", "generate", "--device", "cuda", "--prompt", "def f():"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("nextn: error: device 'cuda'") and "CPU-only" in proc.stderr
    with pytest.raises(ValueError, match="CPU-only"):
        nextn.LLM(device="cuda")


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["generate", "--prompt", "x", "--max-tokens", "4", "--device", "tpu"],
            "device must be auto, cpu or cuda[:N], got 'tpu'",
        ),
        (["serve", "--device", "tpu"], "device must be auto, cpu or cuda[:N], got 'tpu'"),
        (["bench", "--device", "tpu"], "device must be auto, cpu or cuda[:N], got 'tpu'"),
        (["generate", "--prompt-ids", "1,2", "--max-tokens", "4", "--chat"], "--chat wraps a text prompt"),
        (["generate", "--prompt", "x", "--max-tokens", "4", "--trace"], "--trace needs --json"),
        (["serve", "--max-model-len", "4097"], "max_model_len=4097 is more than the checkpoint supports: "),
        (
            ["generate", "--prompt", "x", "--max-tokens", "4", "--seed", str(2**64)],
            "seed must be a signed 64-bit integer",
        ),
        (["generate", "--prompt", "x", "--spec-k", "0", "--p-min", "0.5"], "--p-min would do nothing"),
        (["generate", "--prompt", "x", "--spec-k", "0", "--adaptive-k"], "--adaptive-k would do nothing"),
        (["generate", "--prompt", "x", "--spec-k", "0", "--hidden-before-norm"], "--hidden-before-norm would do"),
        (["generate", "--prompt", "x", "--no-grammar-draft-mask"], "--no-grammar-draft-mask needs --structured-"),
        (
            ["serve", "--speculative-config", '{"num_speculative_tokens": 0}', "--p-min", "0.5", "--adaptive-k"],
            "--p-min, --adaptive-k would do nothing: speculation is off (K=0)",
        ),
        (["bench", "--gen-len", "0", "--spec-k", "0"], "--prompt-len, --gen-len and --repeats must be >= 1"),
        (["bench", "--repeats", "0", "--spec-k", "0"], "--prompt-len, --gen-len and --repeats must be >= 1"),
        (["bench", "--random-weights", "qwen3.5-9b"], "nextn bench runs MODEL or --random-weights PRESET, not both"),
        (["train", "--out", "run", "--max-steps", "2", "--num-hidden-layers", "2"], "num_hidden_layers must be"),
        (["train", "--out", "run", "--max-steps", "2", "--vocab-size", "300"], "vocab_size must be >= 512"),
        (["train", "--out", "run"], "give --minutes, --max-steps or --wall-minutes"),
        (["train", "--out", "run", "--max-steps", "-1"], "max_steps must be > 0, got -1"),
        (["train", "--out", "run", "--minutes", "0"], "minutes must be > 0, got 0.0"),
    ],
    ids=[
        *("generate-device", "serve-device", "bench-device", "chat-ids", "trace", "max-model-len", "seed"),
        *("p-min-k0", "adaptive-k0", "hidden-before-norm-k0", "grammar-mask", "serve-k0"),
        *("bench-gen-len", "bench-repeats", "bench-two-models"),
        *("train-layers", "train-vocab", "train-duration", "train-max-steps", "train-minutes"),
    ],
)
def test_a_flag_error_is_one_line(argv, message, dense_ckpt, capsys, monkeypatch, tmp_path):
    """A bad flag, or one that would be silently ignored, is `nextn: error: ...` and status 2, no traceback."""
    monkeypatch.setattr("nextn.server.app.serve", lambda *a: pytest.fail("the server started"))
    monkeypatch.chdir(tmp_path)  # train's --out run, were it to start
    assert main([argv[0], str(dense_ckpt), *argv[1:], "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nextn: error: {message}"), err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--prompt", "x", "--max-tokens", "-1"], "max_tokens must be >= 0, got -1"),
        (["generate", "--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["generate", "--prompt", "x", "--structured-outputs", '{"jsn": {}}'], "structured_outputs must hold"),
        (["generate", "--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers, got '1,x'"),
        (["generate", "--prompt-ids", ","], "--prompt-ids is empty"),
        (["generate", "--prompt-file", "missing.txt"], "[Errno 2] No such file or directory: 'missing.txt'"),
        (["serve", "--port", "0"], "port must be in 1..65535, got 0"),
        (["serve", "--max-queue", "0"], "max_queue must be >= 1"),
        (["serve", "--max-request-bytes", "10"], "max_request_bytes must be >= 1024, got 10"),
        (["serve", "--reasoning-parser", "qwen3", "--shutdown-timeout", "-1"], "shutdown_timeout must be >= 0"),
    ],
    ids=lambda a: a[-2].strip("-") if isinstance(a, list) else None,
)
def test_generate_and_serve_check_their_flags_before_loading(argv, message, ckpt, monkeypatch, capsys, tmp_path):
    """A bad sampling flag, prompt or server setting was refused only after the model loaded."""
    monkeypatch.setattr("nextn.engine.llm.load_model", lambda *a, **kw: pytest.fail("the weights loaded"))
    monkeypatch.setattr("nextn.hub.download", lambda *a: pytest.fail("the model downloaded"))
    monkeypatch.chdir(tmp_path)
    for model in (str(ckpt), "org/tiny"):
        assert main([argv[0], model, *argv[1:], "--log-level", "warning"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"nextn: error: {message}"), err


def test_bench_checks_its_k_before_loading(dense_ckpt, capsys, monkeypatch):
    monkeypatch.setattr("nextn.bench.offline._bench", lambda *a: pytest.fail("the bench ran"))
    assert main(["bench", str(dense_ckpt), "--spec-k", "3", "-1", "--log-level", "warning"]) == 2
    assert capsys.readouterr().err == "nextn: error: --spec-k values must be in 0..15, got 3 -1\n"


def test_plain_generate_reports_no_spec_counters(dense_ckpt, capsys):
    """K=0 drafts nothing: the summary says plain decoding, not "zero-draft rounds 3 of 3"."""
    args = ["--prompt-ids", "1,2", "--max-tokens", "4", "--spec-k", "0", "--ignore-eos"]  # (sampled: EOS could end it)
    assert main(["generate", str(dense_ckpt), *args]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("nextn: 4 tokens") and line.endswith("plain decoding (K=0: nothing drafted)"), line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_triton_kernels_without_cuda_is_one_line(dense_ckpt, capsys, monkeypatch):
    # as outside the tests: Triton's interpreter, which the kernel tests turn on, runs them on the CPU
    monkeypatch.setattr("nextn.ops.triton_utils.interpreting", lambda: False)
    assert (
        main(["generate", str(dense_ckpt), "--prompt-ids", "1,2", "--kernels", "triton", "--log-level", "warning"]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nextn: error: kernels='triton' needs a CUDA device"), err
    with pytest.raises(ValueError, match="kernels='triton' needs a CUDA device"):
        nextn.LLM(dense_ckpt, kernels="triton")


def test_device_and_dtype_auto(ckpt):
    for bad in ("tpu", "cuda:x", "cuda:", "cpu:0", "CUDA"):
        with pytest.raises(ValueError, match="^device must be auto, cpu or cuda"):
            resolve_device(bad)
    assert resolve_dtype("auto", "cpu", "bfloat16") == "float32"
    assert resolve_dtype("auto", "cuda", "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", "cuda:1", "float16") == "float16"
    assert resolve_dtype("auto", "cuda", None) == "bfloat16"
    assert resolve_dtype("float16", "cpu", "bfloat16") == "float16"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == expected
    llm = nextn.LLM(ckpt, max_model_len=256)
    assert llm.config.device == expected
    assert next(llm.model.parameters()).dtype == getattr(torch, llm.config.dtype)
    if expected == "cpu":
        assert llm.config.dtype == "float32" and llm.config.kernels == "torch"


# --- finding the model: directories, hub ids, the cache, offline


def test_hub_ids_and_paths():
    assert is_hub_id("Qwen/Qwen3.5-9B") and is_hub_id("org/name.v2_x")
    assert not any(map(is_hub_id, ["./a/b", "../a", "/abs/path", "~/m", "a/b/c", "single", "a/../b"]))
    with pytest.raises(ModelNotFoundError, match="no such directory"):
        resolve_model("./missing/dir")
    assert resolve_model(None) == DEFAULT_MODEL_DIR
    with pytest.raises(ModelNotFoundError, match="not a directory"):
        resolve_model(DEFAULT_MODEL_DIR / "config.json")


def test_a_hub_id_fetches_config_tokenizer_template_and_safetensors_only(ckpt, tmp_path, monkeypatch):
    """A fake snapshot_download over a repository that also holds what nextn never reads."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    repo = tmp_path / "repo"
    shutil.copytree(ckpt, repo)
    (repo / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    for extra in ("pytorch_model.bin", "README.md", "original/consolidated.pth", "onnx/model.onnx"):
        (repo / extra).parent.mkdir(exist_ok=True)
        (repo / extra).write_bytes(b"x")
    calls = []

    def fake_snapshot_download(repo_id, *, allow_patterns=None, **kw):
        calls.append(repo_id)
        out = tmp_path / "snapshot"
        files = [str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file()]
        for f in filter_repo_objects(files, allow_patterns=allow_patterns):
            (out / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / f, out / f)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    llm = nextn.LLM("org/tiny", max_model_len=256)
    assert calls == ["org/tiny"] and llm.model_name == "org/tiny"
    fetched = sorted(p.name for p in (tmp_path / "snapshot").rglob("*") if p.is_file())
    assert "pytorch_model.bin" not in fetched and "README.md" not in fetched and "model.onnx" not in fetched
    assert {"config.json", "tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(fetched)
    assert any(f.endswith(".safetensors") for f in fetched)
    out = llm.generate(prompt_token_ids=list(PROMPTS[0]), params=GREEDY)
    assert out.token_ids == nextn.LLM(ckpt, max_model_len=256).generate(list(PROMPTS[0]), GREEDY).token_ids


def test_offline_hub_ids_use_huggingface_hubs_cache(ckpt, tmp_path, monkeypatch, capsys):
    """huggingface_hub's real snapshot_download, offline, over an empty cache and then a filled one."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        resolve_model("org/tiny")
    assert main(["generate", "org/tiny", "--prompt", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "org/tiny" in err and "HF_HUB_OFFLINE" in err
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(ckpt, cache / "models--org--tiny" / "snapshots" / commit)
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text(commit)
    assert resolve_model("org/tiny") == cache / "models--org--tiny" / "snapshots" / commit
    assert nextn.LLM("org/tiny", max_model_len=256).generate(list(PROMPTS[0]), GREEDY).token_ids


# --- loading


def test_tensors_stream_one_at_a_time_and_are_checked_before_any_is_read(
    moe_perexpert_ckpt, moe_ckpt, tmp_path, monkeypatch
):
    """Host memory holds one checkpoint tensor at a time: each read tensor is dead (cast, moved,
    packed into its expert slot) before the next is read."""
    live, max_live, reads = [], [0], [0]
    real_safe_open = loader.safe_open

    class Watched:
        def __init__(self, *a, **kw):
            self.f = real_safe_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, key):
            t = self.f.get_tensor(key)
            live.append(weakref.ref(t))
            reads[0] += 1
            max_live[0] = max(max_live[0], sum(r() is not None for r in live))
            return t

    monkeypatch.setattr(loader, "safe_open", Watched)
    streamed = load_model(moe_perexpert_ckpt, device="cpu", dtype="bfloat16")
    assert reads[0] == len(hf_fixtures.read_tensors(moe_perexpert_ckpt)) and max_live[0] == 1
    monkeypatch.setattr(loader, "safe_open", real_safe_open)
    fused = load_model(moe_ckpt, device="cpu", dtype="bfloat16").state_dict()
    for name, t in streamed.state_dict().items():  # the per-expert tensors packed into the same bits
        assert torch.equal(t, fused[name]), name

    bad = Path(shutil.copytree(moe_perexpert_ckpt, tmp_path / "bad"))
    _rewrite_header(next(bad.glob("*.safetensors")), lambda h: h["mtp.fc.weight"]["shape"].reverse())
    monkeypatch.setattr(loader, "safe_open", Watched)
    reads[0] = 0
    with pytest.raises(CheckpointError):
        load_model(bad, device="cpu")
    assert reads[0] == 0


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"p_min": 1.5}, "p_min must be in"),
        ({"num_speculative_tokens": 16}, "num_speculative_tokens must be in"),
        ({"num_speculative_tokens": 0, "adaptive_k": True}, "adaptive_k would do nothing"),
        ({"num_speculative_tokens": 0, "draft_vocab": "v.json"}, "a draft vocabulary needs speculative"),
        ({"draft_vocab": 7}, "draft_vocab must be a DraftVocab"),
        ({"prefill": "fast"}, "prefill must be one of"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"max_num_batched_tokens": 8}, "max_num_batched_tokens must be >= 16"),
        ({"max_model_len": 1}, "max_model_len must be >= 2"),
        ({"dtype": "float64"}, "dtype must be one of"),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, dict) else None,
)
def test_settings_are_checked_before_a_download_or_a_weight_is_read(setting, message, ckpt, monkeypatch, capsys):
    """A bad setting is refused before the weights load (and before a hub download), not after."""
    monkeypatch.setattr("nextn.engine.llm.load_model", lambda *a, **kw: pytest.fail("the weights loaded"))
    monkeypatch.setattr("nextn.hub.download", lambda *a: pytest.fail("the model downloaded"))
    for model in (ckpt, "org/tiny"):
        with pytest.raises(ValueError, match=message):
            nextn.LLM(model, device="cpu", **setting)
    if "p_min" in setting:  # the CLI's path
        assert main(["generate", str(ckpt), "--prompt", "x", "--p-min", "1.5", "--log-level", "warning"]) == 2
        assert capsys.readouterr().err == "nextn: error: p_min must be in [0, 1), got 1.5\n"


def test_a_progress_bar_counts_the_shards(vlm_ckpt, caplog, capsys):
    shards = len(loader.safetensor_files(vlm_ckpt))
    assert shards > 1
    caplog.set_level(logging.INFO, logger="nextn")
    load_model(vlm_ckpt, device="cpu")
    assert f"{shards}/{shards}" in capsys.readouterr().err
    caplog.set_level(logging.WARNING, logger="nextn")
    load_model(vlm_ckpt, device="cpu")
    assert "shard" not in capsys.readouterr().err


def _rewrite_header(path: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header through `edit`, keeping its data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def _truncate_second_shard(ckpt: Path) -> str:
    shard = loader.safetensor_files(ckpt)[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size - 100])
    return f"{shard.name}: truncated"


def _header_disagrees(ckpt: Path) -> str:
    shard = loader.safetensor_files(ckpt)[0]
    name = {}

    def edit(header):
        name["key"] = key = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)
        header[key]["shape"][0] += 1

    _rewrite_header(shard, edit)
    return f"{shard.name}: corrupt header: tensor {re.escape(name['key'])}"


def _garbage_tokenizer(ckpt: Path) -> str:
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": garbage')
    return "tokenizer.json: not a tokenizer"


def _corrupt_config(ckpt: Path) -> str:
    (ckpt / "config.json").write_text('{"model_type": "qwen3_5_text", ')
    return "config.json: not valid JSON"


def _corrupt_generation_config(ckpt: Path) -> str:
    (ckpt / "generation_config.json").write_bytes(b"\xff\xfe garbage")
    return "generation_config.json: not valid JSON"


@pytest.mark.parametrize(
    "corrupt",
    [_truncate_second_shard, _header_disagrees, _garbage_tokenizer, _corrupt_config, _corrupt_generation_config],
)
def test_a_broken_file_is_a_one_line_error_naming_it(corrupt, vlm_ckpt, tmp_path, capsys):
    ckpt = Path(shutil.copytree(vlm_ckpt, tmp_path / "broken"))
    message = corrupt(ckpt)
    with pytest.raises((CheckpointError, TokenizerError, ConfigError), match=message):
        nextn.LLM(ckpt, max_model_len=256)
    capsys.readouterr()  # the load's progress bar, where a test left nextn's log level at info
    assert main(["generate", str(ckpt), "--prompt-ids", "1,2,3", "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err) and str(ckpt) in err


# --- the Python API


def test_generate_takes_vllms_prompt_forms_and_returns_one_output_per_prompt(dense_ckpt):
    llm = nextn.LLM(dense_ckpt, max_model_len=256)
    solo = [llm.generate(prompt_token_ids=list(p), params=GREEDY) for p in PROMPTS]  # nextn's single form
    batch = llm.generate([list(p) for p in PROMPTS], GREEDY)  # all in the engine at once
    assert [o.outputs[0].token_ids for o in batch] == [o.token_ids for o in solo]
    assert [o.prompt_token_ids for o in batch] == [list(p) for p in PROMPTS]
    assert all(o.outputs[0].text == llm.tokenizer.decode(o.token_ids) for o in batch)

    text = llm.tokenizer.decode(list(PROMPTS[1]))
    (one,) = llm.generate(text, sampling_params=GREEDY)
    assert one.prompt == text and one.outputs[0].token_ids == llm.generate(prompt=text, params=GREEDY).token_ids
    many = llm.generate([{"prompt": text}, {"prompt_token_ids": list(PROMPTS[0])}, text], GREEDY)
    assert [o.token_ids for o in many] == [one.token_ids, solo[0].token_ids, one.token_ids]

    lengths = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 7, 4)]
    assert [len(o.outputs[0].token_ids) for o in llm.generate([list(p) for p in PROMPTS], lengths)] == [2, 7, 4]
    legacy = llm.generate(list(PROMPTS[0]), GREEDY)  # a flat list of ids: nextn's single-request form
    assert isinstance(legacy, nextn.RequestOutput) and legacy.token_ids == solo[0].token_ids

    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate([list(p) for p in PROMPTS], lengths[:2])
    with pytest.raises(RequestError, match="empty"):
        llm.generate([list(PROMPTS[0]), []], GREEDY)
    with pytest.raises(RequestError, match="str or a list of token ids"):
        llm.generate([list(PROMPTS[0]), 3.5], GREEDY)
    assert not llm.engine.has_work  # a refused batch leaves nothing queued


def test_chat_renders_the_template(dense_ckpt):
    llm = nextn.LLM(dense_ckpt, max_model_len=256)
    conv = [{"role": "user", "content": "def add(a, b):"}]
    (out,) = llm.chat(conv, GREEDY)
    text = llm.tokenizer.apply_chat_template(conv)
    assert out.prompt == text and out.token_ids == llm.generate(prompt=text, params=GREEDY).token_ids
    other = [{"role": "user", "content": "class Stack:"}]
    assert [o.token_ids for o in llm.chat([conv, other], GREEDY)] == [
        out.token_ids,
        llm.generate(prompt=llm.tokenizer.apply_chat_template(other), params=GREEDY).token_ids,
    ]


def test_the_bundled_model_answers_coding_requests_with_code():
    """The default model was fine-tuned on chat transcripts (docs/model_card.md, stage 3): asked for
    code in a chat turn, it answers with code under its generation_config defaults, where the
    code-only stage 2 ended every chat turn at once (empty content)."""
    llm = nextn.LLM(max_model_len=512)
    asks = [
        "Write a Python function that reverses a string.",
        "Write a function that returns the n-th Fibonacci number.",
        "Write a Python function that returns the factorial of n.",
    ]
    for seed, ask in enumerate(asks):
        params = llm.default_sampling_params(max_tokens=64, seed=seed)
        text = llm.chat([{"role": "user", "content": ask}], params)[0].outputs[0].text
        assert re.search(r"```python|^\s*(def|class|return|import|from) ", text, re.M), (ask, text)


def test_chat_refuses_an_unknown_role(dense_ckpt):
    """The server's roles (a 400 there): "developer" is rendered as "system", anything else is refused."""
    llm = nextn.LLM(dense_ckpt, max_model_len=256)
    with pytest.raises(RequestError, match=r"^messages\[1\]: unknown role 'robot'; expected one of system, "):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "robot", "content": "hi"}], GREEDY)
    with pytest.raises(RequestError, match=r"^messages\[1\]\[0\]: unknown role None"):
        llm.chat([[{"role": "user", "content": "hi"}], [{"content": "hi"}]], GREEDY)
    assert not llm.engine.has_work
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert llm.chat(developer, GREEDY)[0].prompt == llm.tokenizer.apply_chat_template(system)


def test_max_model_len_is_at_most_the_checkpoints(dense_ckpt):
    """Past max_position_embeddings (4096 here) max_model_len is an error, not clamped; unset, it is
    8192 or the checkpoint's own if less."""
    with pytest.raises(ValueError, match=r"^max_model_len=4097 .* max_position_embeddings 4096 in .*config.json"):
        nextn.LLM(dense_ckpt, max_model_len=4097)
    assert nextn.LLM(dense_ckpt, max_num_seqs=1).config.max_model_len == 4096


def test_speculative_config(dense_ckpt):
    llm = nextn.LLM(dense_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, max_model_len=256)
    assert llm.num_speculative_tokens == 2
    assert (
        nextn.LLM(dense_ckpt, speculative_config={"num_speculative_tokens": 0}, max_model_len=256).engine.proposer
        is None
    )
    for bad, message in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle'"),
        ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, "keys \\['model'\\]"),
        ({"num_speculative_tokens": "2"}, "integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            nextn.LLM(dense_ckpt, speculative_config=bad)
    with pytest.raises(ValueError, match="disagree"):
        nextn.LLM(dense_ckpt, num_speculative_tokens=1, speculative_config={"num_speculative_tokens": 2})


def test_generation_config_sampling_defaults(ckpt, caplog):
    caplog.set_level(logging.INFO, logger="nextn")
    _with_generation_config(ckpt, temperature=0.0, top_k=-1, top_p=0.9, max_new_tokens=4, do_sample=True)
    llm = nextn.LLM(ckpt, max_model_len=256)
    params = llm.default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.0, 0, 0.9, 4)
    mine = llm.default_sampling_params(temperature=0.5, top_p=None, max_tokens=9)  # None: not given
    assert (mine.temperature, mine.top_p, mine.max_tokens) == (0.5, 0.9, 9)
    (out,) = llm.generate(list(map(list, PROMPTS[:1])))  # no sampling_params: the checkpoint's
    assert (
        len(out.token_ids) <= 4
        and out.token_ids
        == llm.generate(list(PROMPTS[0]), SamplingParams(max_tokens=4, temperature=0.0)).token_ids[: len(out.token_ids)]
    )
    logged = [r for r in caplog.records if "sampling defaults" in r.getMessage()]
    assert len(logged) == 1 and "top_p=0.9" in logged[0].getMessage()

    _with_generation_config(ckpt, do_sample=False, temperature=0.8)
    assert nextn.LLM(ckpt, max_model_len=256).default_sampling_params().temperature == 0.0  # transformers' rule
    _with_generation_config(ckpt, do_sample=True, top_p=2.0)
    with pytest.raises(ValueError, match="generation_config.json: top_p"):
        nextn.LLM(ckpt, max_model_len=256)
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        nextn.core.with_defaults({}, temprature=0.5)


def test_bundled_model_ships_sampling_defaults():
    llm_defaults = nextn.core.sampling_defaults(
        json.loads((ROOT / "nextn/default_model/generation_config.json").read_text())
    )
    assert llm_defaults["temperature"] > 0 and llm_defaults["top_p"] < 1 and llm_defaults["top_k"] > 0


def test_min_tokens_is_validated():
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8
    for bad in ({"min_tokens": -1}, {"max_tokens": 4, "min_tokens": 5}):
        with pytest.raises(ValueError, match="min_tokens"):
            SamplingParams(**bad)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 4.5),  # slice indices deep in the engine's rounds
        ("top_k", 1.5),  # ran, as top_k 1.5
        ("min_tokens", True),
        ("seed", "x"),
        ("seed", 1.0),
        ("logprobs", 2.0),
        ("temperature", "0.5"),
        ("top_p", None),
        ("repetition_penalty", float("nan")),
        ("ignore_eos", "no"),
        ("stop", 5),
        ("stop_token_ids", [1, "2"]),
    ],
)
def test_sampling_params_refuse_a_wrong_type_naming_the_field(field, value):
    """Messages start with the field's name: the server answers 400 with `param` set from it."""
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_sampling_params_numbers_and_lists():
    p = SamplingParams(temperature=1, top_p=1, stop=["a", "b"], stop_token_ids=[7])  # an int is a number
    assert (p.temperature, p.stop, p.stop_token_ids) == (1, ("a", "b"), (7,))
    assert p == SamplingParams(stop=("a", "b"), stop_token_ids=(7,))
    # numpy's numbers are numbers (stored as Python's), None is no stop strings (vLLM takes both)
    q = SamplingParams(max_tokens=np.int64(5), seed=np.uint32(3), temperature=np.float64(0.5), stop=None)
    assert (q.max_tokens, q.seed, q.temperature, q.stop) == (5, 3, 0.5, ())
    assert type(q.max_tokens) is int and type(q.seed) is int and type(q.temperature) is float
    # stop ids too (they were refused as "not token ids"): list(np.array(...)) holds numpy's ints
    r = SamplingParams(stop_token_ids=list(np.array([198, 7])))
    assert r.stop_token_ids == (198, 7) and all(type(t) is int for t in r.stop_token_ids)
    assert r == SamplingParams(stop_token_ids=[198, 7])
    for bad in ([np.int64(-1)], [np.float64(3.0)], [np.bool_(True)]):
        with pytest.raises(ValueError, match=r"^stop_token_ids must be token ids"):
            SamplingParams(stop_token_ids=bad)


def test_stop_token_ids_past_the_vocabulary_are_refused(dense_ckpt):
    """A stop id the model cannot emit could never fire: refused naming the field (the server's 400 too)."""
    llm = nextn.LLM(dense_ckpt, max_model_len=256)
    vocab = llm.model.cfg.vocab_size
    with pytest.raises(RequestError, match=rf"^stop_token_ids out of range \[0, {vocab}\): \[{vocab}\]"):
        llm.generate(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=2, stop_token_ids=(3, vocab)))
    out = llm.generate(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=2, stop_token_ids=(vocab - 1,)))
    assert len(out.token_ids) >= 1


def test_logprobs_past_the_vocabulary_are_every_token(dense_ckpt):
    """logprobs (or prompt_logprobs) above the vocabulary size was a topk RuntimeError ("selected
    index k out of range") raised out of the engine's step: it failed the requests beside it too
    while it stayed in the engine. It returns every token's logprob, as vLLM's logprobs=-1 does."""
    llm = nextn.LLM(dense_ckpt, max_model_len=256)
    vocab = llm.model.cfg.vocab_size
    alone = llm.generate(prompt_token_ids=PROMPTS[0], params=GREEDY)
    beside = llm.stream(PROMPTS[0], GREEDY)
    wide = llm.stream(PROMPTS[1], replace(GREEDY, logprobs=vocab + 7, prompt_logprobs=vocab + 7))
    assert next(beside).output is None
    out = [ev.output for ev in wide][-1]
    assert [ev.output for ev in beside][-1].token_ids == alone.token_ids
    assert [e["token_id"] for e in out.logprobs] == out.token_ids
    for entry in (*out.logprobs, *out.prompt_logprobs[1:]):
        assert sorted(t for t, _ in entry["top_logprobs"]) == list(range(vocab))


def test_a_str_stop_is_one_stop_string(dense_ckpt):
    """stop="ab" is the stop string "ab" (vLLM's meaning), not the stop strings "a" and "b"."""
    assert SamplingParams(stop="mis").stop == ("mis",)
    llm = nextn.LLM(dense_ckpt, max_model_len=256)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = llm.generate(prompt_token_ids=list(PROMPTS[1]), params=greedy).text
    # a stop string of two characters whose first one occurs earlier on its own
    i = next(i for i in range(1, len(text) - 1) if text[i] in text[:i] and text.find(text[i : i + 2]) == i)
    stop = text[i : i + 2]
    out = llm.generate(prompt_token_ids=list(PROMPTS[1]), params=replace(greedy, stop=stop))
    assert out.text == text[:i] and out.finish_reason == "stop"


# --- the install


# imported only where their feature runs: Triton kernels (on CUDA, with torch's CUDA builds), plots
# (the train extra), flash-linear-attention (train --gdn-kernel fla)
OPTIONAL_IMPORTS = {"triton", "matplotlib", "fla"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_base_dependencies_cover_what_nextn_imports():
    """`pip install nextn` (no extras) runs generate and serve: every third-party module nextn
    imports outside OPTIONAL_IMPORTS comes from a base dependency (or one of theirs)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_norm(re.split(r"[<>=!~;\[ ]", d)[0]) for d in project["dependencies"]}
    assert {"fastapi", "uvicorn", "pydantic", "huggingface-hub", "tqdm"} <= base
    covered = set(base)
    for dist in base:
        covered |= {_norm(re.split(r"[<>=!~;\[ ]", r)[0]) for r in metadata.requires(dist) or [] if "extra ==" not in r}
    modules = set()
    for path in (ROOT / "nextn").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    dists = metadata.packages_distributions()
    third_party = {m for m in modules if m in dists and m != "nextn"} - OPTIONAL_IMPORTS
    assert {"fastapi", "uvicorn", "huggingface_hub", "torch"} <= third_party
    missing = {m: dists[m] for m in third_party if not {_norm(d) for d in dists[m]} & covered}
    assert not missing
