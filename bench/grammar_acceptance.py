"""Draft acceptance under JSON-schema structured outputs on the bundled model, with the head's
drafts grammar-masked (the default) against unmasked (only the verify masked), K = 3, greedy and
sampled, CPU float32. Outputs are checked equal both ways (greedy) and parsed as JSON.

python bench/grammar_acceptance.py [--k 3] [--max-tokens 96] [--temperatures 0 0.8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import nextn

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "config": {
        "type": "object",
        "properties": {
            "host": {"type": "string"},
            "port": {"type": "integer"},
            "debug": {"type": "boolean"},
            "paths": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["host", "port", "debug", "paths"],
        "additionalProperties": False,
    },
    "package": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
            "license": {"enum": ["MIT", "BSD-3-Clause", "Apache-2.0", "GPL-3.0"]},
            "dependencies": {"type": "object", "additionalProperties": {"type": "string"}, "maxProperties": 3},
        },
        "required": ["name", "version", "license", "dependencies"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"enum": ["read_file", "list_dir", "run_tests"]},
            "arguments": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "recursive": {"type": "boolean"}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}

# the bundled model knows Python only: JSON as a Python program would write it
PROMPTS = [
    "import json\n\n\ndef load_settings():\n    return json.loads('",
    "DEFAULTS = ",
    "    def to_dict(self):\n        return ",
]


def run(k: int, draft_mask: bool, temperature: float, max_tokens: int) -> dict:
    llm = nextn.LLM(num_speculative_tokens=k, grammar_draft_mask=draft_mask, max_num_seqs=len(PROMPTS))
    rows = {}
    for name, schema in SCHEMAS.items():
        params = [
            nextn.SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=i, structured_outputs={"json": schema}
            )
            for i in range(len(PROMPTS))
        ]
        outs = llm.generate(PROMPTS, params)
        stats = nextn.SpecStats()
        for o in outs:
            stats.merge(o.spec)
        rows[name] = {
            "num_rounds": stats.num_rounds,
            "num_drafted": stats.num_drafted,
            "num_accepted": stats.num_accepted,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
            "per_position": [
                round(a / d, 4)
                for a, d in zip(stats.accepted_per_position, stats.drafted_per_position, strict=True)
                if d
            ],
            "finished": sum(o.finish_reason == "stop" for o in outs),
            "parsed": sum(_parses(o.text) for o in outs if o.finish_reason == "stop"),
            "token_ids": [o.token_ids for o in outs],
        }
    return rows


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = []
    for t in args.temperatures:
        masked, unmasked = (run(args.k, m, t, args.max_tokens) for m in (True, False))
        for name in SCHEMAS:
            on, off = masked[name], unmasked[name]
            row = {"schema": name, "temperature": t, "k": args.k, "prompts": len(PROMPTS)}
            if t == 0.0:
                row["outputs_equal"] = on["token_ids"] == off["token_ids"]
            for key, r in (("masked", on), ("unmasked", off)):
                row[key] = {f: v for f, v in r.items() if f != "token_ids"}
            print(json.dumps(row))
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": "default_model", "device": "cpu", "dtype": "float32", "results": results}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
