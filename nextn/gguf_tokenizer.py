"""A GGUF file's tokenizer: `tokenizer_from_gguf` builds a `tokenizers` byte-level BPE from the file's
`tokenizer.ggml.*` metadata that encodes exactly as the tokenizer.json the file was written from, and
`chat_template_from_gguf` reads its chat template; `write_vocab` writes a checkpoint's tokenizer.json (and
tokenizer_config.json's special tokens and chat template) into a GGUF as llama.cpp's convert_hf_to_gguf.py
does, so that llama.cpp loads the file and nextn reads the same tokenizer back.

What a GGUF holds: every token's text (byte-level strings for BPE tokens, raw text for added ones), its type
(NORMAL; CONTROL: a special added token; USER_DEFINED: a non-special added token; UNUSED: a padding row
past the tokenizer, up to the embedding's rows), the merges by rank ("a b") and the pre-tokenizer as a
*name* (`tokenizer.ggml.pre`), not its rules. The rules are hand-written here because no library holds
them: llama.cpp maps the name to its own regexes in C++ (src/llama-vocab.cpp: `llama_vocab::impl::load`
maps the name to a LLAMA_VOCAB_PRE_TYPE, `llm_tokenizer_bpe` gives each type its regexes and quotes the
tokenizer.json original beside them). PRE_TOKENIZERS holds, for the names the Qwen family gets, that
tokenizer.json original (a `(?i:...)` group where llama.cpp spells each case out) and llama.cpp's
ignore_merges flag for the name. Any other pre name, or a tokenizer model other than gpt2, is refused:
its regexes would be a guess.

Where the GGUF cannot say what tokenizer.json said, the rebuilt tokenizer follows llama.cpp, except for
two settings that change ids, which `write_vocab` records under keys of nextn's own (llama.cpp skips keys
it does not know) when the tokenizer.json differs from llama.cpp, and the reader takes over llama.cpp's:
- IGNORE_MERGES_KEY: a pre-token that is a vocabulary entry is one token, as tiktoken encodes. A
  tokenizer.json converted from tiktoken ranks (bench/qwen_tokenizer.py) sets it where llama.cpp's
  `qwen35` does not, and some words split differently (its merges do not reach 201 of its 248,044
  tokens, " seputar" among them).
- NORMALIZED_KEY: the ids of added tokens matched in the NFC-normalized text, not the raw text llama.cpp
  matches in (nextn's trained vocabulary has its `<think>`-style tokens so: `<think>` followed by U+0338
  differs).
Added tokens keep their ids and are matched in the text before the split, as tokenizers does; CONTROL ones
are special (skipped when decoding without specials), as convert_hf_to_gguf.py marks special added tokens
and added tokens that look special (`<|...|>`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader, GGUFWriter, Keys, SpecialVocab, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

log = logging.getLogger("nextn.gguf")

IGNORE_MERGES_KEY = "nextn.tokenizer.ignore_merges"
NORMALIZED_KEY = "nextn.tokenizer.normalized_token_ids"


class GGUFTokenizerError(ValueError):
    pass


@dataclass(frozen=True)
class PreTokenizer:
    """What a `tokenizer.ggml.pre` name stands for, as far as token ids depend on it."""

    regex: str  # the tokenizer.json Split pattern (isolated), before byte-level mapping; NFC comes first
    ignore_merges: bool  # llama.cpp's flag for the name


# src/llama-vocab.cpp: "qwen2" (and aliases of other vendors, not taken here) -> LLAMA_VOCAB_PRE_TYPE_QWEN2,
# the name convert_hf_to_gguf.py gives Qwen2's tokenizer (which Qwen2.5, Qwen3 and Qwen3-Next keep); "qwen35" ->
# LLAMA_VOCAB_PRE_TYPE_QWEN35 (Qwen3.5: combining marks \p{M} stay with their letters and out of punctuation
# runs). Both set clean_spaces = false and leave ignore_merges false.
PRE_TOKENIZERS = {
    "qwen2": PreTokenizer(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
        ignore_merges=False,
    ),
    "qwen35": PreTokenizer(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
        ignore_merges=False,
    ),
}


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise GGUFTokenizerError(f"the GGUF has no {key}")
        return default
    return field.contents()


def tokenizer_from_gguf(reader: GGUFReader) -> Tokenizer:
    """The byte-level BPE the GGUF's `tokenizer.ggml.*` metadata describes (ids as the file's token list)."""
    model = _field(reader, Keys.Tokenizer.MODEL)
    if model != "gpt2":
        raise GGUFTokenizerError(f"tokenizer.ggml.model {model!r}: nextn reads only 'gpt2' (byte-level BPE)")
    pre = _field(reader, Keys.Tokenizer.PRE)
    if pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.pre {pre!r}: not a pre-tokenizer nextn knows ({', '.join(sorted(PRE_TOKENIZERS))})"
        )
    rules = PRE_TOKENIZERS[pre]
    tokens = _field(reader, Keys.Tokenizer.LIST)
    types = _field(reader, Keys.Tokenizer.TOKEN_TYPE)
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"{len(tokens)} tokens but {len(types)} token types")
    vocab, added = _vocabulary(tokens, types)
    normalized = set(_field(reader, NORMALIZED_KEY, []))
    merges = [_merge(m) for m in _field(reader, Keys.Tokenizer.MERGES)]
    ignore_merges = bool(_field(reader, IGNORE_MERGES_KEY, rules.ignore_merges))
    try:
        tok = Tokenizer(BPE(vocab, merges, ignore_merges=ignore_merges))
    except Exception as e:  # tokenizers raises a bare Exception for a merge of tokens not in the vocabulary
        raise GGUFTokenizerError(f"tokenizer.ggml.merges: not merges of the vocabulary's tokens ({e})") from None
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(rules.regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for token_id, content, special in added:  # in id order; each is in the vocabulary, so keeps its id
        tok.add_tokens([AddedToken(content, special=special, normalized=token_id in normalized)])
        if tok.token_to_id(content) != token_id:
            raise GGUFTokenizerError(f"added token {content!r} got id {tok.token_to_id(content)}, not {token_id}")
    return tok


def _vocabulary(tokens: list[str], types: list[int]) -> tuple[dict[str, int], list[tuple[int, str, bool]]]:
    """The BPE vocabulary (every used token: an added token's id must be one the vocabulary gives it) and
    the added tokens (id, text, special). UNUSED rows are padding no tokenizer had: left out."""
    vocab, added = {}, []
    for token_id, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == TokenType.UNUSED:
            continue
        if kind not in (TokenType.NORMAL, TokenType.CONTROL, TokenType.USER_DEFINED):
            raise GGUFTokenizerError(
                f"token {token_id} {token!r} has type {TokenType(kind).name}, not one a gpt2 vocabulary has"
            )
        if vocab.setdefault(token, token_id) != token_id:
            raise GGUFTokenizerError(f"token {token!r} is both id {vocab[token]} and id {token_id}")
        if kind != TokenType.NORMAL:
            added.append((token_id, token, kind == TokenType.CONTROL))
    return vocab, added


def _merge(merge: str) -> tuple[str, str]:
    """'a b' -> (a, b), split at the first space after the first character, as llama.cpp does."""
    i = merge.find(" ", 1)
    if i < 0:
        raise GGUFTokenizerError(f"tokenizer.ggml.merges: {merge!r} is not two tokens")
    return merge[:i], merge[i + 1 :]


def chat_template_from_gguf(reader: GGUFReader) -> str | None:
    """The default chat template (`tokenizer.chat_template`), or None when the file has none."""
    field = reader.fields.get(Keys.Tokenizer.CHAT_TEMPLATE)
    return None if field is None else field.contents()


def write_vocab(writer: GGUFWriter, tokenizer_dir: Path, *, vocab_size: int | None = None) -> None:
    """Write tokenizer_dir's tokenizer.json (+ tokenizer_config.json) into writer's metadata as
    convert_hf_to_gguf.py's `_set_vocab_gpt2` does: the token list padded with UNUSED `[PAD{i}]` rows to
    vocab_size (the embedding's rows; None: the tokenizer's own count), the token types, the pre name,
    and through gguf.SpecialVocab the merges, special token ids, add_*_token flags and the chat template.
    The pre name comes from the tokenizer.json's pre-tokenizer (the regex llama.cpp quotes for the name),
    not from convert_hf_to_gguf.py's hash of a sample's ids: a checkpoint's vocabulary may be a small one
    trained with Qwen's rules, whose hash no table holds."""
    tokenizer_dir = Path(tokenizer_dir)
    path = tokenizer_dir / "tokenizer.json"
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise GGUFTokenizerError(f"{path}: not a readable tokenizer.json ({e})") from None
    pre = pre_name(spec)
    tokens, types = _token_list(spec, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    ignore_merges = bool(spec["model"].get("ignore_merges", False))
    if ignore_merges != PRE_TOKENIZERS[pre].ignore_merges:
        writer.add_bool(IGNORE_MERGES_KEY, ignore_merges)
        log.info(
            "%s: ignore_merges=%s, unlike llama.cpp's %r: written as %s", path, ignore_merges, pre, IGNORE_MERGES_KEY
        )
    if normalized := [a["id"] for a in spec.get("added_tokens", []) if a.get("normalized")]:
        writer.add_array(NORMALIZED_KEY, normalized)
    special = SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=len(tokens))
    if not special.merges:
        raise GGUFTokenizerError(f"{path}: no merges")
    special.add_to_gguf(writer, quiet=True)


def pre_name(spec: dict) -> str:
    """The `tokenizer.ggml.pre` name of a tokenizer.json, or an error naming what nextn cannot write:
    NFC, then Qwen's split regex (isolated), then byte-level mapping without its own regex; a byte-level
    BPE without unknown-token, dropout, byte fallback or subword affixes; a byte-level decoder."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise GGUFTokenizerError(f"tokenizer.json model {model.get('type')!r}: nextn writes only byte-level BPE")
    plain = {"dropout": None, "unk_token": None, "byte_fallback": False, "fuse_unk": False}
    plain |= {"continuing_subword_prefix": "", "end_of_word_suffix": ""}
    odd = {k: model[k] for k, v in plain.items() if model.get(k, v) not in (v, None)}
    if odd:
        raise GGUFTokenizerError(f"tokenizer.json BPE sets {odd}: a GGUF vocabulary cannot say it")
    if spec.get("normalizer") != {"type": "NFC"}:
        raise GGUFTokenizerError(f"tokenizer.json normalizer {spec.get('normalizer')}: the Qwen pre names need NFC")
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise GGUFTokenizerError(f"tokenizer.json decoder {spec.get('decoder')}: not byte-level")
    if (spec.get("post_processor") or {"type": "ByteLevel"}).get("type") != "ByteLevel":
        raise GGUFTokenizerError(
            f"tokenizer.json post_processor {spec['post_processor']['type']}: not one nextn writes"
        )
    steps = (spec.get("pre_tokenizer") or {}).get("pretokenizers") or []
    kinds = [s.get("type") for s in steps]
    if kinds == ["Split", "ByteLevel"] and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
        if not steps[1].get("use_regex", True) and not steps[1].get("add_prefix_space", True):
            regex = steps[0].get("pattern", {}).get("Regex")
            for name, rules in PRE_TOKENIZERS.items():
                if rules.regex == regex:
                    return name
    raise GGUFTokenizerError(
        f"tokenizer.json pre_tokenizer {json.dumps(spec.get('pre_tokenizer'))[:300]}: not the split of a "
        f"pre-tokenizer nextn writes ({', '.join(sorted(PRE_TOKENIZERS))})"
    )


def _token_list(spec: dict, vocab_size: int | None) -> tuple[list[str], list[int]]:
    """Every id's text and type, as convert_hf_to_gguf.py's get_vocab_base lists them."""
    text = {i: t for t, i in spec["model"]["vocab"].items()}
    added = {}
    for a in spec.get("added_tokens", []):
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            raise GGUFTokenizerError(
                f"added token {a['content']!r}: lstrip/rstrip/single_word, which a GGUF cannot say"
            )
        text[a["id"]], added[a["id"]] = a["content"], a.get("special", False) or _looks_special(a["content"])
    size = max(text) + 1
    if vocab_size is not None and vocab_size < size:
        raise GGUFTokenizerError(f"vocab_size {vocab_size} is less than the tokenizer's {size} ids")
    tokens, types = [], []
    for i in range(size if vocab_size is None else vocab_size):
        if i not in text:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(text[i])
            types.append(
                TokenType.NORMAL if i not in added else TokenType.CONTROL if added[i] else TokenType.USER_DEFINED
            )
    return tokens, types


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special: added tokens some models leave unmarked."""
    if token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]"):
        return True
    return (
        (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )
