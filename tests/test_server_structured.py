"""Structured outputs, tool calls and reasoning on `nextn serve` (issue 14's API side).

The output parser (nextn.server.chat_output) is checked on its own: every way of cutting a reply
into stream deltas gives the parts the whole reply gives. The tool_choice grammars are checked
against the chat templates' own rendering of a call (what the template writes, the grammar takes).
End to end, a real uvicorn server over the bundled model (greedy, fast on the CPU) driven by the
openai client and raw httpx: each request field constrains the output as it says, each bad value
is a 400 naming its field, a tool call round-trips, streamed tool calls and reasoning reassemble to
the non-streamed reply.
"""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

from test_server import KEY, LiveServer, user  # noqa: E402

from nextn import LLM  # noqa: E402
from nextn.config import DEFAULT_MODEL_DIR  # noqa: E402
from nextn.config.serve import ServeConfig, ServerOptions  # noqa: E402
from nextn.grammar import compile_grammar  # noqa: E402
from nextn.server import protocol as P  # noqa: E402
from nextn.server import structured  # noqa: E402
from nextn.server.chat_output import ChatOutputParser, Parts, reasoning_start  # noqa: E402
from nextn.tokenizer import Tokenizer  # noqa: E402

MODEL = "bundled"
CFG = ServeConfig(api_key=KEY, served_model_name=MODEL)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
TOOLS = [P.Tool.model_validate(WEATHER), P.Tool.model_validate(TIME)]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},  # bounded: a greedy model may write 0s forever
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


# ---------------------------------------------------------------------------------------------
# The output parser


def parse(text: str, reasoning=None, tools=TOOLS, cut: int | None = None) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, [(name, arguments)]) of `text` pushed whole, or in pieces of `cut` chars."""
    parser = ChatOutputParser(reasoning, tools)
    pieces = [text] if cut is None else [text[i : i + cut] for i in range(0, len(text), cut)]
    got = Parts()
    for parts in [parser.push(p) for p in pieces] + [parser.finish()]:
        got.reasoning += parts.reasoning
        got.content += parts.content
        got.tool_calls += parts.tool_calls
    return got.reasoning, got.content, [(c.function.name, c.function.arguments) for c in got.tool_calls]


JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n</function>\n</tool_call>"
)
REPLIES = [
    # (text, reasoning start, expected (reasoning, content, calls))
    ("Hello there.\n", None, ("", "Hello there.\n", [])),
    (f"Let me look.\n\n{JSON_CALL}\n", None, ("", "Let me look.", [("get_weather", '{"city": "Paris", "days": 2}')])),
    (
        f"{XML_CALL}\n{JSON_CALL}",
        None,
        (
            "",
            "",
            [
                ("get_weather", '{"city": "New York", "days": 3, "metric": true}'),
                ("get_weather", '{"city": "Paris", "days": 2}'),
            ],
        ),
    ),
    ("a <tool_call>not json</tool_call> b <tool_c", None, ("", "a <tool_call>not json</tool_call> b <tool_c", [])),
    (f"{JSON_CALL[:-12]}", None, ("", "", [("get_weather", '{"city": "Paris", "days": 2}')])),  # cut before the end
    ("<think>\nhm, rain?\n</think>\n\nIt rains.", "maybe", ("\nhm, rain?\n", "It rains.", [])),
    ("No think.", "maybe", ("", "No think.", [])),
    ("<thi", "maybe", ("", "<thi", [])),
    (
        f"the user wants weather\n</think>\n\n{JSON_CALL}",
        "inside",
        ("the user wants weather\n", "", [("get_weather", '{"city": "Paris", "days": 2}')]),
    ),
    ("still thinking </thi", "inside", ("still thinking </thi", "", [])),
    ("<think>x</think>y", "after", ("", "<think>x</think>y", [])),
    (  # "</tool_call>" as an argument's text (a forced call's grammar lets a JSON string hold it)
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\"</tool_call>\\\\"}}\n</tool_call> ok',
        None,
        ("", "ok", [("get_weather", '{"city": "\\"</tool_call>\\\\"}')]),
    ),
    (  # a string never closed: the block ends at its first </tool_call> after all, as content
        f'<tool_call>{{"name": "f", "arguments": {{"a": "b}}</tool_call> x {JSON_CALL}',
        None,
        (
            "",
            '<tool_call>{"name": "f", "arguments": {"a": "b}</tool_call> x',
            [("get_weather", '{"city": "Paris", "days": 2}')],
        ),
    ),
]


@pytest.mark.parametrize("text, start, expected", REPLIES)
def test_the_parser_splits_a_reply_the_same_at_every_cut(text, start, expected):
    assert parse(text, start) == expected
    for cut in range(1, len(text) + 1):
        assert parse(text, start, cut=cut) == expected, cut


def test_without_tools_a_tool_call_is_content():
    assert parse(JSON_CALL, tools=None) == ("", JSON_CALL, [])


def test_xml_values_follow_the_schema_types():
    schema = {"properties": {"s": {"type": "string"}, "n": {"type": "number"}, "o": {"type": "object"}}}
    tool = P.Tool(function=P.FunctionDefinition(name="f", parameters=schema))
    body = "<function=f>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in {"s": "42", "n": "4.5", "o": '{"a": [1]}', "x": "7"}.items()
    )
    _, _, calls = parse(f"<tool_call>\n{body}</function>\n</tool_call>", tools=[tool])
    assert json.loads(calls[0][1]) == {"s": "42", "n": 4.5, "o": {"a": [1]}, "x": "7"}


def test_without_parallel_tool_calls_a_reply_keeps_its_first_call():
    """tool_choice "auto" has no grammar to hold the model to one call: the calls past the first are
    dropped (vLLM's), streamed or not."""
    from nextn.server.completions import output_parser

    srv = SimpleNamespace(prompts=SimpleNamespace(tok=None), opts=ServerOptions())
    text = f"Let me check. {JSON_CALL}\n{JSON_CALL.replace('Paris', 'Oslo')} done"
    for parallel, names in [(True, ["Paris", "Oslo"]), (False, ["Paris"])]:
        req = P.ChatCompletionRequest(messages=[user("x")], tools=TOOLS, parallel_tool_calls=parallel)
        for cut in (1, 7, len(text)):
            parser, got = output_parser(srv, req, None), Parts()
            for parts in [parser.push(text[i : i + cut]) for i in range(0, len(text), cut)] + [parser.finish()]:
                got.content += parts.content
                got.tool_calls += parts.tool_calls
            assert [json.loads(c.function.arguments)["city"] for c in got.tool_calls] == names
            assert got.content == "Let me check.done" and parser.num_calls == len(names)


def test_xml_values_of_schemas_without_a_type():
    """anyOf (pydantic's Optional), $ref, enum, {}: the JSON the tool_choice grammar writes for them
    is read as JSON (a $ref'd object was its JSON text, a string kept its quotes); raw text stays text."""
    schema = {
        "$defs": {"Unit": {"enum": ["C", "F"]}, "Point": {"type": "object"}},
        "properties": {
            "opt": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "unit": {"$ref": "#/$defs/Unit"},
            "at": {"$ref": "#/$defs/Point"},
            "any": {},
        },
    }
    tool = P.Tool(function=P.FunctionDefinition(name="f", parameters=schema))

    def args(**values):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        return json.loads(parse(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>", tools=[tool])[2][0][1])

    assert args(opt='"x"', unit="C", at='{"x": 1}', any="[1]") == {
        "opt": "x",
        "unit": "C",
        "at": {"x": 1},
        "any": [1],
    }
    assert args(opt="null", any='"s"') == {"opt": None, "any": "s"}
    assert args(opt="Oslo", unit="F", any="free text") == {"opt": "Oslo", "unit": "F", "any": "free text"}
    assert args(opt="123") == {"opt": "123"}  # a string-or-null parameter: the digits as written


def test_tool_call_arguments_are_always_json_a_client_can_read():
    """A lone surrogate escape in a call (the model's, under "auto") stays escaped in the arguments
    (written raw it could not be encoded: a 500); NaN / Infinity are not JSON: no call takes them."""
    for value, expected in [("\\ud83d", '{"city": "\\ud83d"}'), ("\\ud83d\\ude00", '{"city": "\U0001f600"}')]:
        text = f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{value}"}}}}\n</tool_call>'
        assert parse(text) == ("", "", [("get_weather", expected)])
    lone = text.replace("get_weather", "\\ud83d")  # not a name: the block stays content, as written
    assert parse(lone) == ("", lone, [])
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x", "days": NaN}}\n</tool_call>'
    assert parse(text) == ("", text, [])
    tool = P.Tool(function=P.FunctionDefinition(name="f", parameters={"properties": {"n": {"type": "number"}}}))
    xml = "<tool_call>\n<function=f>\n<parameter=n>\n-Infinity\n</parameter>\n</function>\n</tool_call>"
    assert parse(xml, tools=[tool])[2] == [("f", '{"n": "-Infinity"}')]


def test_xml_nulls_read_back_as_the_template_writes_them(xml_model_dir):
    """The XML templates write a null argument as Python's `None` (`| string`): a nullable
    parameter reads it back as null (it was the string "None"), as it reads `True` as true."""
    optional = {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    schema = {"properties": {"n": optional, "s": {"type": ["string", "null"]}, "b": {"type": ["boolean", "null"]}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    for args in ({"n": None, "s": None, "b": None}, {"n": 3, "s": "x", "b": True}):
        text = rendered_call(xml_model_dir, [tool], {"name": "f", "arguments": args})
        assert parse(text, tools=[P.Tool.model_validate(tool)])[2] == [("f", json.dumps(args))], text


def test_streamed_deltas_carry_each_call_as_header_then_arguments():
    parser = ChatOutputParser(None, TOOLS)
    deltas = parser.push(JSON_CALL + JSON_CALL).delta(0) + parser.finish().delta(2)
    heads = [d.tool_calls[0] for d in deltas if d.tool_calls[0].id is not None]
    assert [(h.index, h.function.name, h.function.arguments) for h in heads] == [(0, "get_weather", "")] * 0 + [
        (0, "get_weather", ""),
        (1, "get_weather", ""),
    ]
    args = [d.tool_calls[0] for d in deltas if d.tool_calls[0].id is None]
    assert [(a.index, json.loads(a.function.arguments)) for a in args] == [(0, {"city": "Paris", "days": 2})] + [
        (1, {"city": "Paris", "days": 2})
    ]


def test_reasoning_start_reads_the_generation_prompt():
    history = "<|im_start|>assistant\n<think>\nold\n</think>\n\nhi<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
    assert reasoning_start(history + "<|im_start|>assistant\n<think>\n") == "inside"
    assert reasoning_start(history + "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "after"
    assert reasoning_start(history + "<|im_start|>assistant\n") == "maybe"


# ---------------------------------------------------------------------------------------------
# Request fields -> constraints, and the grammars


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL_DIR)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"response_format": {"type": "json_object"}}, ("response_format", {"json_object": True})),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": PERSON, "strict": True},
                }
            },
            ("response_format.json_schema.schema", {"json": PERSON}),
        ),
        ({"structured_outputs": {"regex": "a+"}}, ("structured_outputs.regex", {"regex": "a+"})),
        (
            {"structured_outputs": {"choice": ["x"], "disable_any_whitespace": False}},
            ("structured_outputs.choice", {"choice": ["x"]}),
        ),
        (  # vLLM's options that ask for what the server does anyway (compact JSON, no fallback)
            {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True, "disable_fallback": True}},
            ("structured_outputs.json", {"json": PERSON}),
        ),
        ({"guided_json": PERSON}, ("guided_json", {"json": PERSON})),
        ({"guided_regex": "[0-9]+"}, ("guided_regex", {"regex": "[0-9]+"})),
        ({"guided_choice": ["yes", "no"]}, ("guided_choice", {"choice": ["yes", "no"]})),
        ({"guided_grammar": 'start: "a"'}, ("guided_grammar", {"grammar": 'start: "a"'})),
        ({"response_format": {"type": "text"}}, None),
        ({}, None),
    ],
)
def test_each_field_maps_to_its_constraint(fields, expected):
    for req in (P.CompletionRequest(prompt="x", **fields), P.ChatCompletionRequest(messages=[user("x")], **fields)):
        assert structured.request_constraint(req) == expected


def rendered_call(template_dir, tools: list[dict], call: dict) -> str:
    """What the chat template writes for an assistant turn holding `call` (after its header)."""
    tok = Tokenizer(template_dir)
    msgs = [user("x"), {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False, tools=tools)
    return text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") : text.rindex("<|im_end|>")]


@pytest.fixture(scope="module")
def xml_model_dir(tmp_path_factory):
    """The bundled model with a Qwen3.5-style template: XML tool calls, thinking opened by the prompt."""
    out = tmp_path_factory.mktemp("xml_model")
    for f in DEFAULT_MODEL_DIR.iterdir():
        (out / f.name).symlink_to(f)
    (out / "tokenizer_config.json").unlink()
    cfg = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    cfg["chat_template"] = XML_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


XML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set tool_call = tool_call.function %}"
    "{{- ('\\n' if not loop.first else '') + '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.arguments|items %}"
    "{{- '<parameter=' + args_name + '>\\n' }}"
    "{%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and "
    "args_value is not string) else args_value | string %}"
    "{{- args_value }}{{- '\\n</parameter>\\n' }}{%- endfor %}"  # apart, as Qwen3-Coder's: Markup + str escapes
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def accepts(grammar: dict, tok: Tokenizer, text: str) -> bool:
    matcher = compile_grammar(grammar, tok).matcher()
    return matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()


@pytest.mark.parametrize("form", ["json", "xml"])
def test_the_tool_choice_grammar_takes_what_the_template_writes(form, xml_model_dir, tok):
    model_dir = DEFAULT_MODEL_DIR if form == "json" else xml_model_dir
    call = {"name": "get_weather", "arguments": {"city": "Oslo\nNorway", "days": 3}}
    text = rendered_call(model_dir, [WEATHER, TIME], call)
    template_tok = Tokenizer(model_dir)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        req = P.ChatCompletionRequest(messages=[user("x")], tools=[WEATHER, TIME], tool_choice=choice)
        grammar = {"grammar": structured.tool_grammar(req, template_tok)}
        assert accepts(grammar, template_tok, text), text
        assert parse(text) == ("", "", [("get_weather", json.dumps(call["arguments"]))])
        other = rendered_call(model_dir, [WEATHER], {"name": "get_weather", "arguments": {"days": 3}})
        assert not accepts(grammar, template_tok, other)  # a required argument left out
    named_time = P.ChatCompletionRequest(
        messages=[user("x")], tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert not accepts({"grammar": structured.tool_grammar(named_time, template_tok)}, template_tok, text)


ADDRESS_BOOK = {  # as pydantic (and openai.pydantic_function_tool) write a model: $defs, $ref, nesting
    "type": "function",
    "function": {
        "name": "add_contact",
        "parameters": {
            "$defs": {
                "Address": {
                    "type": "object",
                    "properties": {"street": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["street", "zip"],
                }
            },
            "type": "object",
            "properties": {
                "home": {"$ref": "#/$defs/Address"},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["work", "family"]}},
            },
            "required": ["home", "tags"],
        },
    },
}


@pytest.mark.parametrize("form", ["json", "xml"])
def test_tool_choice_grammars_take_refs_and_write_json_as_tojson(form, xml_model_dir):
    """A tool's parameters are their own JSON schema root (its `$ref`s resolve: they were a 400), and
    the JSON in a forced call is written as the template's tojson writes it (no free whitespace)."""
    model_dir = DEFAULT_MODEL_DIR if form == "json" else xml_model_dir
    call = {"name": "add_contact", "arguments": {"home": {"street": "Storgata 1", "zip": 150}, "tags": ["work"]}}
    text = rendered_call(model_dir, [ADDRESS_BOOK], call)
    template_tok = Tokenizer(model_dir)
    req = P.ChatCompletionRequest(messages=[user("x")], tools=[ADDRESS_BOOK, WEATHER], tool_choice="required")
    grammar = structured.checked("tool_choice", {"grammar": structured.tool_grammar(req, template_tok)}, template_tok)
    assert accepts(grammar, template_tok, text), text
    assert not accepts(grammar, template_tok, text.replace('{"street"', '{ "street"'))
    assert not accepts(grammar, template_tok, text.replace('"zip": 150', '"zip": "150"'))
    assert parse(text, tools=[P.Tool.model_validate(ADDRESS_BOOK)]) == (
        "",
        "",
        [(call["name"], json.dumps(call["arguments"]))],
    )


UNITS = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "$defs": {"Scale": {"enum": ["kelvin", "Grad Celsius"]}},
            "type": "object",
            "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "scale": {"anyOf": [{"$ref": "#/$defs/Scale"}, {"const": "rankine"}]},
                "note": {"enum": ["", "äh"]},
                "city": {"type": "string"},
            },
            "required": ["unit", "city"],
        },
    },
}


@pytest.mark.parametrize("form", ["json", "xml"])
def test_tool_choice_grammars_hold_string_parameters_to_their_enums(form, xml_model_dir):
    """A string parameter that lists its values (`enum`, `const`, through `$ref` / `anyOf`) takes one
    of them in a forced call, in the JSON form and in the XML form (there written raw, as a line)."""
    model_dir = DEFAULT_MODEL_DIR if form == "json" else xml_model_dir
    template_tok = Tokenizer(model_dir)
    req = P.ChatCompletionRequest(messages=[user("x")], tools=[UNITS], tool_choice="required")
    grammar = structured.checked("tool_choice", {"grammar": structured.tool_grammar(req, template_tok)}, template_tok)
    ok = {"unit": "fahrenheit", "scale": "Grad Celsius", "note": "", "city": "Oslo"}
    for args in (ok, {**ok, "scale": "rankine", "note": "äh"}, {"unit": "celsius", "city": "Bergen"}):
        text = rendered_call(model_dir, [UNITS], {"name": "set_unit", "arguments": args})
        assert accepts(grammar, template_tok, text), text
        assert parse(text, tools=[P.Tool.model_validate(UNITS)])[2] == [
            ("set_unit", json.dumps(args, ensure_ascii=False))
        ]
    for bad in ({"unit": "kelvin"}, {"scale": "celsius"}, {"note": "x"}):
        text = rendered_call(model_dir, [UNITS], {"name": "set_unit", "arguments": {**ok, **bad}})
        assert not accepts(grammar, template_tok, text), text


def test_a_forced_xml_call_takes_any_string_the_parser_reads_back(xml_model_dir):
    """A string argument in the XML form is any lines (HTML, a line starting with "<": the grammar
    refused them), but none holding `</parameter>` or `</tool_call>`, where the parser would cut it."""
    write = {
        "type": "function",
        "function": {"name": "write", "parameters": {"properties": {"text": {"type": "string"}}}},
    }
    template_tok = Tokenizer(xml_model_dir)
    req = P.ChatCompletionRequest(messages=[user("x")], tools=[write], tool_choice="required")
    grammar = structured.checked("tool_choice", {"grammar": structured.tool_grammar(req, template_tok)}, template_tok)
    for text, ok in [("<html>\n  <b>hi</b>\n</html>", True), ("a\n<", True), ("", True), ("a </parameter> b", False)]:
        call = rendered_call(xml_model_dir, [write], {"name": "write", "arguments": {"text": text}})
        assert accepts(grammar, template_tok, call) == ok, call
        if ok:
            assert parse(call, tools=[P.Tool.model_validate(write)])[2] == [("write", json.dumps({"text": text}))]
    head = rendered_call(xml_model_dir, [write], {"name": "write", "arguments": {"text": "a"}}).split("a\n")[0]
    for marker, ok in [("</tool_call>", False), ("</tool_cal>", True)]:  # the marker as text, not its token
        cut = marker.index("tool")
        ids = template_tok.encode(head + "a" + marker[:cut]) + template_tok.encode(marker[cut:] + "\n</parameter>\n")
        matcher = compile_grammar(grammar, template_tok).matcher()
        assert matcher.consume_tokens(ids) == ok, marker


def test_a_forced_call_of_a_tool_without_parameters_has_no_arguments(tok):
    """OpenAI: leaving out `parameters` defines a function with an empty parameter list (the model
    filled the arguments with anything)."""
    ping = {"type": "function", "function": {"name": "ping"}}
    req = P.ChatCompletionRequest(messages=[user("x")], tools=[ping], tool_choice="required")
    grammar = {"grammar": structured.tool_grammar(req, tok)}
    text = rendered_call(DEFAULT_MODEL_DIR, [ping], {"name": "ping", "arguments": {}})
    assert accepts(grammar, tok, text) and not accepts(grammar, tok, text.replace("{}", '{"x": 1}'))


def test_the_reasoning_grammar_lets_the_thinking_through_then_applies(tok):
    regex = {"regex": "[0-9]{3}"}
    inside = structured.reasoning_grammar(regex, "inside")
    assert accepts(inside, tok, "let me count\n</think>\n\n123")
    assert not accepts(inside, tok, "let me count\n</think>\n\nabc")
    maybe = structured.reasoning_grammar(regex, "maybe")
    assert accepts(maybe, tok, "<think>hm</think>123") and accepts(maybe, tok, "123")
    assert not accepts(maybe, tok, "hm</think>123")
    assert structured.reasoning_grammar(regex, "after") == regex
    for constraint, good in [
        ({"json": PERSON}, '{"name": "Al", "age": 3}'),
        ({"json_object": True}, "{}"),
        ({"choice": ["yes", 'n"o']}, 'n"o'),
        ({"choice": [f"c{i}" for i in range(3000)]}, "c2999"),
        ({"grammar": 'start: "a" b\nb: "}"'}, "a}"),
    ]:
        assert accepts(structured.reasoning_grammar(constraint, "inside"), tok, f"x</think>{good}"), constraint


@pytest.mark.parametrize("constraint", [{"json": PERSON}, {"json": json.dumps(PERSON)}, {"json_object": True}])
def test_after_the_reasoning_json_is_written_as_without_it(tok, constraint):
    """The JSON options (one line, json.dumps' separators) hold after `</think>` too: free whitespace
    would let a small model fill its budget with newlines."""
    good, loose = '{"name": "Al", "age": 3}', '{\n  "name": "Al",\n  "age":3}'
    for start in ("inside", "maybe"):
        wrapped = structured.reasoning_grammar(constraint, start)
        head = "x</think>" if start == "inside" else ""
        assert accepts(constraint, tok, good) and accepts(wrapped, tok, head + good)
        assert not accepts(constraint, tok, loose) and not accepts(wrapped, tok, head + loose)


# ---------------------------------------------------------------------------------------------
# End to end: the bundled model behind a live server


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=1024)


@pytest.fixture(scope="module")
def live(llm):
    with LiveServer(llm, CFG) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return live.client()


def chat(client, content: str = "Describe a person.", max_tokens: int = 48, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[user(content)], max_tokens=max_tokens, temperature=0.0, **kw
    )


def complete(client, max_tokens: int = 48, **kw):
    return client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=max_tokens, temperature=0.0, **kw)


def holds(check, text: str) -> bool:
    try:
        return bool(check(text))
    except (ValueError, jsonschema.ValidationError):
        return False


def person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON)
    return True


def matches(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
FIELDS = [
    # (extra body, check of the output text)
    ({"response_format": PERSON_FORMAT}, person),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"structured_outputs": {"json": PERSON}}, person),
    ({"guided_json": PERSON}, person),
    ({"guided_regex": r"[a-z]{2,8}-[0-9]{3}"}, matches(r"[a-z]{2,8}-[0-9]{3}")),
    ({"structured_outputs": {"regex": r"(yes|no), [0-9]{1,3}"}}, matches(r"(yes|no), [0-9]{1,3}")),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"guided_grammar": 'start: "x=" NUM ";"\nNUM: /[0-9]{1,4}/'}, matches(r"x=[0-9]{1,4};")),
    (
        {"structured_outputs": {"grammar": 'start: "(" item ("," item){0,3} ")"\nitem: "a" | "b"'}},
        matches(r"\((a|b)(,(a|b)){0,3}\)"),
    ),
]


@pytest.mark.parametrize("body, check", FIELDS)
def test_each_field_constrains_the_output(client, body, check):
    # 128 tokens: room for a free JSON object to close (a greedy model may wander inside one)
    for out in (chat(client, extra_body=body, max_tokens=128), complete(client, max_tokens=128, extra_body=body)):
        choice = out.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert choice.finish_reason == "stop" and holds(check, text), text


def test_a_choice_among_thousands(live):
    """More choices than llguidance's parser holds in a row (2000): one of them, not a 500."""
    labels = [f"label {i}" for i in range(3000)]
    for path, base in [
        ("/v1/chat/completions", {"messages": [user("Pick one.")]}),
        ("/v1/completions", {"prompt": "x"}),
    ]:
        body = {"model": MODEL, "temperature": 0.0, "max_tokens": 16, "guided_choice": labels, **base}
        choice = live.post(path, body).json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop" and text in labels, choice


def test_without_a_constraint_the_checks_fail(client):
    """The unconstrained replies pass none of the checks above (so those test the constraints)."""
    texts = [chat(client).choices[0].message.content, complete(client).choices[0].text]
    assert not any(holds(check, text) for _, check in FIELDS for text in texts)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
    ({"guided_regex": "[a&&b]"}, "guided_regex"),  # compiles, but no text matches it
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
     "response_format.json_schema.schema"),
    ({"guided_grammar": "start: (("}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
]  # fmt: skip
BAD_CHAT = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"messages": [user("x"), {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}], "tool_choice": "required"},
     "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize("body, param", BAD + BAD_CHAT)
def test_bad_input_is_a_400_naming_the_field(live, body, param):
    paths = ["/v1/chat/completions"] + (["/v1/completions"] if (body, param) in BAD else [])
    for path in paths:
        base = {"messages": [user("x")]} if "chat" in path else {"prompt": "x"}
        r = live.post(path, {"model": MODEL, "max_tokens": 4, **base, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


def test_tool_call_round_trip(client):
    """tools + tool_choice "required": tool_calls with finish_reason "tool_calls"; the tool's result
    sent back (arguments as the JSON text the client got) is answered; no 5xx."""
    messages = [user("What is the weather in Paris for 2 days?")]
    out = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0.0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(args, schema)
    assert call.id and call.type == "function" and "<tool_call>" not in (choice.message.content or "")
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=16, temperature=0.0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_named_tool_choice_calls_that_function(client):
    out = chat(
        client, max_tokens=96, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"] and "zone" in json.loads(calls[0].function.arguments)
    assert out.choices[0].finish_reason == "stop"  # OpenAI's and vLLM's for a forced call


def test_tool_choice_none_renders_no_tools(live):
    body = {"model": MODEL, "messages": [user("x")], "tools": [WEATHER]}
    with_tools = live.post("/tokenize", body).json()["count"]
    r = live.post("/tokenize", {**body, "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["count"] < with_tools


def test_replayed_arguments_text_is_rendered_as_an_object(live, llm):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = {"model": MODEL, "messages": [user("x"), {"role": "assistant", "content": "", "tool_calls": [call]}]}
    ids = live.post("/tokenize", body).json()["tokens"]
    assert '"arguments": {"city": "Paris"}' in llm.tokenizer.decode(ids)


def stream_message(live, body: dict) -> tuple[dict, str]:
    """A streamed chat reply reassembled as OpenAI clients do: (message, finish_reason)."""
    r = live.post("/v1/chat/completions", {"model": MODEL, "temperature": 0.0, **body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    msg = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        delta, finish = choice["delta"], choice["finish_reason"] or finish
        msg["content"] += delta.get("content") or ""
        msg["reasoning_content"] += delta.get("reasoning_content") or ""
        for d in delta.get("tool_calls") or []:
            if d["index"] == len(msg["tool_calls"]):
                msg["tool_calls"].append({"id": d["id"], "name": d["function"]["name"], "arguments": ""})
            msg["tool_calls"][d["index"]]["arguments"] += d["function"].get("arguments") or ""
    return msg, finish


def test_streamed_tool_calls_reassemble_to_the_non_streamed(live):
    body = {
        "messages": [user("Weather in Oslo?")],
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 96,
    }
    whole = live.post("/v1/chat/completions", {"model": MODEL, "temperature": 0.0, **body}).json()["choices"][0]
    streamed, finish = stream_message(live, body)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert calls and [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == calls
    assert finish == whole["finish_reason"] == "tool_calls"
    assert streamed["content"] == (whole["message"]["content"] or "")
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    streamed, finish = stream_message(live, named)
    assert [c["name"] for c in streamed["tool_calls"]] == ["get_weather"] and finish == "stop"


@pytest.fixture(scope="module")
def thinking(xml_model_dir):
    """The bundled model, its template opening <think> in the prompt, with --reasoning-parser qwen3."""
    llm = LLM(model=xml_model_dir, max_model_len=1024)
    with LiveServer(llm, CFG, ServerOptions(reasoning_parser="qwen3")) as srv:
        yield srv


def test_reasoning_goes_to_reasoning_content_streamed_and_not(thinking, live):
    body = {"messages": [user("Think first.")], "max_tokens": 24, "ignore_eos": True}
    whole = thinking.post("/v1/chat/completions", {"model": MODEL, "temperature": 0.0, **body}).json()["choices"][0]
    streamed, _ = stream_message(thinking, body)
    prompt = thinking.post("/tokenize", {"model": MODEL, "messages": body["messages"]}).json()["tokens"]
    plain = {"model": MODEL, "temperature": 0.0, "max_tokens": 24, "ignore_eos": True, "prompt": prompt}
    text = live.post("/v1/completions", plain).json()["choices"][0]["text"]
    reasoning, _, rest = text.partition("</think>")
    assert whole["message"]["reasoning_content"] == streamed["reasoning_content"] == reasoning
    assert (whole["message"]["content"] or "") == streamed["content"] == rest.lstrip()
    assert "</think>" not in streamed["content"]


def test_with_thinking_closed_the_reply_is_content_and_constrained(thinking):
    """enable_thinking=false style: the prompt closed the think block, so the grammar applies at once."""
    body = {"messages": [user("Pick one.")], "guided_choice": ["alpha", "beta"], "max_tokens": 8}
    r = thinking.post(
        "/v1/chat/completions",
        {"model": MODEL, "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}, **body},
    )
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] in ("alpha", "beta") and "reasoning_content" not in message


@pytest.mark.parametrize(
    "parameters",
    [{"properties": [1]}, {"properties": {"a": {"type": {"x": 1}}}, "required": 5}, {"required": [{"a": 1}]}, {}],
)
def test_odd_parameter_schemas_never_fail_inside(xml_model_dir, parameters):
    """Whatever a client puts in a tool's parameters: a grammar, or a 400 (FieldError), in both forms;
    and the parser reads a call of such a tool."""
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    for model_dir in (DEFAULT_MODEL_DIR, xml_model_dir):
        tok = Tokenizer(model_dir)
        req = P.ChatCompletionRequest(messages=[user("x")], tools=[tool], tool_choice="required")
        try:
            structured.checked("tool_choice", {"grammar": structured.tool_grammar(req, tok)}, tok)
        except P.FieldError:
            pass
    call = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    assert parse(call, tools=[P.Tool.model_validate(tool)])[2] == [("f", '{"a": "1"}')]


def test_the_reasoning_parser_needs_the_think_tokens(dense_ckpt):
    """The fixture tokenizer has no <think> / </think>: serving it with the parser is a one-line error."""
    from nextn.server.app import create_app

    with pytest.raises(ValueError, match="no <think> and </think> tokens"):
        create_app(LLM(model=dense_ckpt, max_model_len=256), CFG, ServerOptions(reasoning_parser="qwen3"))


# ---------------------------------------------------------------------------------------------
# Hostile grammars (issue 46): refused up front, and the server answers on (the same connection)


def ref_chain(hops: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(hops)}
    return {"type": "object", "$ref": "#/$defs/d0", "$defs": {**defs, f"d{hops}": {"type": "object"}}}


CHAIN = ref_chain(5000)  # ~200 KB: a SIGSEGV inside llguidance's compiler before the limits
HOSTILE = [
    ({"guided_json": CHAIN}, "guided_json", "MAX_REF_CHAIN"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CHAIN}}},
     "response_format.json_schema.schema", "MAX_REF_CHAIN"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": CHAIN}}], "tool_choice": "required"},
     "tool_choice", "MAX_REF_CHAIN"),
    ({"guided_choice": ["</think>", "\u2126", "a\u0301"]}, "guided_choice", "added token"),
    ({"guided_choice": ["\u2126", "a\u0301"]}, "guided_choice", "NFC"),
    ({"guided_json": {"const": "</think>"}}, "guided_json", "added token"),
    ({"guided_json": {"const": "<tool_call>"}}, "guided_json", "added token"),
    ({"guided_json": {"const": "\u2126"}}, "guided_json", "NFC"),
    ({"guided_json": {"enum": ["a\u0301"]}}, "guided_json", "NFC"),
    ({"guided_regex": "a\u0301"}, "guided_regex", "NFC"),
    # within nextn.grammar.limits, yet +250 MB to compile: refused by the compile worker's limits
    ({"guided_regex": "".join(f"(?:(?:q{i}){{100}}){{100}}" for i in range(20))}, "guided_regex", "COMPILE_"),
]  # fmt: skip


@pytest.mark.parametrize("body, param, limit", HOSTILE)
def test_a_hostile_grammar_is_a_400_and_the_connection_answers_on(live, body, param, limit):
    """A 400 naming the field and the limit (never a 5xx, never the process), then a normal request on
    the same kept-alive connection is answered as before."""
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    normal = {"model": MODEL, "messages": [user("Pick one.")], "temperature": 0.0, "max_tokens": 8,
              "guided_choice": ["red", "green"]}  # fmt: skip
    with httpx.Client(base_url=live.url, headers=headers, timeout=30, limits=httpx.Limits(max_connections=1)) as http:
        paths = ["/v1/chat/completions"] + ([] if "tools" in body else ["/v1/completions"])
        for path in paths:
            base = {"messages": [user("x")]} if "chat" in path else {"prompt": "x"}
            r = http.post(path, json={"model": MODEL, "max_tokens": 8, "temperature": 0.0, **base, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and limit in err["message"], err
            assert r.headers.get("connection") != "close"
            r = http.post("/v1/chat/completions", json=normal)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("red", "green"), r.text


def test_32_regex_amplifications_at_once_are_refused_fast(live):
    """`(?:a{1000}){1000}` (10 s of CPU and 100 MB each before the limits): 32 at once, all 400 naming
    MAX_REPEAT_PRODUCT within seconds, and the process's peak RSS grows by far less than 500 MB."""
    import resource
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": MODEL, "messages": [user("x")], "max_tokens": 8, "guided_regex": "(?:a{1000}){1000}"}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda _: live.post("/v1/chat/completions", body), range(32)))
    assert time.monotonic() - t < 10
    assert all(r.status_code == 400 and "MAX_REPEAT_PRODUCT" in r.json()["error"]["message"] for r in replies)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 * 1024


# ---------------------------------------------------------------------------------------------
# The Responses API (/v1/responses): the chat path's rendering, tools, structured output and
# reasoning behind the Responses shape, through the openai client's `client.responses`


def flat(tool: dict) -> dict:
    """A chat tool as the Responses API writes it."""
    return {"type": "function", **tool["function"]}


def stream_response(client, **kw):
    """(the response the SDK's stream accumulator builds from the typed events, the event types,
    the output_text deltas joined)."""
    types, deltas = [], []
    with client.responses.stream(model=MODEL, temperature=0.0, **kw) as events:
        for e in events:
            types.append(e.type)
            deltas += [e.delta] if e.type == "response.output_text.delta" else []
        return events.get_final_response(), types, "".join(deltas)


def items(response) -> list[tuple]:
    """The output items, ids left out (each response makes its own)."""
    out = []
    for it in response.output:
        if it.type == "function_call":
            out.append((it.type, it.name, it.arguments))
        else:
            out.append((it.type, [c.text for c in it.content]))
    return out


def test_responses_text_equals_chat_streamed_and_not(client):
    """`input` (a string, or messages with input_text parts and a developer role) and `instructions`
    render as the chat messages they stand for: the reply is the chat reply, token for token (the
    usage's counts too); streamed, the typed events build the same response."""
    messages = [{"role": "system", "content": "Be brief."}, user("Write a function that adds two numbers.")]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.0)
    expected = reply.choices[0].message.content
    assert expected
    r = client.responses.create(
        model=MODEL, instructions="Be brief.", input=messages[1]["content"], max_output_tokens=24, temperature=0.0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == expected
    assert [i.type for i in r.output] == ["message"]
    assert r.usage.output_tokens == reply.usage.completion_tokens and r.usage.input_tokens == reply.usage.prompt_tokens
    assert r.status == ("incomplete" if reply.choices[0].finish_reason == "length" else "completed")
    parts = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": messages[1]["content"]}]},
    ]
    listed = client.responses.create(model=MODEL, input=parts, max_output_tokens=24, temperature=0.0)
    assert listed.output_text == expected
    final, types, text = stream_response(client, input=parts, max_output_tokens=24)
    assert text == final.output_text == expected and items(final) == items(r)
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert {"response.output_item.added", "response.output_text.done", "response.output_item.done"} <= set(types)


def test_responses_tool_call_round_trip_streamed_and_not(client):
    """Function tools (flat) and tool_choice "required": a function_call item with call_id, name and
    arguments valid for the tool's schema, the same streamed; the call and its output sent back as
    input items are answered."""
    tools = [flat(WEATHER), flat(TIME)]
    body = dict(model=MODEL, input="What is the weather in Paris for 2 days?", tools=tools, max_output_tokens=96)
    r = client.responses.create(**body, tool_choice="required", parallel_tool_calls=False, temperature=0.0)
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id and calls[0].status == "completed", r.output
    schema = {"get_weather": WEATHER, "get_time": TIME}[calls[0].name]["function"]["parameters"]
    jsonschema.validate(json.loads(calls[0].arguments), schema)
    final, types, _ = stream_response(
        client, **{k: v for k, v in body.items() if k != "model"}, tool_choice="required", parallel_tool_calls=False
    )
    assert items(final) == items(r) and "response.function_call_arguments.done" in types
    named = client.responses.create(**body, tool_choice={"type": "function", "name": "get_time"}, temperature=0.0)
    assert [i.name for i in named.output if i.type == "function_call"] == ["get_time"]
    call = calls[0]
    history = [
        user(body["input"]),
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 18})},
    ]
    answer = client.responses.create(model=MODEL, input=history, tools=tools, max_output_tokens=8, temperature=0.0)
    assert answer.status in ("completed", "incomplete") and answer.output


def test_responses_json_schema_format(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(
        model=MODEL, input="Describe a person.", text={"format": fmt}, max_output_tokens=128, temperature=0.0
    )
    assert r.status == "completed" and person(r.output_text), r.output_text
    obj = client.responses.create(
        model=MODEL,
        input="Describe a person.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=128,
        temperature=0.0,
    )
    assert isinstance(json.loads(obj.output_text), dict)


def test_responses_reasoning_item(thinking):
    """With --reasoning-parser, the <think> text is a reasoning item, the rest the message: the chat
    reply's reasoning_content and content."""
    client = thinking.client()
    body = {"messages": [user("Think first.")], "max_tokens": 24, "ignore_eos": True}
    whole = thinking.post("/v1/chat/completions", {"model": MODEL, "temperature": 0.0, **body}).json()
    message = whole["choices"][0]["message"]
    kw = dict(model=MODEL, input="Think first.", max_output_tokens=24, temperature=0.0)
    r = client.responses.create(**kw)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == message["reasoning_content"]
    assert r.output_text == (message.get("content") or "")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    final, types, _ = stream_response(client, input="Think first.", max_output_tokens=24)
    assert items(final) == items(r) and "response.reasoning_text.delta" in types


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [user("x"), {"role": "user", "content": [{"type": "input_image"}]}]}, "input[1].content[0].type"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": 5}}}}, "text.format.schema"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "x" * 50_000}, "input"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [flat(WEATHER)], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"temprature": 0}, "temprature"),
    ],
)
def test_responses_bad_input_is_a_400_naming_the_field(live, body, param):
    r = live.post("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
