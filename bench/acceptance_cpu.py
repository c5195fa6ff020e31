"""Live acceptance of the bundled model's MTP head on code prompts, greedy and sampled (CPU, fp32).

python bench/acceptance_cpu.py [--temperatures 0 0.7] [--k 3] [--max-tokens 128] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import nextn

PROMPTS = [
    'import os\n\n\ndef list_python_files(root):\n    """Return the .py files under root."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description=",
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n",
    "    def __repr__(self):\n        return",
    "from collections import defaultdict\n\n\ndef group_by(items, key):\n",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm = nextn.LLM(num_speculative_tokens=args.k)
    results = []
    for t in args.temperatures:
        stats = nextn.SpecStats()
        for i, text in enumerate(PROMPTS):
            params = nextn.SamplingParams(max_tokens=args.max_tokens, temperature=t, seed=i, ignore_eos=True)
            stats.merge(llm.generate(prompt=text, params=params).spec)
        row = {
            "temperature": t,
            "k": args.k,
            "num_drafted": stats.num_drafted,
            "num_accepted": stats.num_accepted,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
            "accepted_per_position": [
                round(a / d, 4) if d else 0.0
                for a, d in zip(stats.accepted_per_position, stats.drafted_per_position, strict=True)
            ][: args.k],
        }
        print(json.dumps(row))
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": "nextn/default_model",
                    "device": "cpu",
                    "dtype": "float32",
                    "prompts": len(PROMPTS),
                    "max_tokens": args.max_tokens,
                    "results": results,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
