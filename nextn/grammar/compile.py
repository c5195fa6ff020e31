"""A request's `structured_outputs` -> a compiled llguidance grammar, or a ValueError saying why not.

The llguidance tokenizer is made once per nextn Tokenizer (from its tokenizer.json, with its EOS);
ids the model's vocabulary has beyond the tokenizer's (padding rows of the embedding) are never
allowed by a mask (nextn.grammar.state). A grammar that matches no text at all (a regex such as
`[a&&b]`) is refused too: its matcher would allow only EOS, an empty reply that does not match it.

Before llguidance sees it, a constraint passes nextn.grammar.limits (size, nesting, `$ref` chains,
counted repetition, literals a tokenizer cannot write). This is the engine's compile; the server
checks a request's constraint first in a worker process with time and memory limits
(nextn.grammar.sandbox), which runs the same llguidance work (nextn.grammar.build), so what reaches
the engine has compiled within those limits. llguidance's compilers recurse, so every call that
compiles (the compile and each request's matcher) runs on one of COMPILE_THREADS threads with a
BIG_STACK C stack: a schema within the limits cannot overflow it (limits.py has the measurements).
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
from nextn.grammar.build import BIG_STACK, definition, json_schema, validate
from nextn.tokenizer import Tokenizer

_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ADDED_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
COMPILE_THREADS = 4  # compiles at once in a process (the API's request threads share them)
_STACK_LOCK = threading.Lock()
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it, the pool)
_ON_BIG_STACK = threading.local()


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
    key, value = entry(structured_outputs)
    try:  # the server checks a request's constraint and the engine compiles it again: one compile
        text = json.dumps(value)  # (key order kept: a schema's property order is its output's)
    except (TypeError, ValueError, RecursionError):
        return _compile(key, value, tokenizer)  # not JSON: `definition` says what is wrong
    return _compile_cached(key, text, tokenizer)


def entry(structured_outputs: dict) -> tuple[str, object]:
    """(key, value) of a structured_outputs dict that holds one known key, else a ValueError."""
    if not isinstance(structured_outputs, dict) or len(structured_outputs) != 1:
        raise ValueError(
            f"structured_outputs must hold exactly one of {STRUCTURED_OUTPUT_KEYS}, got {structured_outputs!r}"
        )
    ((key, value),) = structured_outputs.items()
    if key not in STRUCTURED_OUTPUT_KEYS:
        raise ValueError(f"structured_outputs key {key!r} is not one of {STRUCTURED_OUTPUT_KEYS}")
    return key, value


@functools.lru_cache(maxsize=256)
def _compile_cached(key: str, text: str, tokenizer: Tokenizer) -> CompiledGrammar:
    return _compile(key, json.loads(text), tokenizer)


def _compile(key: str, value, tokenizer: Tokenizer) -> CompiledGrammar:
    check(key, value, added_tokens(tokenizer))
    lt = ll_tokenizer(tokenizer)
    grammar = on_big_stack(definition, key, value)
    on_big_stack(validate, key, grammar, lt)
    return CompiledGrammar(grammar, lt)


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
