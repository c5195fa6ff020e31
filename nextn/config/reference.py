"""The flag reference (docs/flags.md), generated from the configuration dataclasses: every flag of
`nextn serve` and `nextn generate`, its field, default and help (`python -m nextn.config`)."""

from __future__ import annotations

from nextn.config.engine_args import CLI_DEFAULTS, SERVE_DEFAULTS, EngineArgs
from nextn.config.flags import cli_fields, field_default, flags_of, shown
from nextn.config.serve import ServeConfig, ServerOptions


def reference() -> str:
    """docs/flags.md: every flag of `nextn serve` (and `generate`, which takes the engine's), as tables
    generated from the dataclasses that hold them."""
    sections = [
        (
            "Engine (`nextn serve`, `nextn generate`, `LLM(...)`)",
            "nextn.config.engine_args.EngineArgs: each field is an argument of `LLM(...)` and a flag. Where a "
            "command's default differs from the Python API's, both are shown. `generate` takes every one but "
            "`--seed` (there the request's), `serve` every one but `--trace`.",
            EngineArgs,
            {f.name: (field_default(f), _command_default(f.name)) for f in cli_fields(EngineArgs)},
        ),
        ("Server (`nextn serve`)", "nextn.config.serve.ServeConfig.", ServeConfig, {}),
        (
            "HTTP and vLLM's front end (`nextn serve`)",
            "nextn.config.serve.ServerOptions. vLLM's serve flags that mean nothing here are accepted and logged: "
            "docs/vllm_serve_flags.md.",
            ServerOptions,
            {},
        ),
    ]
    lines = ["# Flag reference", "", "Generated from the configuration dataclasses (nextn/config/) by", ""]
    lines += ["    python -m nextn.config > docs/flags.md", "", "and a test keeps this file equal to it.", ""]
    for title, intro, cls, defaults in sections:
        lines += [f"## {title}", "", intro, "", "| flag | field | default | meaning |", "|---|---|---|---|"]
        for f in cli_fields(cls):
            meta = f.metadata["cli"]
            forms = ", ".join(f"`{o}`" for o in flags_of(cls, f.name))
            python, command = defaults.get(f.name, (field_default(f), None))
            default = _cell(python) if command is None else f"{_cell(python)}; {command}"
            choices = f" (one of: {', '.join(map(str, meta['choices']))})" if "choices" in meta else ""
            text = (meta["help"] + choices).replace("|", "\\|")
            lines.append(f"| {forms} | `{f.name}` | {default} | {text} |")
        lines.append("")
    return "\n".join(lines)


def _command_default(name: str) -> str | None:
    if name in CLI_DEFAULTS:
        return f"generate, serve: `{CLI_DEFAULTS[name]}`"
    return f"serve: `{SERVE_DEFAULTS[name]}`" if name in SERVE_DEFAULTS else None


def _cell(value) -> str:
    return "-" if value is None else f"`{shown(value) if value != () else '[]'}`"
