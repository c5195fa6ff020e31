"""Synthetic chat transcripts for fine-tuning the bundled model into a coding assistant: every
documented Python function under the given folders becomes a request ("write a function that
<its docstring's summary>") answered with its source in a ```python block, rendered through the
checkpoint's own chat template; a share of them become tool-call exchanges (the tool list in the
system turn, a `<tool_call>` answer, a tool response, a closing answer). Transcripts are joined
with <|endoftext|> into `.chat` files for `nextn train --finetune-from ... --suffix .chat`.

    python bench/chat_data.py --src /usr/lib/python3.12 --out /tmp/chat [--max-examples N]
"""

from __future__ import annotations

import argparse
import ast
import random
import textwrap
from pathlib import Path

from nextn.tokenizer import Tokenizer

ASK = [
    "Write a Python function `{sig}` that {summary}",
    "Implement `{name}` in Python. It should {summary}",
    "Can you write a function that {summary}",
    "How do I {summary} in Python?",
    "{Summary}\nWrite it in Python.",
    "I need a helper `{name}` that will {summary} Please write it.",
]
ANSWER = [
    "```python\n{code}\n```",
    "Here is an implementation:\n\n```python\n{code}\n```",
    "```python\n{code}\n```\n\n`{name}` {summary_3rd}",
    "Sure:\n\n```python\n{code}\n```",
]
WORDS = ["alpha", "data.csv", "report", "users", "config.json", "main", "blue", "tokens", "cache", "left"]


def functions(path: Path):
    """(name, signature, summary, source) of each documented function of a file, short ones only."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        source = ast.get_source_segment(text, node)
        if not doc or not source or not 3 <= source.count("\n") <= 40:
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip().split(". ")[0].rstrip(".") + "."
        if not 12 <= len(summary) <= 160 or not summary[0].isupper():
            continue
        args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
        source = textwrap.dedent(" " * node.col_offset + source)  # a method's body keeps its indent
        yield node.name, f"{node.name}({', '.join(args)})", summary, source, args


def lower_first(s: str) -> str:
    return s[0].lower() + s[1:]


def third_person(summary: str) -> str:
    """'Return the x.' -> 'returns the x.'"""
    head, _, rest = summary.partition(" ")
    head = head.lower()
    if head.endswith("s"):  # already 'returns'
        pass
    elif head.endswith(("sh", "ch", "x")):
        head += "es"
    elif head.endswith("y") and len(head) > 1 and head[-2] not in "aeiou":
        head = head[:-1] + "ies"
    else:
        head += "s"
    return f"{head} {rest}".strip()


def coding_chat(rng: random.Random, fn) -> list[dict]:
    name, sig, summary, code, _ = fn
    ask = rng.choice(ASK).format(sig=sig, name=name, summary=lower_first(summary), Summary=summary)
    answer = rng.choice(ANSWER).format(code=code, name=name, summary_3rd=third_person(summary))
    messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.2:
        messages.insert(0, {"role": "system", "content": "You are a helpful coding assistant."})
    return messages


def tool_chat(rng: random.Random, fns: list) -> tuple[list[dict], list[dict]]:
    tools = [
        {
            "type": "function",
            "function": {
                "name": f[0],
                "description": f[2],
                "parameters": {
                    "type": "object",
                    "properties": {a: {"type": "string"} for a in f[4]},
                    "required": list(f[4]),
                },
            },
        }
        for f in fns
    ]
    name, _, summary, _, args = rng.choice(fns)
    values = {a: rng.choice(WORDS) for a in args}
    ask = f"Please {lower_first(summary).rstrip('.')}" + (
        " with " + ", ".join(f"{a} {v}" for a, v in values.items()) + "." if values else "."
    )
    result = rng.choice([str(rng.randint(0, 999)), rng.choice(WORDS), "true", "[]"])
    call = {"type": "function", "function": {"name": name, "arguments": values}}
    messages = [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": f"`{name}` returned {result}."},
    ]
    return messages, tools


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", action="append", required=True, help="folder of Python files (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--template-from", default="nextn/default_model", help="checkpoint whose chat template renders")
    ap.add_argument("--max-examples", type=int, default=200_000)
    ap.add_argument("--tool-share", type=float, default=0.15)
    ap.add_argument("--per-file", type=int, default=200, help="transcripts per .chat file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--renderings", type=int, default=1, help="times each function is asked and answered (new wording each time)"
    )
    args = ap.parse_args()
    tokenizer = Tokenizer(Path(args.template_from))  # the engine's own template rendering
    rng = random.Random(args.seed)
    paths = [p for root in args.src for p in sorted(Path(root).rglob("*.py")) if p.stat().st_size < 200_000]
    fns = [fn for path in paths for fn in functions(path)]
    rng.shuffle(fns)
    fns = fns[: args.max_examples]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts, tools_made = [], 0
    for r in range(args.renderings):
        made = []
        for fn in fns:
            if rng.random() < args.tool_share:
                messages, tools = tool_chat(rng, rng.sample(fns, 3))
                tools_made += 1
            else:
                messages, tools = coding_chat(rng, fn), None
            extra = {"tools": tools} if tools else {}
            made.append(tokenizer.apply_chat_template(messages, add_generation_prompt=False, **extra))
        rng.shuffle(made)  # each file a different mix, so no two renderings' files repeat each other
        for i in range(0, len(made), args.per_file):
            chunk = "<|endoftext|>".join(made[i : i + args.per_file])
            (out / f"chat_r{r}_{i // args.per_file:05d}.chat").write_text(chunk)
        texts += made
    size = sum(map(len, texts))
    print(f"{len(texts)} transcripts ({tools_made} with tool calls), {size / 1e6:.1f} MB, in {out}")


if __name__ == "__main__":
    main()
