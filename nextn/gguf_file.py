"""A GGUF file's metadata, parsed once a process, and faster than gguf parses it alone.

gguf's GGUFReader builds numpy views for every metadata entry: Qwen3.5's 248k-token vocabulary is
~7 million of them, 15.7 s on this repository's 2-core CPU, most of it in np.memmap's own
`__getitem__` and `__array_finalize__` (cProfile). The reader here is gguf's with its `data` a plain
ndarray view of the same memory map (the file is still read lazily, its tensors are views of it):
the same fields and tensors (tests/test_gguf.py), parsed in 4.7 s. And the tokenizer
(nextn.tokenizer), the config and the weight loader (nextn.models.gguf) share one reader: the last
two files opened are kept; a file changed since (its mtime or size) is opened again. A leaf module:
the tokenizer may not import the model package (nextn.config imports the tokenizer)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np


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

    class PlainReader(GGUFReader):  # (made here: gguf loads only when a GGUF file is read)
        """GGUFReader whose `data` (the np.memmap its __init__ assigns) is read as a plain ndarray."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):  # (the view keeps the map open: its base)
            self._plain = value.view(np.ndarray)

    try:
        return PlainReader(path)
    except (ValueError, OSError, IndexError) as e:
        raise GGUFFileError(f"{path}: not a readable GGUF file ({e})") from None
