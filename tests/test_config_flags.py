"""One configuration path (issue 48): the flags of `nextn serve` and `nextn generate` are generated
from the configuration dataclasses (EngineArgs, ServeConfig, ServerOptions), so every flag is a field
and every field a flag; two forms of one field that disagree are an error; the settings a user gave
are known as given (an error names the flag, or the keyword, as written); and docs/flags.md is what
the dataclasses generate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import nextn
from nextn.cli import build_parser, main, parse_args
from nextn.config.engine_args import SERVE_DEFAULTS, EngineArgs
from nextn.config.flags import cli_fields, field_default
from nextn.config.reference import reference
from nextn.config.serve import ServeConfig, ServerOptions

ROOT = Path(__file__).resolve().parents[1]
# not a setting of any dataclass: argparse's --help and the logging level every command takes
NOT_SETTINGS = {"help", "log_level"}
# EngineArgs fields serve has no flag for, and why: trace's per-round records have no place in a response
SERVE_SKIPS = {"trace"}


def _subparser(name: str):
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices[name]


def _fields_of_flags(parser) -> dict[str, set[str]]:
    """The settings the parser's flags set (vLLM's accepted-and-ignored flags aside), each with its forms."""
    out: dict[str, set[str]] = {}
    for action in parser._actions:
        if action.dest.startswith("_vllm_") or action.dest in NOT_SETTINGS:
            continue
        field = getattr(action, "field", action.dest)
        out.setdefault(field, set()).update(action.option_strings or [action.metavar])
    return out


def test_every_serve_flag_is_a_field_and_every_field_a_flag():
    flags = _fields_of_flags(_subparser("serve"))
    fields = {f.name for cls in (EngineArgs, ServeConfig, ServerOptions) for f in cli_fields(cls)}
    assert set(flags) == fields - SERVE_SKIPS
    # a field's flag is its name with dashes
    assert all(f"--{name.replace('_', '-')}" in forms for name, forms in flags.items())


def test_generate_takes_every_engine_field():
    flags = _fields_of_flags(_subparser("generate"))
    engine = {f.name for f in cli_fields(EngineArgs)}
    assert engine <= set(flags) | {"seed"} and "seed" in flags  # its --seed is the request's (sampling)
    assert not {f.name for cls in (ServeConfig, ServerOptions) for f in cli_fields(cls)} & set(flags)


def test_defaults_come_from_the_dataclasses_or_the_commands_own():
    args = parse_args(["serve"])
    for cls in (EngineArgs, ServeConfig, ServerOptions):
        for f in cli_fields(cls):
            if f.name not in SERVE_SKIPS:
                assert getattr(args, f.name) == SERVE_DEFAULTS.get(f.name, field_default(f)), f.name
    built = EngineArgs.from_cli(args)
    assert built.given == {} and (built.prefill, built.k_policy) == ("steps", "auto")
    assert EngineArgs.of().prefill == "chunked" and EngineArgs.of().k_policy == "fixed"


def test_the_cli_and_llm_build_the_same_engine_config():
    cli = EngineArgs.from_cli(parse_args(["serve", "--spec-k", "2", "--max-num-seqs", "3", "--device", "cpu"]))
    api = EngineArgs.of(num_speculative_tokens=2, max_num_seqs=3, device="cpu", prefill="steps", k_policy="auto")
    assert cli.given == {"num_speculative_tokens": "--spec-k", "max_num_seqs": "--max-num-seqs", "device": "--device"}
    one = cli.engine_config("m", "cpu", "float32", None, None, None)
    assert one == api.engine_config("m", "cpu", "float32", None, None, None)
    assert one.spec.num_speculative_tokens == 2 and one.max_num_seqs == 3 and one.prefill == "steps"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--spec-k", "2", "--num-speculative-tokens", "3"], "--spec-k 2 and --num-speculative-tokens 3 disagree"),
        (["--no-enable-chunked-prefill", "--prefill", "chunked"], "--no-enable-chunked-prefill means --prefill steps"),
        (["--disable-log-stats", "--log-interval", "5"], "--disable-log-stats means --log-interval 0.0"),
    ],
)
def test_two_forms_of_a_field_that_disagree_are_an_error(argv, message, capsys):
    with pytest.raises(SystemExit, match="2"):
        parse_args(["serve", *argv])
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_two_forms_that_agree_are_one_setting():
    args = parse_args(["serve", "--spec-k", "2", "--num-speculative-tokens", "2", "--disable-uvicorn-access-log"])
    assert args.num_speculative_tokens == 2 and args.access_log is False
    assert parse_args(["serve", "--port", "1", "--port", "2"]).port == 2  # one form repeated: the last, as argparse


def test_errors_name_the_setting_as_it_was_written(capsys):
    with pytest.raises(ValueError, match=r"^p_min would do nothing"):
        EngineArgs.of(num_speculative_tokens=0, p_min=0.5)
    assert main(["serve", "--num-speculative-tokens", "0", "--hidden-before-norm", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("nextn: error: --hidden-before-norm would do nothing")
    with pytest.raises(TypeError, match="unknown engine settings: max_batch"):
        nextn.LLM(max_batch=4)


def test_engine_args_are_checked_once_when_made():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs.of(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineArgs.of(max_num_seqs=0, device="cpu")
    args = EngineArgs.of(num_speculative_tokens=2, device="cpu")
    assert dataclasses.replace(args, device="cpu").given == args.given  # the ranks' copy keeps what was given


def test_the_flag_reference_is_generated_from_the_dataclasses():
    text = reference()
    assert (ROOT / "docs" / "flags.md").read_text() == text, (
        "docs/flags.md is stale: python -m nextn.config > docs/flags.md"
    )
    for cls in (EngineArgs, ServeConfig, ServerOptions):
        for f in cli_fields(cls):
            assert f"| `{f.name}` |" in text
