"""Structured outputs (nextn.grammar) with exact speculation: constrained greedy spec at K = 1..4
equals constrained plain decoding token for token (bundled model, tiny random-head checkpoints),
every output matches its grammar, a constrained request's output does not depend on what runs
beside it, draft masking raises acceptance and changes no token, constrained sampled spec has
constrained plain's law (total variation against the exact masked law), the matcher walks and
rolls back drafts, and a bad grammar is a ValueError naming it."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest
import torch
from hf_fixtures import FIT_PROMPTS, hf_logits
from test_sampled_spec import _filtered, _tv_limit

import nextn
from nextn.grammar import GrammarState, compile_grammar
from nextn.hub import resolve_model
from nextn.spec.draft_vocab import DraftVocab
from nextn.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ID_REGEX = r"[A-Z]{2}-[0-9]{2,4}( OK| KO)?"
CHOICES = ["apple", "banana split", "cherry", "kiwi"]
GRAMMARS = [{"json": PERSON}, {"regex": ID_REGEX}, {"choice": CHOICES}]


def run_together(llm, requests: list[tuple[list[int], nextn.SamplingParams, int | None]]) -> list:
    """Every (prompt ids, params, K) request added to the engine at once, run to the end together."""
    reqs = [llm.engine.add(ids, params, num_speculative_tokens=k) for ids, params, k in requests]
    outputs = {}
    while len(outputs) < len(reqs):
        for req, ev in llm.engine.step():
            if isinstance(ev, BaseException):
                raise ev
            if ev.output is not None:
                outputs[req.request_id] = ev.output
    return [outputs[r.request_id] for r in reqs]


def check_matches(structured_outputs: dict, out, tokenizer) -> None:
    """A finished output matches its grammar; one cut by the budget is a prefix the grammar allows."""
    ((key, value),) = structured_outputs.items()
    if out.finish_reason != "stop":
        assert out.finish_reason == "length"
        matcher = compile_grammar(structured_outputs, tokenizer).matcher()
        assert matcher.validate_tokens(out.token_ids) == len(out.token_ids), out.text
        return
    if key == "regex":
        assert re.fullmatch(value, out.text), out.text
    elif key == "choice":
        assert out.text in value, out.text
    else:
        obj = json.loads(out.text)
        assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int), obj
        assert len(obj["name"]) <= 12 and obj["age"] >= 0, obj


# --- compiling and validating


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(None))


@pytest.mark.parametrize(
    "structured_outputs,reason",
    [
        ({"json": '{"type": "object",'}, "not valid JSON"),
        ({"json": {"type": "wrong"}}, "wrong"),
        ({"json": {"properties": {"a": {"$ref": "#/nope"}}}}, "nope"),
        ({"json": [1, 2]}, "JSON object"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "start: ("}, "'grammar'"),
        ({"grammar": "start: missing_rule"}, "missing_rule"),
        ({"choice": []}, "non-empty list"),
        ({"json_object": False}, "must be true"),
        ({"xml": "<a/>"}, "'xml'"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json": False}, "no value matches it"),
        ({"regex": "[a&&b]"}, "no text matches it"),  # (it compiles; its matcher would allow only EOS)
    ],
)
def test_a_bad_grammar_is_a_value_error_naming_it(tokenizer, structured_outputs, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        compile_grammar(structured_outputs, tokenizer)


def test_sampling_params_take_exactly_one_known_grammar():
    nextn.SamplingParams(structured_outputs={"json_object": True})
    for bad in ({}, {"regex": "a", "json": {}}, {"ebnf": "x"}, "json"):
        with pytest.raises(ValueError, match="structured_outputs"):
            nextn.SamplingParams(structured_outputs=bad)


def test_valid_grammars_compile(tokenizer):
    for so in [*GRAMMARS, {"json": json.dumps(PERSON)}, {"json_object": True}, {"grammar": 'start: "x" /[0-9]+/'}]:
        compile_grammar(so, tokenizer).matcher()
    compile_grammar({"grammar": 'root ::= "x" [0-9]+'}, tokenizer)  # GBNF is converted to Lark


def test_a_long_choice_list_is_taken_whole(tokenizer):
    """Past 2000 choices (llguidance's parser row limit when each choice was a rule alternative) the
    output is still one of them; a choice that prefixes another is matched as itself."""
    choices = [f"label {i}" for i in range(5000)] + ["a", "ab"]
    for text in ("label 2718", "a", "ab"):
        matcher = compile_grammar({"choice": choices}, tokenizer).matcher()
        assert matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting(), text
    matcher = compile_grammar({"choice": choices}, tokenizer).matcher()
    assert not (matcher.consume_tokens(tokenizer.encode("label 5000")) and matcher.is_accepting())


@pytest.mark.parametrize("schema", [True, "true"])
def test_the_true_schema_takes_any_json_written_compactly(tokenizer, schema):
    """JSON Schema's `true` is any value (llguidance takes its options only in an object schema)."""
    for text, ok in [('{"a": [1, "b"]}', True), ("7", True), ('{ "a":1}', False), ("nope", False)]:
        matcher = compile_grammar({"json": schema}, tokenizer).matcher()
        assert (matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()) == ok, text


def _matches(tokenizer, schema, text: str) -> bool:
    matcher = compile_grammar({"json": schema}, tokenizer).matcher()
    return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()


def test_undeclared_properties_are_refused_unless_the_schema_allows_them(tokenizer):
    """As vLLM's default backend (xgrammar, strict): an object schema that declares properties takes
    no other unless additionalProperties says so (true, or a schema for them); one that declares none
    is any object; nested objects alike; allOf members stay open; the caller's schema is not changed."""
    person = {"type": "object", "properties": {"name": {"type": "string"}}}
    given = json.dumps(person)
    assert _matches(tokenizer, person, '{"name": "x"}') and not _matches(tokenizer, person, '{"name": "x", "age": 3}')
    assert json.dumps(person) == given
    assert _matches(tokenizer, {**person, "additionalProperties": True}, '{"name": "x", "age": 3}')
    typed = {**person, "additionalProperties": {"type": "integer"}}
    assert _matches(tokenizer, typed, '{"name": "x", "age": 3}') and not _matches(tokenizer, typed, '{"age": "3"}')
    assert _matches(tokenizer, {"type": "object"}, '{"age": 3}')
    nested = {"type": "object", "properties": {"p": person}, "$defs": {"q": person}}
    assert _matches(tokenizer, nested, '{"p": {"name": "x"}}') and not _matches(tokenizer, nested, '{"p": {"a": 1}}')
    listed = {"type": "array", "items": {"$ref": "#/$defs/q"}, "$defs": {"q": person}}
    assert _matches(tokenizer, listed, '[{"name": "x"}]') and not _matches(tokenizer, listed, '[{"b": 1}]')
    both = {"allOf": [person, {"properties": {"age": {"type": "integer"}}}]}
    assert _matches(tokenizer, both, '{"name": "x", "age": 3}')


# --- the matcher: walk, rollback, commit


def _reference_row(compiled, ids: list[int], width: int, eos_ids: list[int]) -> torch.Tensor:
    """The allowed tokens after ids from a fresh matcher (EOS given to every EOS id)."""
    matcher = compiled.matcher()
    assert matcher.consume_tokens(ids)
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    row = torch.zeros(width, dtype=torch.bool)
    vocab = compiled.tokenizer.vocab_size
    row[:vocab] = torch.from_numpy(bits[:vocab].astype(bool))
    if row[compiled.tokenizer.eos_token]:
        row[eos_ids] = True
    return row


def test_matcher_walks_drafts_rolls_back_and_commits(tokenizer):
    compiled = compile_grammar({"regex": "(cats|dogs|cat) [0-9]+"}, tokenizer)
    width, other_eos = tokenizer.vocab_size + 64, tokenizer.token_to_id("<|endoftext|>")  # 64 padding ids
    eos_ids = [other_eos, tokenizer.eos_token_id]
    masks = torch.zeros(5, width, dtype=torch.bool)  # [R, V]
    state = GrammarState(compiled, masks, {other_eos}, draft_mask=False)
    ref = lambda ids: _reference_row(compiled, ids, width, eos_ids)  # noqa: E731
    assert torch.equal(masks[0], ref([]))
    c, ats, space, one, two, x = tokenizer.encode("cats 12")[:5] + tokenizer.encode("x")
    state.walk(torch.tensor([c, ats, space, x]))  # the fourth draft is illegal
    for j, prefix in enumerate([[], [c], [c, ats], [c, ats, space]]):
        assert torch.equal(masks[j], ref(prefix)), j
    assert masks[4].all()  # after an illegal draft: unreachable, all allowed
    assert not masks[:4, tokenizer.vocab_size :].any()  # padding ids are never allowed
    state.commit([c, ats, space])  # two drafts accepted, then a bonus equal to the walked third
    assert torch.equal(masks[0], ref([c, ats, space]))
    state.walk(torch.tensor([one, x]))
    state.commit([two])  # the draft rejected: rolled back, the bonus consumed
    assert torch.equal(masks[0], ref([c, ats, space, two]))
    assert masks[0, eos_ids].all()  # complete: every EOS id is allowed
    state.walk(torch.tensor([one, two]))
    with pytest.raises(RuntimeError, match="against the grammar"):
        state.commit([x])


# --- constrained spec == constrained plain, and what runs beside


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def bundled() -> nextn.LLM:
    return nextn.LLM(num_speculative_tokens=4, max_num_seqs=24)


def test_constrained_greedy_spec_equals_constrained_plain_on_the_bundled_model(bundled):
    tok = bundled.tokenizer
    texts = ["Describe a person as JSON with a name and an age.", "Write a product code.", "Which fruit is best?"]
    prompts = [_chat(tok, t) for t in texts]
    greedy = [
        (ids, nextn.SamplingParams(max_tokens=32, temperature=0, structured_outputs=so), k)
        for ids, so in zip(prompts, GRAMMARS, strict=True)
        for k in range(5)
    ]
    free = (_chat(tok, "Tell me a story."), nextn.SamplingParams(max_tokens=24, temperature=0), 3)
    choice = nextn.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, structured_outputs=GRAMMARS[2])
    sampled = [
        (ids, nextn.SamplingParams(max_tokens=48, temperature=0.8, seed=seed, structured_outputs=so), 3)
        for ids, so in zip(prompts, GRAMMARS, strict=True)
        for seed in range(2)
    ]
    outs = run_together(bundled, [*greedy, free, (prompts[2], choice, 3), *sampled])
    for g, so in enumerate(GRAMMARS):
        plain = outs[5 * g]
        assert plain.finish_reason == "stop" and plain.num_drafted == 0
        check_matches(so, plain, tok)
        for k in range(1, 5):
            assert outs[5 * g + k].token_ids == plain.token_ids, (so, k)
    assert sum(o.num_accepted for o in outs[:15]) > 0
    # the grammar's end is the request's, ignore_eos or not
    assert outs[16].finish_reason == "stop" and outs[16].text in CHOICES
    for (_, params, _), out in zip(sampled, outs[17:], strict=True):
        check_matches(params.structured_outputs, out, tok)
    # what ran beside changed nothing: the unconstrained request and a constrained one, alone
    assert run_together(bundled, [free])[0].token_ids == outs[15].token_ids
    assert run_together(bundled, [greedy[3]])[0].token_ids == outs[3].token_ids


def test_an_open_schema_finishes_at_t0_on_the_bundled_model(bundled):
    """Schemas without additionalProperties: false (instructor's, a named tool's): greedy, the
    bundled model added keys until max_tokens ({"valid": true, "required": true, "required": ...});
    closed as vLLM's backend closes them, each reply stops and validates."""
    jsonschema = pytest.importorskip("jsonschema")
    tok = bundled.tokenizer
    person = {"name": {"type": "string", "maxLength": 20}, "ok": {"type": "boolean"}}
    for schema in [
        {"type": "object", "properties": person, "required": ["name", "ok"]},
        {"type": "object", "properties": {"valid": {"type": "boolean"}}, "required": ["valid"]},
    ]:
        params = nextn.SamplingParams(max_tokens=120, temperature=0, structured_outputs={"json": schema})
        out = bundled.generate(prompt_token_ids=_chat(tok, "Describe a person as JSON."), params=params)
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, {**schema, "additionalProperties": False})


def test_a_bad_grammar_fails_before_anything_runs(bundled):
    good = nextn.SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z]+"})
    bad = nextn.SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z"})
    with pytest.raises(ValueError, match="regex"):
        bundled.generate(["x = ", "y = "], [good, bad])
    assert not bundled.engine.has_work  # the good request was aborted with it


def test_a_grammar_llguidance_fails_on_mid_output_is_the_request_s_error(bundled, monkeypatch):
    """a{1000}{1000} validates and masks the first token, then outgrows llguidance's lexer when it
    consumes it: the request's error (a 400 from the server), not the engine's RuntimeError (a
    500), and the engine serves the next request. (nextn.grammar.limits refuses it up front: lifted
    here, this is the engine's own guard.)"""
    monkeypatch.setattr(nextn.grammar.limits, "MAX_REPEAT_PRODUCT", 10**7)
    params = nextn.SamplingParams(max_tokens=6, temperature=0, structured_outputs={"regex": "a{1000}{1000}"})
    with pytest.raises(nextn.RequestError, match="llguidance failed on the grammar .lexer error"):
        bundled.generate(prompt="x", params=params)
    assert not bundled.engine.has_work
    again = nextn.SamplingParams(max_tokens=6, temperature=0, structured_outputs={"regex": "[a-z]+"})
    assert bundled.generate(prompt="x", params=again).text.isalpha()


def test_draft_masking_raises_acceptance_and_changes_no_token(bundled):
    unmasked = nextn.LLM(num_speculative_tokens=3, grammar_draft_mask=False)
    tok = bundled.tokenizer
    requests = [
        (
            _chat(tok, "Describe a person as JSON with a name and an age."),
            nextn.SamplingParams(max_tokens=32, temperature=0, structured_outputs=so),
            3,
        )
        for so in GRAMMARS
    ]
    masked, plain = run_together(bundled, requests), run_together(unmasked, requests)
    assert [o.token_ids for o in masked] == [o.token_ids for o in plain]
    assert sum(o.num_accepted for o in masked) > sum(o.num_accepted for o in plain)


TINY_GRAMMARS = [
    {"json": PERSON},
    {"regex": ID_REGEX},
    {"choice": ["def", "items", "name", "len", "return", "fib"]},
]


@pytest.mark.parametrize(
    "ckpt,draft_mask,draft_vocab",
    [("dense_ckpt", True, None), ("dense_ckpt", False, None), ("moe_ckpt", True, None), ("dense_ckpt", True, 160)],
)
def test_constrained_greedy_spec_equals_constrained_plain_on_random_heads(request, ckpt, draft_mask, draft_vocab):
    """draft_vocab: the head drafts over the first ids only (where none is legal, it drafts unmasked)."""
    model_dir = request.getfixturevalue(ckpt)
    plain = nextn.LLM(model=model_dir, num_speculative_tokens=0, max_num_seqs=12)
    if draft_vocab is not None:
        draft_vocab = DraftVocab.first(draft_vocab, plain.model.cfg.vocab_size)
    spec = nextn.LLM(
        model=model_dir,
        num_speculative_tokens=4,
        grammar_draft_mask=draft_mask,
        max_num_seqs=12,
        draft_vocab=draft_vocab,
    )
    requests = [
        (list(prompt), nextn.SamplingParams(max_tokens=16, temperature=0, structured_outputs=so))
        for prompt in FIT_PROMPTS
        for so in TINY_GRAMMARS
    ]
    reference = run_together(plain, [(ids, params, None) for ids, params in requests])
    for (_, params), out in zip(requests, reference, strict=True):
        check_matches(params.structured_outputs, out, plain.tokenizer)
    outs = run_together(spec, [(ids, params, k) for k in range(1, 5) for ids, params in requests])
    for i, out in enumerate(outs):
        assert out.token_ids == reference[i % len(requests)].token_ids, (i // len(requests) + 1, requests[i % 9][1])
    assert sum(o.num_drafted for o in outs) > 0


# --- sampled: constrained spec has constrained plain's law

PROMPT = list(FIT_PROMPTS[0])
TV_CASES = [
    (2, True, {"regex": "[a-z]+( [a-z]+)*"}, dict(temperature=0.9, top_k=8), 600),
    (3, True, {"choice": ["def", "items", "name", "len", "return", "fib"]}, dict(temperature=1.0), 300),
    (2, False, {"regex": "[a-z]+( [a-z]+)*"}, dict(temperature=0.9, top_k=8), 400),
]


def exact_masked_law(ckpt, structured_outputs: dict, cfg: dict, tokenizer, eos_ids: list[int], n: int = 3) -> dict:
    """The law of the first n tokens (or fewer, ending at an EOS) of constrained sampling: each
    token from the filtered law of transformers' logits with the grammar's illegal tokens at -inf."""
    compiled, law = compile_grammar(structured_outputs, tokenizer), {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, mass in law.items():
            if seq and seq[-1] in eos_ids:
                nxt[seq] = mass
                continue
            logits = hf_logits(ckpt, PROMPT + list(seq))[-1].numpy()
            allowed = _reference_row(compiled, list(seq), logits.shape[0], eos_ids).numpy()
            p = _filtered(np.where(allowed, logits, -np.inf), PROMPT + list(seq), list(seq), cfg)
            for t in np.nonzero(p)[0]:
                nxt[seq + (int(t),)] = mass * p[t]
        law = nxt
    return law


@pytest.mark.parametrize("k,draft_mask,structured_outputs,cfg,draws", TV_CASES)
def test_constrained_sampled_spec_has_constrained_plain_law(
    dense_fitted_ckpt, k, draft_mask, structured_outputs, cfg, draws
):
    llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=k, grammar_draft_mask=draft_mask, max_num_seqs=16)
    law = exact_masked_law(dense_fitted_ckpt, structured_outputs, cfg, llm.tokenizer, sorted(llm.engine.stop_ids))
    params = [
        nextn.SamplingParams(max_tokens=3, seed=s, structured_outputs=structured_outputs, **cfg) for s in range(draws)
    ]
    outs = llm.generate([PROMPT] * draws, params)
    seen = Counter(tuple(o.token_ids) for o in outs)
    assert all(seq in law for seq in seen), "a draw outside the constrained support"
    tv = 0.5 * sum(abs(seen.get(s, 0) / draws - p) for s, p in law.items())
    assert tv <= _tv_limit(law, draws), tv
    assert sum(o.num_accepted for o in outs) > 0  # the rejection path ran both ways
