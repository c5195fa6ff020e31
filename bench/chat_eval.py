"""Ten coding requests to a checkpoint through `LLM.chat` (its generation defaults, sampled, seed
per request): how many answers are non-empty and carry code (a ```python block or a `def` /
`class` / `return` / `import` line). Writes the transcripts and the count as JSON.

    python bench/chat_eval.py [--model DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re

from nextn import LLM

REQUESTS = [
    "Write a Python function that reverses a string.",
    "Implement binary search over a sorted list in Python.",
    "Write a function that returns the n-th Fibonacci number.",
    "How do I read a JSON file into a dictionary in Python?",
    "Write a Python function that checks whether a number is prime.",
    "Write a function that merges two sorted lists into one sorted list.",
    "Write a Python class for a stack with push and pop methods.",
    "How do I count the words in a text file in Python?",
    "Write a function that removes duplicates from a list while keeping the order.",
    "Write a Python function that returns the factorial of n.",
]
CODE = re.compile(r"```python|^\s*(def|class|return|import|from) ", re.M)


def code_bearing(text: str) -> bool:
    return bool(text.strip()) and bool(CODE.search(text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out")
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device)
    rows = []
    for i, ask in enumerate(REQUESTS):
        params = llm.default_sampling_params(max_tokens=args.max_tokens, seed=i)
        out = llm.chat([{"role": "user", "content": ask}], params)[0]
        text = out.outputs[0].text
        rows.append({"request": ask, "content": text, "code_bearing": code_bearing(text)})
        print(f"--- {ask}\n{text}\n")
    n = sum(r["code_bearing"] for r in rows)
    print(f"code-bearing answers: {n} of {len(rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model or "bundled", "code_bearing": n, "requests": rows}, f, indent=2)


if __name__ == "__main__":
    main()
