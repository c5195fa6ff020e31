"""A request's `structured_outputs` -> a compiled llguidance grammar, or a ValueError saying why not.

The llguidance tokenizer is made once per nextn Tokenizer (from its tokenizer.json, with its EOS);
ids the model's vocabulary has beyond the tokenizer's (padding rows of the embedding) are never
allowed by a mask (nextn.grammar.state). A grammar that matches no text at all (a regex such as
`[a&&b]`) is refused too: its matcher would allow only EOS, an empty reply that does not match it.

Before llguidance sees it, a constraint passes nextn.grammar.limits (size, nesting, `$ref` chains,
counted repetition, literals a tokenizer cannot write): this runs in the API process (the server's
check) and again in the engine. llguidance's compilers recurse, so every call that compiles (the
check here and each request's matcher) runs on one of COMPILE_THREADS threads with a BIG_STACK C
stack: a schema within the limits cannot overflow it (limits.py has the measurements).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import llguidance as llg

from nextn.core import STRUCTURED_OUTPUT_KEYS
from nextn.grammar import limits
from nextn.tokenizer import Tokenizer

_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ADDED_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# llguidance's compilers recurse per schema level and `$ref` hop: 256 MB of stack (reserved, touched
# only as deep as it goes) holds a 20,000-hop chain, where an 8 MB one dies near 500 (limits.py)
BIG_STACK = 256 << 20
COMPILE_THREADS = 4  # compiles at once in a process (the API's request threads share them)
_STACK_LOCK = threading.Lock()
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it, the pool)
_ON_BIG_STACK = threading.local()
# JSON is written as json.dumps writes it, on one line: free whitespace lets a small model fill
# its budget with spaces (a schema's own "x-guidance" options override these)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class CompiledGrammar(NamedTuple):
    grammar: str  # llguidance's grammar definition (validated)
    tokenizer: llg.LLTokenizer

    def matcher(self) -> llg.LLMatcher:
        return on_big_stack(llg.LLMatcher, self.tokenizer, self.grammar, log_level=0)


def on_big_stack(fn, *args, **kwargs):
    """fn(*args, **kwargs) on one of COMPILE_THREADS threads with a BIG_STACK C stack, made once per
    process (a thread per call costs 2.5 ms more a matcher, measured: 3.2 ms against 0.63 ms)."""
    if getattr(_ON_BIG_STACK, "yes", False):  # already on one
        return fn(*args, **kwargs)
    return _pool().submit(fn, *args, **kwargs).result()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _STACK_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():  # (a forked child has none of the threads)
            old = threading.stack_size(BIG_STACK)  # process-wide: set while the threads start only
            try:
                pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
                started = threading.Barrier(COMPILE_THREADS + 1)
                for _ in range(COMPILE_THREADS):  # each waits: the pool starts a thread per task
                    pool.submit(_start, started)
                started.wait()
            finally:
                threading.stack_size(old)
            _POOL = (os.getpid(), pool)
        return _POOL[1]


def _start(started: threading.Barrier) -> None:
    _ON_BIG_STACK.yes = True
    started.wait()


def added_tokens(tokenizer: Tokenizer) -> tuple[str, ...]:
    """The text of the tokenizer's added tokens (`</think>`): a literal holding one is refused."""
    if tokenizer not in _ADDED_TOKENS:
        added = json.loads(tokenizer.to_str()).get("added_tokens") or []
        _ADDED_TOKENS[tokenizer] = tuple(t["content"] for t in added if t.get("content"))
    return _ADDED_TOKENS[tokenizer]


def ll_tokenizer(tokenizer: Tokenizer) -> llg.LLTokenizer:
    """llguidance's view of this tokenizer (made once per Tokenizer)."""
    if tokenizer not in _LL_TOKENIZERS:
        _LL_TOKENIZERS[tokenizer] = llg.LLTokenizer(tokenizer.to_str(), eos_token=tokenizer.eos_token_id)
    return _LL_TOKENIZERS[tokenizer]


def compile_grammar(structured_outputs: dict, tokenizer: Tokenizer) -> CompiledGrammar:
    """The grammar of one request's structured_outputs (exactly one key of STRUCTURED_OUTPUT_KEYS).
    Raises ValueError with the reason: an unknown key, a schema that is not JSON or not valid, a
    regex that does not compile, a grammar that does not parse, an empty choice."""
    if not isinstance(structured_outputs, dict) or len(structured_outputs) != 1:
        raise ValueError(
            f"structured_outputs must hold exactly one of {STRUCTURED_OUTPUT_KEYS}, got {structured_outputs!r}"
        )
    ((key, value),) = structured_outputs.items()
    try:  # the server checks a request's constraint and the engine compiles it again: one compile
        text = json.dumps(value)  # (key order kept: a schema's property order is its output's)
    except (TypeError, ValueError, RecursionError):
        return _compile(key, value, tokenizer)  # not JSON: _grammar_of says what is wrong
    return _compile_cached(key, text, tokenizer)


@functools.lru_cache(maxsize=256)
def _compile_cached(key: str, text: str, tokenizer: Tokenizer) -> CompiledGrammar:
    return _compile(key, json.loads(text), tokenizer)


def _compile(key: str, value, tokenizer: Tokenizer) -> CompiledGrammar:
    check(key, value, added_tokens(tokenizer))
    lt = ll_tokenizer(tokenizer)
    grammar = on_big_stack(_grammar_of, key, value)
    error = on_big_stack(llg.LLMatcher.validate_grammar, grammar, lt)
    if error:
        raise ValueError(f"structured_outputs {key!r}: {error.strip()}")
    compiled = CompiledGrammar(grammar, lt)
    matcher = compiled.matcher()
    matcher.compute_bitmask()  # the matcher finds that nothing can start only when it computes a mask
    if matcher.is_error():
        raise ValueError(f"structured_outputs {key!r}: no text matches it")
    return compiled


def check(key: str, value, added: tuple[str, ...]) -> None:
    """nextn.grammar.limits' checks of one structured_outputs entry (a ValueError naming the limit)."""
    what = f"structured_outputs {key!r}"
    if key == "json":
        limits.check_schema(json_schema(value), what, added)
    elif key == "regex" and isinstance(value, str):
        limits.check_regex(value, what)
    elif key == "choice" and isinstance(value, list | tuple):
        limits.check_repeats(json.dumps(value, ensure_ascii=False), what)
        for c in value:
            if isinstance(c, str):
                limits.check_literal(c, f"{what}: the choice", added)
    elif key == "grammar" and isinstance(value, str):
        limits.check_repeats(value, what, lark=True)


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


def _grammar_of(key: str, value) -> str:
    """llguidance's grammar definition for one structured_outputs entry (not yet validated)."""
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
    raise ValueError(f"structured_outputs key {key!r} is not one of {STRUCTURED_OUTPUT_KEYS}")
