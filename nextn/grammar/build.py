"""One structured_outputs entry -> llguidance's grammar definition, validated; and the compile
worker's loop (this file run as a script: nextn.grammar.sandbox starts it).

Imports nothing but the standard library and llguidance, so the worker process starts in 0.1 s and
~30 MB (the nextn package would bring torch: 1.2 s and ~250 MB). The engine calls the same
`definition` and `validate` in its own process (nextn.grammar.compile), so what the worker
compiled within its limits, the engine compiles within them too: the work is the same, input for
input. The worker runs them on a thread with a BIG_STACK C stack (llguidance's compilers recurse),
under RLIMIT_AS = its size when ready + the memory it is given; it answers one JSON message a job.
Knows nothing of nextn's limits (checked before a job is sent) or of HTTP.
"""

from __future__ import annotations

import json
import resource
import signal
import struct
import sys
import threading

import llguidance as llg

# llguidance's compilers recurse per schema level and `$ref` hop: 256 MB of stack (reserved, touched
# only as deep as it goes) holds a 20,000-hop chain, where an 8 MB one dies near 500 (limits.py)
BIG_STACK = 256 << 20
# JSON is written as json.dumps writes it, on one line: free whitespace lets a small model fill
# its budget with spaces (a schema's own "x-guidance" options override these)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
HEADER = struct.Struct("<I")  # a message's length, before its JSON bytes


def json_schema(value) -> dict:
    """A request's JSON schema (an object, a boolean, or its JSON text) as llguidance takes it: an
    object, with JSON_OPTIONS under its own "x-guidance" options, alike alone and in a Lark `%json`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs 'json': the schema is not valid JSON ({e})") from None
    if value is True:  # JSON Schema's "anything"; llguidance takes options only in an object
        value = {}
    if value is False:
        raise ValueError("structured_outputs 'json': the schema is false: no value matches it")
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs 'json': a schema is a JSON object, got {type(value).__name__}")
    value = close_objects(value)
    own = value.get("x-guidance")
    if own is None or isinstance(own, dict):  # else llguidance names what is wrong with it
        value = {**value, "x-guidance": {**JSON_OPTIONS, **(own or {})}}
    return value


# where a JSON schema holds subschemas: one, a name -> schema map, or a list of them
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems", "not",
        "if", "then", "else", "contains", "propertyNames")  # fmt: skip
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
# an object schema with one of these says what its other properties may be, or combines with schemas
# that may declare them: it is left as it is
_OPEN_KEYS = {"additionalProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "$ref"}
_WALKED = {*_ONE, *_MAP, *_LIST, "allOf"}


def close_objects(schema: dict) -> dict:
    """`schema` (not changed: a copy) with every object schema that declares `properties` and says
    nothing of the others (no `additionalProperties` / `unevaluatedProperties`) closed to them:
    vLLM's default grammar backend (xgrammar, strict) allows no property a schema does not declare,
    and without it a greedy small model adds keys until max_tokens. `additionalProperties: true`
    (or a schema) keeps an object open; one that declares no properties (`{"type": "object"}`,
    json_object) stays any object. An `allOf` member, and an object combined with `allOf` / `anyOf` /
    `oneOf` / `$ref` beside its properties, is left open: closed, it would refuse the properties the
    others declare. Walked without recursion (the nesting limits are checked after this)."""
    root = {"schema": schema}
    stack: list[tuple[dict | list, str | int, bool]] = [(root, "schema", True)]  # (holder, key, close it)
    while stack:
        holder, key, close = stack.pop()
        node = holder[key]
        if not isinstance(node, dict) or not (_WALKED.intersection(node) or (close and "properties" in node)):
            continue  # a leaf left as it is (not copied)
        node = holder[key] = dict(node)
        if close and "properties" in node and not _OPEN_KEYS & node.keys():
            node["additionalProperties"] = False
        stack += [(node, k, True) for k in _ONE if k in node]
        for k in (*_MAP, *_LIST, "allOf"):
            held = node.get(k)
            if isinstance(held, dict) and k in _MAP:
                held = node[k] = dict(held)
                stack += [(held, name, True) for name in held]
            elif isinstance(held, list) and k not in _MAP:
                held = node[k] = list(held)
                stack += [(held, i, k != "allOf") for i in range(len(held))]
    return root["schema"]


def choice_terminal(choices) -> str:
    """The Lark terminal CHOICE that matches one of `choices`: one lexeme, not a rule of
    alternatives (llguidance's parser holds at most 2000 items in a row, so a rule of more choices
    failed at the first token of the output)."""
    return "CHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def definition(key: str, value) -> str:
    """llguidance's grammar definition for one structured_outputs entry (not yet validated); `key` is
    one of nextn.core.STRUCTURED_OUTPUT_KEYS (the caller checked)."""
    if key == "json":
        return llg.LLMatcher.grammar_from_json_schema(json_schema(value))
    if key == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs 'json_object' must be true, got {value!r}")
        return llg.LLMatcher.grammar_from_json_schema(json_schema({"type": "object"}))
    if key == "regex":
        if not isinstance(value, str):
            raise ValueError(f"structured_outputs 'regex' must be a string, got {type(value).__name__}")
        return llg.LLMatcher.grammar_from_regex(value)
    if key == "choice":
        if not (isinstance(value, list | tuple) and value and all(isinstance(c, str) and c for c in value)):
            raise ValueError(
                f"structured_outputs 'choice' must be a non-empty list of non-empty strings, got {value!r}"
            )
        return llg.grammar_from("grammar", f"start: CHOICE\n{choice_terminal(value)}")
    if key == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("structured_outputs 'grammar' must be a non-empty Lark (or GBNF) grammar string")
        try:
            return llg.grammar_from("grammar", value)  # Lark as it is; GBNF converted to Lark
        except ValueError as e:
            raise ValueError(f"structured_outputs 'grammar': {e}") from None
    raise AssertionError(f"structured_outputs key {key!r}")


def validate(key: str, grammar: str, tokenizer: llg.LLTokenizer) -> None:
    """A ValueError unless `grammar` compiles for `tokenizer` and some text matches it (a regex such
    as `[a&&b]` matches none: its matcher would allow only EOS, an empty reply that fails it)."""
    error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"structured_outputs {key!r}: {error.strip()}")
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
    matcher.compute_bitmask()  # the matcher finds that nothing can start only when it computes a mask
    if matcher.is_error():
        raise ValueError(f"structured_outputs {key!r}: no text matches it")


# ---------------------------------------------------------------------------------------------
# The worker (this file as a script): a hello {"tokenizer", "eos", "memory"}, then jobs {"key", "value"}


def send(pipe, message: dict) -> None:
    data = json.dumps(message).encode()
    pipe.write(HEADER.pack(len(data)) + data)
    pipe.flush()


def _receive(pipe) -> dict | None:
    head = pipe.read(HEADER.size)
    if len(head) < HEADER.size:
        return None  # the server closed the pipe: it has stopped
    return json.loads(pipe.read(HEADER.unpack(head)[0]))


def _serve() -> None:
    src, dst = sys.stdin.buffer, sys.stdout.buffer
    hello = _receive(src)
    tokenizer = llg.LLTokenizer(hello["tokenizer"], eos_token=hello["eos"])
    validate("choice", definition("choice", ["warm-up"]), tokenizer)  # llguidance's own first-use setup
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + hello["memory"], resource.getrlimit(resource.RLIMIT_AS)[1]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an abort on a failed allocation writes no core file
    send(dst, {"ready": size})
    while (job := _receive(src)) is not None:
        try:
            validate(job["key"], definition(job["key"], job["value"]), tokenizer)
            send(dst, {})
        except ValueError as e:
            send(dst, {"error": str(e)})
        except MemoryError:
            send(dst, {"error": "memory"})


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    threading.stack_size(BIG_STACK)
    worker = threading.Thread(target=_serve, name="grammar-compile")
    worker.start()
    worker.join()
