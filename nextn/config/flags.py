"""Command-line flags generated from the configuration dataclasses: a field declared with `setting()`
is a flag, named after the field (`max_num_seqs` -> `--max-num-seqs`), with its default, help,
choices and aliases in that one place. `add_cli_args` puts a dataclass's fields on a parser and
`fields_given` reads them back: the values the user gave, and which those were (a check such as
"--p-min would do nothing" needs to know what was given, not only what the value is).

Hand-written over argparse because a flag's forms must stay one setting: two forms of one field
that disagree (`--enable-chunked-prefill --prefill steps`) are an error, not the last one winning.
nextn.config.reference writes the flag reference (docs/flags.md) from the same fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import MISSING, Field
from typing import Any

SUPPRESS = argparse.SUPPRESS


def setting(default: Any = MISSING, help: str = "", **cli: Any) -> Any:
    """A dataclass field that is a command-line flag. cli keys (all optional):
    aliases: more option strings (e.g. "--spec-k", "-tp"); type: the parse function of a value;
    choices, metavar, nargs: argparse's; negations: option strings that set a bool field False (vLLM's
    `--disable-...` forms); consts: {option string: value} flags that set the field to a value;
    positional: the metavar of a positional form (MODEL); default_factory: for mutable defaults."""
    factory = cli.pop("default_factory", MISSING)
    return dataclasses.field(default=default, default_factory=factory, metadata={"cli": {"help": help, **cli}})


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def cli_fields(cls) -> list[Field]:
    """The fields of `cls` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "cli" in f.metadata]


def field_default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def _is_bool(f: Field) -> bool:
    """A switch: a field annotated bool or bool | None (the annotations are strings here)."""
    return str(f.type).replace(" ", "") in ("bool", "bool|None")


class _Set(argparse.Action):
    """Sets a field from any of its forms, remembering which form did: a second form (another
    option string) that gives another value is an error naming both."""

    def __init__(self, option_strings, dest, const=None, nargs=None, field=None, **kw):
        self.field = field  # a positional form's dest is its own name: the field it sets is this
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        form = option_string or self.metavar
        origins = namespace.__dict__.setdefault("_origins", {})
        if self.field in origins:
            before, old, was_const = origins[self.field]
            if before != form and old != value:
                primary = flag_name(self.field)
                parser.error(_conflict(primary, (form, value, self.nargs == 0), (before, old, was_const)))
        origins[self.field] = (form, value, self.nargs == 0)
        setattr(namespace, self.field, value)


def _conflict(primary: str, a: tuple, b: tuple) -> str:
    """a, b: (form, value, whether the form is a constant's) of two forms given of one field."""
    (form_a, value_a, const_a), (form_b, value_b, const_b) = a, b
    if const_a != const_b:  # --enable-chunked-prefill means --prefill chunked, not --prefill steps
        (form, value), other = ((form_a, value_a), value_b) if const_a else ((form_b, value_b), value_a)
        return f"{form} means {primary} {shown(value)}, not {primary} {shown(other)}"
    return f"{form_b} {shown(value_b)} and {form_a} {shown(value_a)} disagree (two forms of {primary})"


def shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def add_cli_args(parser, cls, *, only=None, skip=(), defaults=None, group: str | None = None) -> None:
    """`cls`'s flag fields on `parser` (or a titled argument group of it): `only` / `skip` pick
    fields by name; `defaults` are this command's own defaults over the dataclass's (shown in --help).
    Nothing is stored for a flag not given: fields_given fills the defaults in."""
    defaults = defaults or {}
    target = parser.add_argument_group(group) if group else parser
    specs = getattr(parser, "_nextn_fields", [])
    for f in cli_fields(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        default = defaults.get(f.name, field_default(f))
        _add(target, f, default)
        specs.append((f.name, default))
    parser._nextn_fields = specs
    parser.set_defaults(_nextn_fields=specs)


def _add(target, f: Field, default) -> None:
    meta = f.metadata["cli"]
    primary = flag_name(f.name)
    common = dict(dest=f.name, default=SUPPRESS, action=_Set, field=f.name)
    help = meta["help"] + ("" if default in (None, False, "", (), []) else f" (default: {shown(default)})")
    if "positional" in meta:
        positional = {**common, "metavar": meta["positional"]}
        del positional["dest"]
        target.add_argument(f.name + "_pos", nargs="?", help=help, **positional)
        help = f"the same as {meta['positional']}"
    if _is_bool(f):
        target.add_argument(primary, *meta.get("aliases", ()), nargs=0, const=True, help=help, **common)
        target.add_argument(*_negations(f), nargs=0, const=False, help=SUPPRESS, **common)
    else:
        value = {k: meta[k] for k in ("type", "choices", "metavar", "nargs") if k in meta}
        target.add_argument(primary, *meta.get("aliases", ()), help=help, **value, **common)
    for option, const in meta.get("consts", {}).items():
        target.add_argument(option, nargs=0, const=const, help=SUPPRESS, **common)


def fields_given(args: argparse.Namespace) -> dict[str, str]:
    """The flag fields given on the command line, each with the form it was given as (`--spec-k`,
    `MODEL`); every field not given is set to its (command's) default."""
    for name, default in command_defaults(args).items():
        if not hasattr(args, name):
            setattr(args, name, default)
    return {name: form for name, (form, _, _) in getattr(args, "_origins", {}).items()}


def command_defaults(args: argparse.Namespace) -> dict:
    """The defaults of the flag fields of the command parsed (the dataclass's, or the command's own)."""
    return dict(getattr(args, "_nextn_fields", ()))


def values(args: argparse.Namespace, cls) -> dict:
    """`cls`'s flag fields read from parsed flags (those its command has)."""
    return {f.name: getattr(args, f.name) for f in cli_fields(cls) if hasattr(args, f.name)}


def flags_of(cls, name: str) -> list[str]:
    """Every option string of field `name`."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta = f.metadata["cli"]
    forms = [meta["positional"]] if "positional" in meta else []
    forms += [flag_name(name), *meta.get("aliases", ())]
    return [*forms, *(_negations(f) if _is_bool(f) else ()), *meta.get("consts", {})]


def _negations(f: Field) -> list[str]:
    """A switch's forms that set it False: `--no-NAME`, then its own (vLLM's `--disable-...`)."""
    return ["--no-" + f.name.replace("_", "-"), *f.metadata["cli"].get("negations", ())]


# --- value parsers of flags


def model_len(text: str) -> int:
    """A token count as vLLM writes it: 32768, 32k (x 1000) or 32K (x 1024), 1m / 1M likewise."""
    scale = {"k": 1000, "K": 1024, "m": 10**6, "M": 2**20}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}")
    return int(value)


def json_list(text: str) -> list[str]:
    """vLLM's list flags: a JSON list of strings ('["a", "b"]'); a bare string is a list of one."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def aliased(names: dict[str, str]):
    """A value parser that maps vLLM's other names for a value to nextn's (choices check the result)."""

    def parse(text: str) -> str:
        return names.get(text, text)

    return parse
