"""Request fields -> `SamplingParams.structured_outputs`: the one constraint a request sets, from
`response_format`, vLLM's `structured_outputs` or its older `guided_*` fields, or `tool_choice`
"required" / a named function (a Lark grammar of the chat template's own `<tool_call>` form), checked
by compiling it in a worker process (a 400 naming the field when it does not compile in time).

With a reasoning parser the constraint applies after the reasoning: it is wrapped in a Lark grammar
that lets `<think>`'s text through first (`reasoning_grammar`). The grammars use llguidance's Lark
(`%json`, `%lark`, `<token>` for an added token). Does not know HTTP or the engine.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from nextn.core import STRUCTURED_OUTPUT_KEYS
from nextn.grammar import choice_terminal, json_schema, limits
from nextn.grammar.compile import added_tokens
from nextn.grammar.sandbox import check_grammar
from nextn.server import protocol as P
from nextn.server.chat_output import (
    CALL_END,
    CALL_START,
    THINK_END,
    THINK_START,
    ReasoningStart,
    schema_properties,
    schema_types,
    string_choices,
)
from nextn.server.protocol import FieldError
from nextn.tokenizer import Tokenizer

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM's structured_outputs options that ask for what nextn does anyway: JSON without free
# whitespace (JSON_OPTIONS), and no fallback to another backend
_AS_DONE = ("disable_any_whitespace", "disable_fallback")
# a line of an XML tool-call string value (one lexeme a line: the line "</parameter>" ends the
# value): any text without the markers the parser ends a value or a call at
_XML_LINE = r"/[^\n]*\n/ & ~/(?s:.*<\/(parameter|tool_call)>.*)/"


def request_constraint(req: P.SamplingRequest) -> tuple[str, dict[str, Any]] | None:
    """(the field it came from, the constraint) of the structured-output field the request sets.
    Refusals (here and below) are FieldErrors: prepare.py answers them 400 naming the field."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        found.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
    if req.structured_outputs:
        given = {k: v for k, v in req.structured_outputs.items() if v not in (None, False)}
        given = {k: v for k, v in given.items() if not (k in _AS_DONE and v is True)}
        for key in given:
            if key not in STRUCTURED_OUTPUT_KEYS:
                keys = ", ".join(STRUCTURED_OUTPUT_KEYS)
                raise FieldError(f"structured_outputs.{key}", f"is not supported (give one of {keys})")
        found += [(f"structured_outputs.{k}", {k: v}) for k, v in given.items()]
    found += [(name, {kind: getattr(req, name)}) for name, kind in _GUIDED.items() if getattr(req, name) is not None]
    if len(found) > 1:
        raise FieldError(found[1][0], f"give one structured output constraint, not {found[0][0]} and this")
    return found[0] if found else None


def checked(field: str, constraint: dict[str, Any], tok: Tokenizer) -> dict[str, Any]:
    """`constraint`, once it compiles in a worker process with time and memory limits (the reason it
    does not, named after `field`; the engine compiles it again, within those limits: sandbox.py)."""
    try:
        check_grammar(constraint, tok)
    except ValueError as e:
        raise FieldError(field, str(e)) from None
    return constraint


# ---------------------------------------------------------------------------------------------
# tool_choice


def forces_call(req: P.ChatCompletionRequest) -> bool:
    """tool_choice "required" or a named function: the reply is a call, held to tool_grammar."""
    return req.tool_choice is not None and req.tool_choice not in ("auto", "none")


def template_call_form(tok: Tokenizer) -> str:
    """The `<tool_call>` body form the chat template writes: "xml" (`<function=...>`, Qwen3.5's) or "json"."""
    return "xml" if "<function=" in (tok.chat_template or "") else "json"


def tool_grammar(req: P.ChatCompletionRequest, tok: Tokenizer) -> str | None:
    """The Lark grammar that enforces `tool_choice` ("required" or a named function) in the chat
    template's `<tool_call>` form, the one the model learned to write (whatever --tool-call-parser
    names: a model forced into a form it never wrote may never close an argument); None when the
    choice leaves the model free."""
    choice = req.tool_choice
    if not forces_call(req):
        return None
    if not req.tools:
        raise FieldError("tool_choice", "calls a tool: give tools")
    tools = req.tools
    if isinstance(choice, P.NamedToolChoice):
        tools = [t for t in req.tools if t.function.name == choice.function.name]
        if not tools:
            names = ", ".join(t.function.name for t in req.tools)
            raise FieldError("tool_choice.function.name", f"{choice.function.name!r} is not in tools ({names})")
    for t in tools:  # the schemas the grammar embeds (`%json`), held to the limits a guided_json is
        if t.function.parameters is not None:
            try:
                limits.check_schema(json_schema(t.function.parameters), "a tool's parameters", added_tokens(tok))
            except ValueError as e:
                raise FieldError("tool_choice", str(e)) from None
    body = _xml_calls(tools) if template_call_form(tok) == "xml" else _json_calls(tools)
    calls = "call" if isinstance(choice, P.NamedToolChoice) or not req.parallel_tool_calls else 'call ("\\n" call)*'
    return f'start: "\\n"? {calls}\ncall: {_marker(CALL_START, tok)} "\\n" fn "\\n" {_marker(CALL_END, tok)}\n{body}'


def _json_calls(tools: list[P.Tool]) -> str:
    """`{"name": ..., "arguments": {...}}` as the template writes it: the head as text, the arguments
    as JSON against the tool's parameters schema at its own root (so its `$ref`s resolve)."""
    rules = [f"fn: {' | '.join(f'f{i}' for i in range(len(tools)))}"]
    for i, t in enumerate(tools):
        head = json.dumps(f'{{"name": {json.dumps(t.function.name, ensure_ascii=False)}, "arguments": ')
        rules.append(f'f{i}: {head} a{i} "}}"')
        parameters = t.function.parameters
        if parameters is None:  # OpenAI's "no parameters": the arguments are {}, not any object
            parameters = {"properties": {}, "additionalProperties": False}
        rules.append(f"a{i}: {_json_value({'type': 'object', **parameters}, {})}")
    return "\n".join(rules)


def _xml_calls(tools: list[P.Tool]) -> str:
    """`<function=NAME>` with a `<parameter=P>` block per argument, in the schema's order (the
    required ones always): strings as lines (one of a listed few as that line), other types as JSON."""
    rules = [f"fn: {' | '.join(f'f{i}' for i in range(len(tools)))}", "xstr: XLINE*", f"XLINE: {_XML_LINE}"]
    for i, t in enumerate(tools):
        props, required = schema_properties(t.function.parameters)
        items = []
        for j, (name, schema) in enumerate(props.items()):
            # strings raw, as the parser reads them (by its types: `{"enum": ["C", "F"]}` is one too)
            is_str = schema_types(schema, t.function.parameters) <= {"string"}
            choices = string_choices(schema, t.function.parameters) if is_str else None
            value = "xstr" if is_str and not choices else f'v{i}_{j} "\\n"' if not is_str else f"v{i}_{j}"
            if not is_str:
                rules.append(f"v{i}_{j}: {_json_value(schema, t.function.parameters or {})}")
            elif choices:  # each as the template writes it: its text, then the line's end
                alts = " | ".join(json.dumps(c + "\n", ensure_ascii=False) for c in choices)
                rules.append(f"v{i}_{j}: {alts}")
            head = json.dumps(f"<parameter={name}>\n")
            rules.append(f'p{i}_{j}: {head} {value} "</parameter>\\n"')
            items.append(f"p{i}_{j}" + ("" if name in required else "?"))
        head = json.dumps(f"<function={t.function.name}>\n")
        rules.append(f'f{i}: {head} {" ".join(items)} "</function>"')
    return "\n".join(rules)


def _json_value(schema: Any, parameters: dict) -> str:
    """`%json` of `schema` (a tool's parameters, or one parameter's schema in them), written as the
    template's `tojson` writes it (json.dumps' separators, one line: a bare `%json` lets a small
    model fill its budget with whitespace), with the parameters' definitions for its `$ref`s."""
    if isinstance(schema, dict):
        schema = {**{k: parameters[k] for k in ("$defs", "definitions") if k in parameters}, **schema}
    try:
        return f"%json {json.dumps(json_schema(schema))}"
    except ValueError as e:
        raise FieldError("tool_choice", f"a tool's parameters schema: {e}") from None


def _marker(text: str, tok: Tokenizer) -> str:
    """`text` in a Lark rule: its added token when the vocabulary has one (llguidance matches an
    added token only by its id), else the literal string."""
    return text if tok.token_to_id(text) is not None else json.dumps(text)  # "<x>" is Lark for token <x>


# ---------------------------------------------------------------------------------------------
# reasoning


def reasoning_grammar(constraint: dict[str, Any], start: ReasoningStart) -> dict[str, Any]:
    """`constraint`, applied after the reply's `<think>...</think>` (Qwen's added tokens): inside
    one, the text up to `</think>` is free; when the model may open one, it is optional."""
    if start == "after":
        return constraint
    ((kind, value),) = constraint.items()
    if kind in ("json", "json_object"):  # with the same JSON_OPTIONS as without the reasoning
        body = f"%json {json.dumps(json_schema({'type': 'object'} if kind == 'json_object' else value))}"
    elif kind == "regex":
        body = f"/{llguidance.regex_to_lark(value, '')}/"
    elif kind == "choice":
        body = f"CHOICE\n{choice_terminal(value)}"
    else:
        body = f"%lark {{\n{any_to_lark(value)}\n}}"  # GBNF given as Lark
    think = rf"/(?s:.*)/ {THINK_END} /[ \t\r\n]*/"  # "<x>" is Lark for the token <x>
    head = think if start == "inside" else f"({THINK_START} {think})?"
    return {"grammar": f"start: {head} body\nbody: {body}\n"}
