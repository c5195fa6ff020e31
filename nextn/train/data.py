"""Training data: walk folders of text files, split them into train and held-out sets by a hash of
each file's path (deterministic on any machine with the same layout), tokenise them (the
`tokenizers` library runs a batch on all cores), join documents with <|endoftext|> and pack the
stream into fixed-length sequences visited in a seeded random order.

Does not know models: it hands out integer arrays.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SourceFile:
    path: Path
    key: str  # path relative to its root: what the split hashes


def find_files(roots: list[str], suffixes: tuple[str, ...], max_file_bytes: int) -> list[SourceFile]:
    """Every file under `roots` whose name ends in one of `suffixes`, smaller than max_file_bytes,
    in a deterministic order. Roots that do not exist are an error."""
    files = []
    for root in roots:
        root_path = Path(root)
        if not root_path.is_dir():
            raise FileNotFoundError(f"data folder {root} does not exist")
        for path in sorted(root_path.rglob("*")):
            if path.name.endswith(suffixes) and path.is_file() and path.stat().st_size < max_file_bytes:
                files.append(SourceFile(path, path.relative_to(root_path).as_posix()))
    if not files:
        raise FileNotFoundError(f"no *{'|*'.join(suffixes)} files under {roots}")
    return files


def is_heldout(key: str, heldout_percent: float) -> bool:
    digest = int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "little")
    return digest % 10_000 < heldout_percent * 100


def split_files(files: list[SourceFile], heldout_percent: float, seed: int):
    """-> (train, heldout), each shuffled by `seed` so a token cap takes a sample of the whole."""
    train = [f for f in files if not is_heldout(f.key, heldout_percent)]
    heldout = [f for f in files if is_heldout(f.key, heldout_percent)]
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(heldout)
    return train, heldout


def _decode(raw: bytes) -> str | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def read_texts(files: list[SourceFile]) -> Iterator[str]:
    """File contents, skipping files that are not UTF-8 and exact duplicates of an earlier file."""
    seen = set()
    for f in files:
        raw = f.path.read_bytes()
        digest = hashlib.sha1(raw).digest()
        text = _decode(raw)
        if digest not in seen and text is not None:
            seen.add(digest)
            yield text


def sample_texts(files: list[SourceFile], max_bytes: int) -> list[str]:
    """The first texts of `files` up to about max_bytes: the tokenizer's training sample."""
    texts, size = [], 0
    for text in read_texts(files):
        texts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return texts


_worker = {}


def _init_worker(tokenizer_json: str, eot_id: int, dtype) -> None:
    from tokenizers import Tokenizer

    _worker.update(tok=Tokenizer.from_str(tokenizer_json), eot_id=eot_id, dtype=dtype)


def _encode_files(paths: list[Path]) -> list[tuple[bytes, np.ndarray]]:
    """(content digest, token ids + <|endoftext|>) of each decodable file: runs in a worker."""
    out = []
    for path in paths:
        raw = path.read_bytes()
        text = _decode(raw)
        if text is not None:
            ids = _worker["tok"].encode(text, add_special_tokens=False).ids
            ids.append(_worker["eot_id"])
            out.append((hashlib.sha1(raw).digest(), np.asarray(ids, dtype=_worker["dtype"])))
    return out


def tokenize_stream(
    tok,
    files: list[SourceFile],
    eot_id: int,
    max_tokens: int,
    workers: int,
    max_seconds: float | None = None,
    files_per_task: int = 64,
) -> np.ndarray:
    """Token ids of the files' texts in order, each followed by <|endoftext|>, exact duplicates
    dropped, up to max_tokens (and, if given, what max_seconds of tokenising yields); uint16
    (uint32 past 65,536 tokens). workers 0: the library's own threads in this process; 1: this
    process alone; more: that many worker processes."""
    dtype = np.uint16 if tok.get_vocab_size() <= 65_536 else np.uint32
    per_task = files_per_task if workers else 8 * files_per_task  # big batches keep the threads busy
    tasks = [[f.path for f in files[i : i + per_task]] for i in range(0, len(files), per_task)]
    deadline = time.monotonic() + max_seconds if max_seconds else None
    init_args = (tok.to_str(), eot_id, dtype)
    if workers == 0:
        _init_worker(*init_args)
        stream = _collect(map(_encode_files_batched, tasks), max_tokens, dtype, deadline)
    elif workers == 1:
        _init_worker(*init_args)
        stream = _collect(map(_encode_files, tasks), max_tokens, dtype, deadline)
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork after the tokenizer's threads ran
        with ctx.Pool(workers, initializer=_init_worker, initargs=init_args) as pool:
            stream = _collect(pool.imap(_encode_files, tasks), max_tokens, dtype, deadline)
    return stream[:max_tokens]


def _encode_files_batched(paths: list[Path]) -> list[tuple[bytes, np.ndarray]]:
    """_encode_files with one batch call: the tokenizer spreads it over its threads."""
    raws = [path.read_bytes() for path in paths]
    kept = [(raw, text) for raw in raws if (text := _decode(raw)) is not None]
    encodings = _worker["tok"].encode_batch_fast([text for _, text in kept], add_special_tokens=False)
    eot, dtype = _worker["eot_id"], _worker["dtype"]
    return [
        (hashlib.sha1(raw).digest(), np.asarray(enc.ids + [eot], dtype=dtype))
        for (raw, _), enc in zip(kept, encodings, strict=True)
    ]


def _collect(encoded_tasks, max_tokens: int, dtype, deadline: float | None) -> np.ndarray:
    """Concatenate task results in order, dropping repeated contents, until max_tokens or the deadline."""
    parts, total, seen = [], 0, set()
    for encoded in encoded_tasks:
        for digest, ids in encoded:
            if digest not in seen:
                seen.add(digest)
                parts.append(ids)
                total += len(ids)
        if total >= max_tokens or (deadline is not None and time.monotonic() > deadline):
            break
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut the stream into rows of seq_len + 1 tokens (inputs and their next-token targets)."""
    n = len(stream) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"{len(stream)} tokens are too few for one sequence of {seq_len + 1}")
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


class SequenceOrder:
    """Rows of a packed array in a seeded random order, epoch after epoch. `position` (rows handed
    out so far) is the whole resumable state."""

    def __init__(self, num_rows: int, seed: int, position: int = 0):
        self.num_rows, self.seed, self.position = num_rows, seed, position
        self._epoch, self._perm = -1, None

    def _row(self, k: int) -> int:
        epoch = k // self.num_rows
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng(self.seed + epoch).permutation(self.num_rows)
        return int(self._perm[k % self.num_rows])

    def next_rows(self, batch_size: int) -> np.ndarray:
        rows = np.array([self._row(k) for k in range(self.position, self.position + batch_size)])
        self.position += batch_size
        return rows

    @property
    def epochs(self) -> float:
        return self.position / self.num_rows


@dataclass(frozen=True)
class DataSettings:
    roots: tuple[str, ...]
    suffixes: tuple[str, ...] = (".py",)
    heldout_percent: float = 2.0
    max_file_bytes: int = 1 << 20
    max_train_tokens: int = 400_000_000
    max_heldout_tokens: int = 1_000_000
    max_prep_seconds: float | None = None  # stop tokenising the train split after this long
    seed: int = 0
    workers: int = 0  # 0: the tokenizer's own threads; N: N processes


def prepare(tok, settings: DataSettings, eot_id: int, out_dir: Path) -> dict:
    """Tokenise train and held-out streams into out_dir/{train,heldout}.npy; returns the summary
    also written to out_dir/meta.json."""
    files = find_files(list(settings.roots), settings.suffixes, settings.max_file_bytes)
    train_files, heldout_files = split_files(files, settings.heldout_percent, settings.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "roots": list(settings.roots),
        "files": len(files),
        "train_files": len(train_files),
        "heldout_files": len(heldout_files),
    }
    # held-out first: a time limit applies to the train split only
    for name, subset, cap, seconds in (
        ("heldout", heldout_files, settings.max_heldout_tokens, None),
        ("train", train_files, settings.max_train_tokens, settings.max_prep_seconds),
    ):
        t0 = time.monotonic()
        stream = tokenize_stream(tok, subset, eot_id, cap, settings.workers, seconds)
        np.save(out_dir / f"{name}.npy", stream)
        meta[f"{name}_tokens"] = int(len(stream))
        meta[f"{name}_tokens_per_s"] = round(len(stream) / max(1e-9, time.monotonic() - t0))
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_stream(data_dir: Path, name: str) -> np.ndarray:
    return np.load(data_dir / f"{name}.npy")
