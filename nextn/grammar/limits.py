"""What a request's grammar may hold before it reaches llguidance: checks that run in the API process
(pure Python, iterative, linear in the input) and refuse with a ValueError naming the limit.

Why each bound (measured on the CPU, llguidance 1.x, the bundled tokenizer; the process starts at
~245 MB RSS with torch loaded):
- llguidance's JSON-schema compiler recurses once per nesting level and per `$ref` hop. On an 8 MB
  C stack a chain of `$ref`s through objects dies (SIGSEGV) between 500 and 1,000 hops, a chain of
  bare aliases between 2,000 and 2,500. So every llguidance call runs on a thread with a 256 MB stack
  (compile.py: `BIG_STACK`), where a 20,000-hop chain (1.3 MB of JSON) ends in llguidance's own
  "schema too large" (0.95 s, +230 MB). The checks below refuse far earlier, with a clear 400:
  MAX_SCHEMA_BYTES (256 KiB of JSON text: ~4,000 object hops at most, a fifth of what the big
  stack was seen to hold), MAX_SCHEMA_DEPTH (128 nested objects and arrays: llguidance's own JSON
  reader, serde_json's, stops there with a "recursion limit exceeded"), MAX_REF_CHAIN (128 `$ref`
  hops along one path, where 500 through objects already needs more than 8 MB of stack; recursion
  through a cycle is legal and not counted: llguidance expands each definition once).
- A counted repetition is unrolled: `(?:a{1000}){1000}` builds 10^6 lexer expressions (0.9 s of CPU
  to validate here, 2 s a request through the server, ~10 s and ~100 MB in the issue's probe, before
  llguidance's own "too many expressions"), `(?:a{100}){1000}` (10^5) takes 0.18 s and +40 MB, 10^4
  under 0.06 s. MAX_REPEAT_PRODUCT = 10,000 bounds the product of nested counts, found by a scan of
  the regex, of a schema's `pattern`s, and of a Lark grammar (through its terminals, which the lexer
  inlines: `lark_repeat_product`). Not scanned: the `pattern`s of a `%json` inside a Lark grammar;
  there the big stack and llguidance's own fuel limits stand (no time limit on a compile).
- MAX_GRAMMAR_BYTES (as MAX_SCHEMA_BYTES) bounds a regex, a Lark grammar and a choice list's text.
- Literals the model must write (a choice, a JSON `const` / `enum` string, a property name) must not
  hold an added token's text (`</think>`): llguidance's mask then allows only the added token, which
  its matcher then refuses, so no reply could be produced; nor text that NFC normalisation changes
  (`"a\u0301"`, `"Ω"` U+2126): the bundled tokenizer writes `Ω` but not `a\u0301` (mask and matcher
  disagree again), a normalising one neither; refused alike, whatever the tokenizer. A regex is held
  to NFC too. (Should one get through, the engine fails that request alone: nextn.grammar.state.)

Does not compile anything and knows nothing of HTTP (the server names the field).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable

MAX_SCHEMA_BYTES = 256 * 1024
MAX_SCHEMA_DEPTH = 128
MAX_REF_CHAIN = 128
MAX_REPEAT_PRODUCT = 10_000
MAX_GRAMMAR_BYTES = MAX_SCHEMA_BYTES  # a Lark grammar may embed a schema (`%json`): the same room

_COUNT = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_RULE = re.compile(r"^[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?\s*:", re.M)


def lark_repeat_product(grammar: str) -> int:
    """repeat_product over a Lark grammar's rules. A TERMINAL's name stands for its own product (the
    lexer inlines terminals: `B: C{100}`, `C: D{100}`, `D: "a"{100}` builds 10^6 expressions, 0.64 s
    and +200 MB); a rule's name counts one (a rule is referred to, not copied: `b{1000}` of a rule
    `b: "a"{1000}` compiles in 10 ms). Terminals cannot recurse, so the passes settle."""
    starts = list(_RULE.finditer(grammar))
    bodies = {m.group(1): grammar[m.end() : nxt.start() if nxt else len(grammar)]
              for m, nxt in zip(starts, [*starts[1:], None], strict=True)}  # fmt: skip
    terminals: dict[str, int] = {}
    rules: dict[str, int] = {}
    for _ in range(64):  # a chain of terminals defined in reverse order settles in as many passes
        before = dict(terminals)
        for name, body in bodies.items():
            product = min(repeat_product(body, terminals), MAX_REPEAT_PRODUCT + 1)
            (terminals if name.isupper() else rules)[name] = product
        if terminals == before:
            break
    return max([1, *terminals.values(), *rules.values()])


def repeat_product(text: str, lark: dict[str, int] | None = None) -> int:
    """An upper bound of how many times a counted repetition `{m,n}` unrolls the innermost atom of
    `text` (a regex; with `lark`, a Lark rule's body: a "string" is one atom, a /regex/ one of its
    own product, a name one of `lark`'s product for it): the product of nested counts, the largest."""
    stack = [1]  # the largest product inside each open group (the outermost: the whole text)
    last = 1  # the product of the atom just closed (a group's inner product, or 1)
    worst, i, n = 1, 0, len(text)
    while i < n:
        c = text[i]
        if lark is not None and c in '"/':  # a string or a regex literal, to its closing quote
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            last = 1 if c == '"' else repeat_product(text[i + 1 : j])
            stack[-1], worst, i = max(stack[-1], last), max(worst, last), j + 1
            continue
        if lark is not None and (c.isalpha() or c == "_"):  # a name
            m = _NAME.match(text, i)
            last = lark.get(m.group(), 1)
            stack[-1], worst, i = max(stack[-1], last), max(worst, last), m.end()
            continue
        if c == "\\":
            i, last = i + 2, 1
            continue
        if c == "[":  # a class: skip to its end (a "]" first inside is literal)
            j = i + 2 if text[i + 1 : i + 2] == "]" else i + 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if c == "(":
            stack.append(1)
        elif c == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
            i += 1
            continue
        elif c == "{":
            m = _COUNT.match(text, i)
            if m and (m.group(1) or m.group(2)):
                count = max(int(m.group(1) or 0), int(m.group(2) or 0), 1)
                last = last * count
                stack[-1] = max(stack[-1], last)
                worst = max(worst, last)
                i = m.end()
                continue
        last = 1
        i += 1
    return worst


def check_repeats(text: str, what: str, lark: bool = False) -> None:
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{what} is {len(text.encode())} bytes, more than MAX_GRAMMAR_BYTES={MAX_GRAMMAR_BYTES}")
    product = lark_repeat_product(text) if lark else repeat_product(text)
    if product > MAX_REPEAT_PRODUCT:
        raise ValueError(
            f"{what}: its nested counted repetitions unroll {product} times, more than "
            f"MAX_REPEAT_PRODUCT={MAX_REPEAT_PRODUCT}"
        )


def check_literal(text: str, what: str, added_tokens: Iterable[str]) -> None:
    """`text` must be written by the model as it is: no added token's text, NFC already."""
    for t in added_tokens:
        if t and t in text:
            raise ValueError(f"{what} {text!r} holds the text of the added token {t!r}, which a grammar cannot ask for")
    if not unicodedata.is_normalized("NFC", text):
        raise ValueError(f"{what} {text!r} is not in Unicode NFC form (write {unicodedata.normalize('NFC', text)!r})")


def check_regex(regex: str, what: str) -> None:
    check_repeats(regex, what)
    if not unicodedata.is_normalized("NFC", regex):
        raise ValueError(f"{what} {regex!r} is not in Unicode NFC form")


def check_schema(schema, what: str, added_tokens: Iterable[str]) -> None:
    """Size, nesting depth, the longest `$ref` chain and the literals of a JSON schema."""
    added = tuple(added_tokens)
    size = len(json.dumps(schema, ensure_ascii=False).encode()) if _shallow(schema, what) else MAX_SCHEMA_BYTES + 1
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"{what}: the schema is larger than MAX_SCHEMA_BYTES={MAX_SCHEMA_BYTES}")
    refs: dict[str, list[str]] = {}  # a JSON pointer -> the $refs in the subtree at it
    nodes: dict[str, object] = {}
    todo = [(schema, "#", ())]  # (node, its pointer, the pointers of the subtrees it lies in)
    while todo:
        node, ptr, owners = todo.pop()
        nodes[ptr] = node
        owners = (*owners, ptr)
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                for o in owners:
                    refs.setdefault(o, []).append(ref)
            for key in ("const",):
                if key in node:
                    _literals(node[key], f"{what}: const", added)
            if isinstance(node.get("enum"), list):
                _literals(node["enum"], f"{what}: enum value", added)
            if isinstance(node.get("pattern"), str):
                check_regex(node["pattern"], f"{what}: pattern")
            if isinstance(node.get("properties"), dict):
                for name in node["properties"]:
                    check_literal(name, f"{what}: property name", added)
            items = node.items()
        elif isinstance(node, list):
            items = ((str(i), v) for i, v in enumerate(node))
        else:
            continue
        for k, v in items:
            if isinstance(v, dict | list):
                todo.append((v, f"{ptr}/{k.replace('~', '~0').replace('/', '~1')}", owners))
    # the longest chain of $ref hops from the root (a hop back into a chain in progress is recursion:
    # llguidance refers to the definition being built, it does not expand it again)
    depth: dict[str, int] = {}
    stack: list[tuple[str, int]] = [("#", 0)]
    on_path: list[str] = []
    while stack:
        ptr, state = stack.pop()
        if state == 0:
            if ptr in depth or ptr in on_path:
                continue
            on_path.append(ptr)
            stack.append((ptr, 1))
            if len(on_path) > MAX_REF_CHAIN + 1:
                raise ValueError(f"{what}: a chain of $ref longer than MAX_REF_CHAIN={MAX_REF_CHAIN}")
            stack += [(r, 0) for r in refs.get(ptr, []) if r in nodes]
        else:
            on_path.pop()
            depth[ptr] = 1 + max((depth.get(r, 0) for r in refs.get(ptr, []) if r in nodes), default=0)
            if depth[ptr] > MAX_REF_CHAIN + 1:
                raise ValueError(f"{what}: a chain of $ref longer than MAX_REF_CHAIN={MAX_REF_CHAIN}")


def _shallow(value, what: str) -> bool:
    """Whether `value` nests at most MAX_SCHEMA_DEPTH containers (checked without recursion)."""
    todo = [(value, 1)]
    while todo:
        node, d = todo.pop()
        if isinstance(node, dict | list):
            if d > MAX_SCHEMA_DEPTH:
                raise ValueError(f"{what}: the schema nests deeper than MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH}")
            todo += [(v, d + 1) for v in (node.values() if isinstance(node, dict) else node)]
    return True


def _literals(value, what: str, added: tuple[str, ...]) -> None:
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            check_literal(v, what, added)
        elif isinstance(v, list):
            todo += v
        elif isinstance(v, dict):
            todo += list(v.values())
            for k in v:
                check_literal(k, what, added)
