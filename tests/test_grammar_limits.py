"""nextn.grammar.limits: the checks a grammar passes before llguidance compiles it (issue 46).

Each probe that crashed or stalled the server is refused fast, naming its limit, and what stays
within the limits still compiles: a recursive schema, a chain of $refs as long as allowed, counted
repetitions up to the bound. The compile itself runs on a big stack (a 1,000-hop chain of objects,
past what an 8 MB stack takes, compiles when the checks are lifted).
"""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from nextn.config import DEFAULT_MODEL_DIR  # noqa: E402
from nextn.grammar import compile as compile_mod  # noqa: E402
from nextn.grammar import compile_grammar, limits  # noqa: E402
from nextn.tokenizer import Tokenizer  # noqa: E402

SPECIAL_AND_NON_NFC = ["</think>", "<tool_call>", "\u2126", "a\u0301"]  # "Ω" (the ohm sign) and "á" decomposed


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL_DIR)


def ref_chain(hops: int, through_objects: bool = False) -> dict:
    """A schema whose root follows `hops` $refs to a string (each through an object, or bare aliases)."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        if through_objects
        else {"$ref": f"#/$defs/d{i + 1}"}
        for i in range(hops)
    }
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{hops}": {"type": "string"}}}


def refused(constraint: dict, tok: Tokenizer, limit: str) -> None:
    """Refused naming `limit` by the checks before the compiler: the compiler is never reached (a
    clock here would be a timed test, which a loaded machine fails)."""
    real = compile_mod.on_big_stack
    compile_mod.on_big_stack = lambda *a: pytest.fail("the compiler was reached")
    try:
        with pytest.raises(ValueError, match=limit):
            compile_grammar(constraint, tok)
    finally:
        compile_mod.on_big_stack = real


def test_a_ref_chain_is_refused_naming_the_limit(tok):
    refused({"json": ref_chain(5000)}, tok, "MAX_REF_CHAIN")
    refused({"json": ref_chain(limits.MAX_REF_CHAIN + 1, through_objects=True)}, tok, "MAX_REF_CHAIN")
    compile_grammar({"json": ref_chain(limits.MAX_REF_CHAIN - 1, through_objects=True)}, tok)


def test_recursive_schemas_still_compile(tok):
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array"}}}
    tree["properties"]["kids"]["items"] = {"$ref": "#/$defs/node"}
    compile_grammar({"json": {"$ref": "#/$defs/node", "$defs": {"node": tree}}}, tok)


def test_deep_and_large_schemas_are_refused(tok):
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    refused({"json": deep}, tok, "MAX_SCHEMA_DEPTH")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}
    refused({"json": wide}, tok, "MAX_SCHEMA_BYTES")


def test_the_compile_runs_on_a_big_stack(tok, monkeypatch):
    """With the checks lifted, a 1,000-hop chain through objects (a SIGSEGV on an 8 MB stack) compiles."""
    monkeypatch.setattr(limits, "MAX_REF_CHAIN", 10**6)
    compile_grammar({"json": ref_chain(1000, through_objects=True)}, tok).matcher()


@pytest.mark.parametrize(
    "regex, product",
    [("(?:a{1000}){1000}", 10**6), ("a{5}", 5), ("(a{2,3}b){4}", 12), ("[{]{9}", 9), (r"\{5}", 1), ("x{,7}", 7)],
)
def test_repeat_product(regex, product):
    assert limits.repeat_product(regex) == product


def test_counted_repetition_blow_up_is_refused(tok):
    for regex in ["(?:a{1000}){1000}", "((a{100}){100}){100}", "(x{10}){2000}"]:
        refused({"regex": regex}, tok, "MAX_REPEAT_PRODUCT")
    refused({"json": {"type": "string", "pattern": "(?:a{1000}){1000}"}}, tok, "MAX_REPEAT_PRODUCT")
    refused({"grammar": "start: A\nA: /(?:a{1000}){1000}/"}, tok, "MAX_REPEAT_PRODUCT")
    compile_grammar({"regex": "(?:a{100}){100}"}, tok)


@pytest.mark.parametrize(
    "grammar, product",
    [
        ('start: B\nB: C{100}\nC: D{100}\nD: "a"{100}', limits.MAX_REPEAT_PRODUCT + 1),  # terminals inline
        ('start: B\nD: "a"{10}\nC: D{10}\nB: C{2}', 200),  # in any order
        ('start: b{1000}\nb: "a"{1000}', 1000),  # a rule is referred to, not copied (10 ms)
        ('start: x\nx: "{" x{5} "}" | "a"', 5),  # recursion is not unrolled
        ('start: "x=" NUM ";"\nNUM: /[0-9]{1,4}/', 4),
        ('start: %json {"type": "string", "maxLength": 5}', 1),
    ],
)
def test_lark_repeat_product(grammar, product):
    assert min(limits.lark_repeat_product(grammar), limits.MAX_REPEAT_PRODUCT + 1) == product


@pytest.mark.parametrize("literal", SPECIAL_AND_NON_NFC)
def test_literals_a_tokenizer_cannot_write_are_refused_by_name(tok, literal):
    for constraint in [
        {"choice": ["ok", literal]},
        {"json": {"const": literal}},
        {"json": {"enum": ["ok", literal]}},
        {"json": {"type": "object", "properties": {literal: {"type": "integer"}}}},
    ]:
        with pytest.raises(ValueError, match="added token|NFC") as e:
            compile_grammar(constraint, tok)
        assert repr(literal) in str(e.value)


def test_a_non_nfc_regex_is_refused(tok):
    with pytest.raises(ValueError, match="NFC"):
        compile_grammar({"regex": "a\u0301+"}, tok)
    compile_grammar({"regex": "\u00e1+"}, tok)


def test_every_compile_goes_through_the_checks(tok, monkeypatch):
    """compile_grammar (the server's check and the engine's compile alike) calls the limits."""
    calls = []
    monkeypatch.setattr(compile_mod, "check", lambda *a: calls.append(a))
    compile_mod._compile("regex", "b+", tok)
    assert calls and calls[0][0] == "regex"


def test_a_token_the_mask_allows_but_the_matcher_refuses_fails_the_request_alone(tok, monkeypatch):
    """Were such a literal let through (the checks lifted), the mask allows `</think>`'s added token
    and the matcher refuses it: the request's error (a 400), not the engine's (a 500)."""
    import torch

    from nextn.core import RequestError
    from nextn.grammar import GrammarState

    monkeypatch.setattr(compile_mod, "check", lambda *a: None)
    compiled = compile_grammar({"choice": ["</think>"]}, tok)
    masks = torch.zeros(2, tok.vocab_size, dtype=torch.bool)
    state = GrammarState(compiled, masks, {tok.eos_token_id}, draft_mask=False)
    (allowed,) = masks[0].nonzero()[:, 0].tolist()
    with pytest.raises(RequestError, match="cannot be followed"):
        state.commit([allowed])
