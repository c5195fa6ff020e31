"""A GGUF file's metadata, parsed once a process: gguf's GGUFReader builds Python objects for every
metadata entry, ~17 s for Qwen3.5's 248k-token vocabulary on a 2-core CPU, and the tokenizer
(nextn.tokenizer), the config and the weight loader (nextn.models.gguf) each read the file. The
last two files opened are kept; a file changed since (its mtime or size) is opened again. A leaf
module: the tokenizer may not import the model package (nextn.config imports the tokenizer)."""

from __future__ import annotations

import functools
from pathlib import Path


class GGUFFileError(ValueError):
    """A file gguf cannot read."""


def gguf_reader(path: str | Path):
    """gguf's reader over the file (memory-mapped: no tensor is read yet), shared (see above)."""
    try:
        stat = Path(path).stat()
    except OSError as e:
        raise GGUFFileError(f"{path}: not a readable GGUF file ({e})") from None
    return _reader(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:
        raise GGUFFileError(f"{path}: not a readable GGUF file ({e})") from None
