"""Train a Qwen-style byte-level BPE with the `tokenizers` library and write the tokenizer files of
a Hugging Face checkpoint: tokenizer.json, tokenizer_config.json (chat template, eos) and
generation_config.json (eos ids).

Layout follows Qwen: NFC normaliser, Qwen's pre-tokenizer split regex, byte-level symbols, the BPE
vocabulary first and the special tokens appended after it. Does not know models or training.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# special (never split, skipped when decoding with skip_special_tokens) and plain added tokens
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# Qwen's pre-tokenizer split (transformers models/qwen3_5/tokenization_qwen3_5.py)
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen-style chat template: optional tools in the system turn, <tool_call> blocks, and the
# `enable_thinking=False` empty think block on the generation prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Function signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\n\\nReturn each call as <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>'
    "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function or call %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' + (fn.arguments | tojson)'  # noqa: E501
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def build_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE of at most `vocab_size` tokens (special and added tokens included)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    num_extra = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_extra,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(ADDED_TOKENS))
    return tok


def token_id(tok, token: str) -> int:
    i = tok.token_to_id(token)
    if i is None:
        raise KeyError(f"tokenizer has no token {token!r}")
    return i


def write_tokenizer_files(tok, out_dir: str | Path, model_max_length: int = 32768) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(token_id(tok, t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + ADDED_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    write_generation_config(tok, out_dir)


def write_generation_config(tok, out_dir: Path) -> None:
    eot, im_end = token_id(tok, ENDOFTEXT), token_id(tok, IM_END)
    generation_config = {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot}
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def load_tokenizer(model_dir: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
