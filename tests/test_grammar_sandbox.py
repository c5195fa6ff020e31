"""nextn.grammar.sandbox: the server's grammar check in a worker process (issue 46, item 1).

A compile that runs past the time limit or the memory limit costs its worker (killed, another
started) and the request a ValueError naming the limit, within the limit's time; the next check is
answered. What passes or fails in the worker passes or fails the engine's own compile alike.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("llguidance")

from nextn.config import DEFAULT_MODEL_DIR  # noqa: E402
from nextn.grammar import compile_grammar, sandbox  # noqa: E402
from nextn.tokenizer import Tokenizer  # noqa: E402

# within nextn.grammar.limits (each repetition's product is 10^4), yet 1-2.5 s and +250 MB a compile
COSTLY = {"regex": "".join(f"(?:(?:q{i}){{100}}){{100}}" for i in range(20))}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def box(tok):
    box = sandbox.CompileSandbox(tok, workers=1)
    yield box
    box.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def refused_then_answered(box: sandbox.CompileSandbox, limit: str, within: float) -> None:
    box.check({"regex": "[a-z]+"})  # the worker is up
    (worker,) = box.workers
    start = time.monotonic()
    with pytest.raises(ValueError, match=limit):
        box.check(COSTLY)
    assert time.monotonic() - start < within
    assert box.workers == [] and not alive(worker.proc.pid)  # killed and reaped
    with pytest.raises(ValueError, match=limit):  # the verdict is kept: no second worker spent on it
        box.check(COSTLY)
    assert box.workers == []
    box.check({"regex": "[0-9]+"})  # a new worker answers
    assert len(box.workers) == 1


def test_a_compile_past_the_time_limit_is_refused_and_its_worker_replaced(tok):
    box = sandbox.CompileSandbox(tok, workers=1, timeout=0.2)
    try:
        refused_then_answered(box, "COMPILE_TIMEOUT_S=0.2", within=1.0)
    finally:
        box.close()


def test_a_compile_past_the_memory_limit_is_refused_and_its_worker_replaced(tok):
    box = sandbox.CompileSandbox(tok, workers=1, memory=64 << 20, timeout=60)
    try:
        refused_then_answered(box, "COMPILE_MEMORY=64 MB", within=10.0)
    finally:
        box.close()


def test_the_costly_grammar_is_refused_by_default_and_compiles_without_the_limits(tok):
    """The refusals above are the limits' doing, not the grammar's; the defaults refuse it."""
    box = sandbox.CompileSandbox(tok, workers=1)
    roomy = sandbox.CompileSandbox(tok, workers=1, memory=4 << 30, timeout=60)
    try:
        with pytest.raises(ValueError, match="COMPILE_MEMORY|COMPILE_TIMEOUT_S"):
            box.check(COSTLY)
        roomy.check(COSTLY)
    finally:
        box.close()
        roomy.close()


@pytest.mark.parametrize(
    "constraint",
    [
        {"regex": "[a&&b]"},  # matches no text
        {"regex": "(unclosed"},
        {"json": {"type": "nope"}},
        {"json": {"$ref": "#/$defs/missing"}},
        {"grammar": "start: undefined_rule"},
        {"choice": []},
        {"choice": ["</think>"]},  # nextn.grammar.limits, checked in this process
        {"json_object": False},
        {"nope": 1},
        {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"grammar": 'root ::= "x" [0-9]+'},
        {"choice": ["red", "green"]},
    ],
)
def test_the_worker_agrees_with_the_engines_compile(tok, box, constraint):
    """Each constraint passes the sandbox if and only if the engine's compile_grammar takes it, and a
    refusal says the same."""
    try:
        compile_grammar(constraint, tok)
        engine = None
    except ValueError as e:
        engine = str(e)
    try:
        box.check(constraint)
        mine = None
    except ValueError as e:
        mine = str(e)
    assert mine == engine
