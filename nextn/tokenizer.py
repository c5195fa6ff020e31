"""Text <-> token ids from a checkpoint's tokenizer.json, and its chat template from
tokenizer_config.json (rendered with a sandboxed jinja2, as transformers does); or both from a GGUF
file's metadata (Tokenizer.from_gguf; nextn.gguf_tokenizer builds the BPE)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir}: no tokenizer.json")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            raise TokenizerError(f"{path}: not a tokenizer the tokenizers library reads ({e})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        try:
            self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{cfg_path}: not valid JSON ({e})") from None
        template = self.config.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        self.chat_template = template
        eos = self.config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    @classmethod
    def from_gguf(cls, source: str | Path | GGUFReader) -> Tokenizer:
        """The tokenizer, chat template and eos token of a GGUF file (`tokenizer.ggml.*`,
        `tokenizer.chat_template`): a path (its reader shared with the model loader: nextn.gguf_file), or
        a reader. `config` is empty (a GGUF has no tokenizer_config.json)."""
        from gguf import GGUFReader, Keys

        from nextn.gguf_file import GGUFFileError, gguf_reader
        from nextn.gguf_tokenizer import chat_template_from_gguf, tokenizer_from_gguf

        try:  # a path: the reader the config and the model loader read too, parsed once (nextn.gguf_file)
            reader = source if isinstance(source, GGUFReader) else gguf_reader(source)
        except GGUFFileError as e:
            raise TokenizerError(str(e)) from None
        self = cls.__new__(cls)
        self._tok, self.config = tokenizer_from_gguf(reader), {}
        self.chat_template = chat_template_from_gguf(reader)
        eos = reader.fields.get(Keys.Tokenizer.EOS_ID)
        self.eos_token_id = None if eos is None else int(eos.contents())
        return self

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_str(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance reads)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise TokenizerError("this checkpoint has no chat template (tokenizer_config.json chat_template)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)

        def raise_exception(message):
            raise TokenizerError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
        )


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas, holding back incomplete UTF-8 sequences.

    Each push decodes only a window: the tokens since the last emitted boundary, plus the few
    before it as context (compared decoded with and without the new tokens), so a long output
    costs O(n) decoding, not O(n^2).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context for the decoder
        self.read_offset = 0  # tokens before this are emitted

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if text.endswith("\ufffd") or len(text) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence (or nothing visible yet): wait
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory, or of a GGUF file (its metadata: Tokenizer.from_gguf)."""
    return Tokenizer.from_gguf(path) if Path(path).suffix.lower() == ".gguf" else Tokenizer(path)
