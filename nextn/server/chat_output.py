"""The assistant's text -> the chat message's parts: reasoning (`<think>...</think>`, with
`--reasoning-parser qwen3`), content, and the Qwen family's `<tool_call>` blocks as OpenAI tool
calls: the JSON body of the bundled / Qwen3 templates (`{"name": ..., "arguments": {...}}`) and the
XML body of the Qwen3.5 / Qwen3-Coder templates (`<function=NAME>` with `<parameter=P>` lines).

One state machine serves both modes: a stream pushes each text delta and sends back the parts it
gets; a full reply pushes its whole text once. So streamed parts always reassemble into the
non-streamed message. A marker split across deltas is held back until it is whole. Whitespace
right after `</think>`, before `<tool_call>` and after `</tool_call>` is dropped; a block whose
body does not parse stays in the content as it was written (a `</tool_call>` inside a JSON body's
string is that string's text). Does not know HTTP or the engine.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from nextn.server import protocol as P
from nextn.server import response_models as R

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
# where the reply starts: inside <think> (the prompt opened it), maybe opening one, or past it
ReasoningStart = Literal["inside", "maybe", "after"]

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


@dataclass
class Parts:
    """What one push adds to the message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[R.ToolCallOut] = field(default_factory=list)

    def delta(self, first_index: int) -> list[R.DeltaMessage]:
        """As stream deltas: text first, then each call as its header and its arguments."""
        out = []
        if self.reasoning or self.content:
            out.append(R.DeltaMessage(reasoning_content=self.reasoning or None, content=self.content or None))
        for i, call in enumerate(self.tool_calls, first_index):
            head = R.DeltaFunctionCall(name=call.function.name, arguments="")
            out.append(
                R.DeltaMessage(tool_calls=[R.DeltaToolCall(index=i, id=call.id, type="function", function=head)])
            )
            args = R.DeltaFunctionCall(arguments=call.function.arguments)
            out.append(R.DeltaMessage(tool_calls=[R.DeltaToolCall(index=i, function=args)]))
        return out


def reasoning_start(prompt: str) -> ReasoningStart:
    """Where a Qwen reply to `prompt` starts, read from its generation prompt (the text after the
    last `<|im_start|>`): past the reasoning when that closed a think block (enable_thinking off),
    inside one when it opened one (Qwen3.5), else the model may open one itself (Qwen3)."""
    tail = prompt[prompt.rfind("<|im_start|>") :]
    if THINK_END in tail:
        return "after"
    return "inside" if THINK_START in tail else "maybe"


class ChatOutputParser:
    """Splits a reply into reasoning, content and tool calls, delta by delta.

    `reasoning`: None without a reasoning parser (all text is content), else where the reply starts.
    `tools`: the request's tools when their calls are parsed (None: `<tool_call>` is plain content).
    `parallel`: False (the request's parallel_tool_calls) keeps the first call only, as vLLM does.
    `form`: "json" or "xml", the one body form read as a call (the tool-call parser's); None: either.
    """

    def __init__(
        self,
        reasoning: ReasoningStart | None,
        tools: list[P.Tool] | None,
        parallel: bool = True,
        form: str | None = None,
    ):
        self.form = form
        self.state = {None: "text", "after": "text", "inside": "think", "maybe": "maybe"}[reasoning]
        self.schemas = {t.function.name: t.function.parameters or {} for t in tools} if tools is not None else None
        self.buf = ""  # text received and not yet given out
        self.pending_ws = ""  # trailing content whitespace, held: dropped if a tool call follows
        self.strip_lead = False  # drop the content's leading whitespace (after </think> or a call)
        self.ws_before_call = ""  # pending_ws when a block opened: given back if it is no call
        self.num_calls = 0
        self.parallel = parallel
        self.in_strings = True  # a </tool_call> inside a JSON body's string is its text, not the end

    def push(self, text: str) -> Parts:
        self.buf += text
        parts = Parts()
        while self._step(parts, final=False):
            pass
        return parts

    def finish(self) -> Parts:
        """The rest, at the end of the reply: held-back text, an unterminated block."""
        parts = Parts()
        while self._step(parts, final=True):
            pass
        if self.state == "call" and CALL_END in self.buf:  # a string never closed: the first one ends it
            self.in_strings = False
            while self._step(parts, final=True):
                pass
        if self.state == "think":
            parts.reasoning += self.buf
        elif self.state == "call":  # cut short (or </tool_call> left out): a call if it parses
            self._end_call(self.buf, parts, closed=False)
        else:
            self._content(self.buf, parts)
        self.buf = ""
        parts.content += self.pending_ws
        self.pending_ws = ""
        return parts

    def _step(self, parts: Parts, final: bool) -> bool:
        """Move past one marker if the buffer holds it; False when it needs more text."""
        if self.state == "maybe":
            if self.buf.startswith(THINK_START):
                self.buf, self.state = self.buf[len(THINK_START) :], "think"
                return True
            if THINK_START.startswith(self.buf) and not final:
                return False
            self.state = "text"
            return True
        if self.state == "think":
            head, found, self.buf = _split(self.buf, THINK_END, final)
            parts.reasoning += head
            if found:
                self.state, self.strip_lead = "text", True
            return found
        if self.state == "text":
            if self.schemas is None:
                self._content(self.buf, parts)
                self.buf = ""
                return False
            head, found, self.buf = _split(self.buf, CALL_START, final)
            self._content(head, parts)
            if found:
                self.state, self.ws_before_call, self.pending_ws = "call", self.pending_ws, ""
            return found
        at = _call_end(self.buf, self.in_strings)
        if at >= 0:
            body, self.buf = self.buf[:at], self.buf[at + len(CALL_END) :]
            self._end_call(body, parts, closed=True)
        return at >= 0

    def _content(self, text: str, parts: Parts) -> None:
        if self.strip_lead:
            text = text.lstrip()
            if not text:
                return
            self.strip_lead = False
        if self.schemas is None:
            parts.content += text
            return
        text = self.pending_ws + text
        body = text.rstrip()
        self.pending_ws = text[len(body) :]
        parts.content += body

    def _end_call(self, body: str, parts: Parts, closed: bool) -> None:
        call = parse_tool_call(body, self.schemas or {}, self.form)
        self.state, self.strip_lead = "text", call is not None
        if call is None:  # not a call after all: the block stays in the content as written
            self.pending_ws = self.ws_before_call
            self._content(CALL_START + body + (CALL_END if closed else ""), parts)
            return
        if self.num_calls and not self.parallel:  # a call past the first: dropped, not content
            return
        name, args = call
        self.num_calls += 1
        fn = R.FunctionCallOut(name=name, arguments=_arguments_text(args))
        parts.tool_calls.append(R.ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}", function=fn))


def _split(buf: str, marker: str, final: bool) -> tuple[str, bool, str]:
    """(text before `marker`, found, text after it); without it, the text that cannot be the
    start of a split marker, and that start held back (unless `final`)."""
    head, found, rest = buf.partition(marker)
    if found:
        return head, True, rest
    keep = 0 if final else next((n for n in range(len(marker) - 1, 0, -1) if buf.endswith(marker[:n])), 0)
    return buf[: len(buf) - keep], False, buf[len(buf) - keep :]


def _call_end(buf: str, in_strings: bool) -> int:
    """Where the `</tool_call>` that ends a block's body `buf` is (-1: none yet). In a JSON body, one
    inside a string is its text (a forced call's grammar lets an argument hold it), unless not
    `in_strings`."""
    at = buf.find(CALL_END)
    if in_strings and buf.lstrip().startswith("{"):
        while at >= 0 and len(_JSON_QUOTE.findall(buf, 0, at)) % 2:
            at = buf.find(CALL_END, at + 1)
    return at


_JSON_QUOTE = re.compile(r'(?<!\\)(?:\\\\)*"')  # a quote not escaped: starts or ends a JSON string


def parse_tool_call(body: str, schemas: dict[str, dict], form: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one `<tool_call>` body, JSON or XML (`form`: that one only); None if it is neither."""
    m = _FUNCTION.fullmatch(body) if form != "json" else None
    if form == "xml" and m is None:
        return None
    if m:
        parameters = schemas.get(m.group(1))
        props, _ = schema_properties(parameters)
        memo: dict = {}  # the walks of one call's parameters share what they read of its schema
        return m.group(1), {
            p: _xml_value(v.removeprefix("\n").removesuffix("\n"), props.get(p), parameters, memo)
            for p, v in _PARAMETER.findall(m.group(2))
        }
    try:
        obj = _loads(body)
        args = obj.get("arguments", obj.get("parameters", {}))
        args = _loads(args) if isinstance(args, str) else args
    except (ValueError, AttributeError):
        return None
    if not isinstance(obj.get("name"), str) or not _is_text(obj["name"]) or not isinstance(args, dict):
        return None
    return obj["name"], args


def _loads(text: str) -> Any:
    """JSON, strictly: NaN and Infinity are not JSON (json.loads takes them, and json.dumps would
    write them into the arguments, which a client's JSON parser refuses)."""
    return json.loads(text, parse_constant=_not_json)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _is_text(text: str) -> bool:
    """False for a string holding a lone surrogate (from a JSON escape the model wrote): no UTF-8."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _arguments_text(args: dict) -> str:
    """A call's arguments as JSON text: as written, but a lone surrogate escaped again (written raw
    it cannot be encoded, and the response failed)."""
    text = json.dumps(args, ensure_ascii=False)
    return text if _is_text(text) else json.dumps(args)


def schema_properties(parameters: dict | None) -> tuple[dict, set[str]]:
    """A tool's parameters schema's (properties, required names), whatever the client sent."""
    props, required = (parameters or {}).get("properties"), (parameters or {}).get("required")
    required = required if isinstance(required, list) else []
    return (props if isinstance(props, dict) else {}), {r for r in required if isinstance(r, str)}


def _xml_value(text: str, schema: Any, parameters: Any, memo: dict | None = None) -> Any:
    """An XML parameter's text as its schema's types (`parameters`: the tool's schema, the root of
    its `$ref`s): strings as written (the templates write them raw), booleans and null as the
    templates write them (Python's True/False/None) or JSON, the rest as JSON. A schema that names no
    type (`anyOf`, `$ref`, `enum`, {}) takes JSON when the text is JSON, as the tool_choice grammar
    writes such a value (a string-only one, as `{"enum": ["C", "F"]}`, it writes raw, as a string
    schema's)."""
    if schema is None:  # a parameter the tool does not declare
        return text
    types = schema_types(schema, parameters, memo)
    if types <= {"string"}:
        return text
    if "boolean" in types and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    if "null" in types and text.strip() == "None":
        return None
    try:
        value = _loads(text)
    except ValueError:
        return text
    kind = _JSON_TYPES.get(type(value))
    if "string" in types and None not in types and kind not in types and not (kind == "integer" and "number" in types):
        return text  # `123` for a string-or-null parameter: the string, as written
    return value


_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number"}
_JSON_TYPES |= {str: "string", list: "array", dict: "object"}


MAX_SCHEMA_DEPTH = 16  # `$ref` hops and `anyOf` / `oneOf` levels a schema walk follows; deeper: unread


def schema_types(schema: Any, root: Any, memo: dict | None = None) -> set[str | None]:
    """The JSON types `schema` allows, read from `type`, or through `$ref` (into `root`), `anyOf` /
    `oneOf`, `enum` and `const`; None in the set when a schema says nothing it can read.

    Memoised per (subschema, depth): a client's `anyOf` of `$ref`s that all lead to one definition,
    nested a few levels, is walked once per node, not once per path (9 branches 8 deep were 9**8
    paths, minutes of CPU). `memo` may be shared by the calls of one request over one `root`."""
    return _schema_types(schema, root, 0, {} if memo is None else memo)


def _schema_types(schema: Any, root: Any, depth: int, memo: dict) -> set[str | None]:
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return {None}
    key = ("types", id(schema), depth)
    if key in memo:
        return memo[key]
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        found = {t for t in types if isinstance(t, str)} or {"string"}  # a type it cannot read: the text
    elif (target := _ref_target(schema, root)) is not None:
        found = _schema_types(target, root, depth + 1, memo)
    elif branches := _branches(schema):
        found = set().union(*(_schema_types(b, root, depth + 1, memo) for b in branches))
    else:
        found = {_JSON_TYPES.get(type(v)) for v in _values(schema) or []} or {None}
    memo[key] = found
    return found


def string_choices(schema: Any, root: Any, memo: dict | None = None) -> list[str] | None:
    """The strings a string schema allows when it lists them (`enum`, `const`, through `$ref` and
    `anyOf` / `oneOf`), in order; None when it allows any string (or says nothing it can read).
    Memoised as schema_types."""
    return _string_choices(schema, root, 0, {} if memo is None else memo)


def _string_choices(schema: Any, root: Any, depth: int, memo: dict) -> list[str] | None:
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return None
    key = ("choices", id(schema), depth)
    if key in memo:
        return memo[key]
    values = _values(schema)
    if values is not None:
        found = values if all(isinstance(v, str) for v in values) else None
    elif (target := _ref_target(schema, root)) is not None:
        found = _string_choices(target, root, depth + 1, memo)
    elif branches := _branches(schema):
        parts = [_string_choices(b, root, depth + 1, memo) for b in branches]
        found = None if any(p is None for p in parts) else list(dict.fromkeys(v for p in parts for v in p))
    else:
        found = None
    memo[key] = found
    return found


def _values(schema: dict) -> list | None:
    """A schema's listed values (`enum`, or `const` as one), None when it lists none."""
    return schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else None


def _branches(schema: dict) -> list:
    return [b for k in ("anyOf", "oneOf") if isinstance(schema.get(k), list) for b in schema[k]]


def _ref_target(schema: dict, root: Any) -> Any:
    """What a local `$ref` ("#/$defs/X") points at in `root`, None without one."""
    ref = schema.get("$ref")
    if not (isinstance(ref, str) and ref.startswith("#")):
        return None
    target = root
    for key in filter(None, ref[1:].split("/")):
        key = key.replace("~1", "/").replace("~0", "~")
        target = target.get(key) if isinstance(target, dict) else None
    return target
