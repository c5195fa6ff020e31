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
from nextn.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
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
