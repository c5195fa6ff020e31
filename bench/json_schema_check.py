"""Structured outputs under sampling, end to end: json_schema requests (`response_format`, strict)
at temperature 0.8 to `nextn serve` over the bundled model, through the openai client, several
schemas in turn; counts the replies that parse and validate against their schema, apart from those
that ended on max_tokens (finish_reason "length"). Issue 14 asks that every other one validates.

python bench/json_schema_check.py [--requests 100] [--out bench/results/json_schema_check_cpu.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import jsonschema
import openai
import torch
from batching_cpu import serve_in_thread  # (bench/ is on the path of a bench script)

import nextn

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price_cents": {"type": "integer", "minimum": 0, "maximum": 99999},
            "currency": {"enum": ["EUR", "USD", "JPY"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["sku", "price_cents", "currency", "tags"],
        "additionalProperties": False,
    },
    "point": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -90, "maximum": 90},
            "y": {"type": "number", "minimum": -180, "maximum": 180},
            "label": {"type": ["string", "null"], "maxLength": 16},
        },
        "required": ["x", "y", "label"],
        "additionalProperties": False,
    },
    "task_list": {
        "type": "object",
        "properties": {
            "tasks": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "done": {"type": "boolean"},
                    },
                    "required": ["id", "done"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["tasks"],
        "additionalProperties": False,
    },
    "choice": {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
}
PROMPTS = {
    "person": "Describe a person as JSON.",
    "product": "Give a product record as JSON.",
    "point": "A point on the map, as JSON.",
    "task_list": "List some tasks as JSON.",
    "choice": "Is it raining? Answer as JSON.",
}


def check(text: str, schema: dict) -> tuple[bool, bool]:
    """(parses as JSON, validates against `schema`)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = nextn.LLM(device="cpu", max_num_seqs=args.concurrency)
    url, stop = serve_in_thread(llm)
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    names = list(SCHEMAS)

    def ask(i: int) -> dict:
        name = names[i % len(names)]
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        r = client.chat.completions.create(
            model="default_model",
            messages=[{"role": "user", "content": PROMPTS[name]}],
            response_format=fmt,
            temperature=0.8,
            seed=i,
            max_tokens=args.max_tokens,
        )
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        parses, valid = check(text, SCHEMAS[name])
        spec = (r.usage.model_extra or {}).get("spec_decode") or {}
        return {
            "schema": name,
            "finish_reason": finish,
            "parses": parses,
            "valid": valid,
            "text": text,
            "completion_tokens": r.usage.completion_tokens,
            "accepted": spec.get("num_accepted_tokens", 0),
            "rounds": spec.get("num_rounds", 0),
        }

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        rows = list(pool.map(ask, range(args.requests)))
    wall = time.perf_counter() - t0
    stop()
    counted = [r for r in rows if r["finish_reason"] != "length"]
    per_schema = {
        name: {
            "requests": sum(r["schema"] == name for r in rows),
            "length": sum(r["schema"] == name and r["finish_reason"] == "length" for r in rows),
            "valid": sum(r["schema"] == name and r["valid"] for r in counted),
        }
        for name in names
    }
    res = {
        "model": "default_model",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "spec_k": llm.num_speculative_tokens,
        "temperature": 0.8,
        "max_tokens": args.max_tokens,
        "requests": len(rows),
        "finish_length": len(rows) - len(counted),
        "counted": len(counted),
        "parsed": sum(r["parses"] for r in counted),
        "validated": sum(r["valid"] for r in counted),
        "all_counted_validate": all(r["valid"] for r in counted),
        "per_schema": per_schema,
        "completion_tokens": sum(r["completion_tokens"] for r in rows),
        "mean_acceptance_length": 1 + sum(r["accepted"] for r in rows) / max(1, sum(r["rounds"] for r in rows)),
        "wall_s": wall,
        "failures": [r for r in counted if not r["valid"]],
        "examples": {name: next(r["text"] for r in rows if r["schema"] == name) for name in names},
        "command": "python bench/json_schema_check.py" + (f" --out {args.out}" if args.out else ""),
    }
    print(json.dumps({k: v for k, v in res.items() if k not in ("failures",)}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
