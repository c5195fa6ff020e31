"""A reduced draft vocabulary (FR-Spec, Zhao et al. 2025): the MTP head scores only the Vd most
frequent tokens, so a draft step reads Vd of the lm_head's V rows (32k of Qwen3.5's 248k).

Owns: `DraftVocab`, the draft-index -> target-id map `d2t` (pure data, validated at construction);
`build_draft_vocab` (token frequencies over text files, folders or chat-rendered JSONL); the file
format (`save` / `load_draft_vocab`, with the settings used and a fingerprint of the tokenizer, so
a file made for another tokenizer is refused); and `DraftHead`, the vocabulary on the device (d2t,
its inverse and a contiguous copy of the selected lm_head rows, made once at load).

Exactness does not depend on the subset: the target verifies over the full vocabulary. Greedy
drafts are d2t[argmax over the subset]; a sampled draft's q is its law over the subset scattered
onto the target ids, zero elsewhere, which keeps rejection sampling exact in law (see
nextn.sample.verifier). Penalties read the target history projected onto the subset: a penalty is
elementwise per token id, so the subset's penalized logits are the full row's restricted to it.
d2t is kept ascending, so ties in the subset's argmax go to the lowest target id, as in the full
head's: wherever the full head's pick is in the subset, the reduced head picks the same token.

Grammar masks (nextn has no grammars yet): a mask over target ids projects onto the draft rows
as mask[d2t] before the draft's argmax or softmax (the reference design's `d2t` mask remap).
Does not know the engine loop, the runner or the proposer's buffers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from nextn.ops.fp8 import QuantWeight, select_rows
from nextn.sample.pipeline import TokenHistory
from nextn.sample.verifier import draft_probs_on_target_vocab
from nextn.tokenizer import Tokenizer

FORMAT, VERSION = "nextn-draft-vocab", 1
log = logging.getLogger(__name__)


class DraftVocabError(ValueError):
    """A draft vocabulary that cannot serve this model: malformed, empty, out of range, or made for
    another tokenizer."""


@dataclass(frozen=True)
class DraftVocab:
    d2t: tuple[int, ...] = field(repr=False)  # [Vd] target id of each draft row, distinct, stored ascending
    tokenizer_sha256: str | None = None  # the tokenizer it was counted with (None: ids alone, e.g. bench's)
    settings: dict = field(default_factory=dict, compare=False)  # how it was made (saved with it)

    def __post_init__(self):
        ids = self.d2t
        if not ids:
            raise DraftVocabError("the draft vocabulary is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise DraftVocabError("draft vocabulary ids must be integers")
        if min(ids) < 0:
            raise DraftVocabError(f"draft vocabulary ids must be >= 0, got {min(ids)}")
        if len(set(ids)) != len(ids):
            repeated = sorted(t for t, n in Counter(ids).items() if n > 1)
            raise DraftVocabError(f"draft vocabulary ids appear more than once: {repeated[:5]}")
        object.__setattr__(self, "d2t", tuple(sorted(ids)))

    @property
    def size(self) -> int:
        return len(self.d2t)

    @classmethod
    def first(cls, size: int, vocab_size: int) -> DraftVocab:
        """The first `size` ids (random-weight benchmarks, where no token is more frequent)."""
        if not 0 < size <= vocab_size:
            raise DraftVocabError(f"a draft vocabulary size must be in 1..{vocab_size}, got {size}")
        return cls(tuple(range(size)), settings={"source": "first ids", "size": size})

    def check(self, vocab_size: int, tokenizer: Tokenizer | None = None) -> None:
        """Refuse ids past the model's vocabulary and a file counted with another tokenizer."""
        bad = [t for t in self.d2t if t >= vocab_size]
        if bad:
            raise DraftVocabError(f"draft vocabulary ids out of range [0, {vocab_size}): {bad[:5]}")
        if tokenizer is not None and self.tokenizer_sha256 is not None:
            ours = tokenizer_fingerprint(tokenizer)
            if ours != self.tokenizer_sha256:
                raise DraftVocabError(
                    f"made for another tokenizer (vocabulary sha256 {self.tokenizer_sha256[:12]}..., this "
                    f"checkpoint's {ours[:12]}...); build one for this model with `nextn draft-vocab`"
                )

    def save(self, path: str | Path) -> None:
        header = {
            "format": FORMAT,
            "version": VERSION,
            "size": self.size,
            "tokenizer_sha256": self.tokenizer_sha256,
            "settings": self.settings,
        }
        # the settings readable, the ids on one line
        text = json.dumps(header, indent=1)[:-2] + ',\n "d2t": ' + json.dumps(list(self.d2t)) + "\n}\n"
        Path(path).write_text(text)


def load_draft_vocab(path: str | Path, vocab_size: int, tokenizer: Tokenizer) -> DraftVocab:
    """A saved draft vocabulary, checked against the model's vocabulary size and tokenizer (a file
    carries the fingerprint of the tokenizer it was counted with)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DraftVocabError(f"{path}: not a draft vocabulary file (not JSON: {e})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise DraftVocabError(f'{path}: not a draft vocabulary file (no "format": "{FORMAT}")')
    if raw.get("version") != VERSION:
        raise DraftVocabError(f"{path}: draft vocabulary version {raw.get('version')!r}; this nextn reads {VERSION}")
    if not isinstance(raw.get("d2t"), list) or not isinstance(raw.get("tokenizer_sha256"), str):
        raise DraftVocabError(f"{path}: a draft vocabulary file holds a d2t list and its tokenizer_sha256")
    try:
        vocab = DraftVocab(tuple(raw["d2t"]), raw["tokenizer_sha256"], raw.get("settings") or {})
        vocab.check(vocab_size, tokenizer)
    except DraftVocabError as e:
        raise DraftVocabError(f"{path}: {e}") from None
    return vocab


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's id -> token table (what the ids of a draft vocabulary mean)."""
    table = "\n".join(tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size))
    return hashlib.sha256(table.encode("utf-8", "surrogatepass")).hexdigest()


# ---------------------------------------------------------------------------------------------
# building from a corpus


def corpus_files(sources: Iterable[str | Path], glob: str = "*") -> list[Path]:
    """The files of `sources` (files as given, folders walked for names matching glob, hidden
    folders skipped), in a deterministic order."""
    files = []
    for source in sources:
        path = Path(source)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob(glob) if p.is_file() and not _hidden(p.relative_to(path)))
            if not found:
                log.warning("no files matching %r under %s", glob, path)
            files.extend(found)
        else:
            raise FileNotFoundError(f"{path}: no such file or folder")
    if not files:
        raise FileNotFoundError(f"no files matching {glob!r} in {[str(s) for s in sources]}")
    return files


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts[:-1])


def corpus_texts(files: list[Path], tokenizer: Tokenizer, progress: bool = True) -> Iterator[str]:
    """Texts of the corpus: a file's contents (files that are not UTF-8 skipped), or for a .jsonl
    file each line's record: {"messages": [...]} (with "tools") rendered with the checkpoint's chat
    template, or {"text": ...}. A progress bar counts the bytes read."""
    from tqdm import tqdm

    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="draft-vocab", disable=not progress) as bar:
        for f in files:
            if f.suffix == ".jsonl":
                with f.open("rb") as lines:
                    for number, line in enumerate(lines, 1):
                        bar.update(len(line))
                        if line.strip():
                            yield _record_text(line, f, number, tokenizer)
                continue
            raw = f.read_bytes()
            bar.update(len(raw))
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                continue


def _record_text(line: bytes, path: Path, number: int, tokenizer: Tokenizer) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DraftVocabError(f"{path}:{number}: not JSON ({e})") from None
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        kwargs = {"tools": record["tools"]} if record.get("tools") is not None else {}
        return tokenizer.apply_chat_template(record["messages"], add_generation_prompt=False, **kwargs)
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    raise DraftVocabError(f'{path}:{number}: a JSONL record holds "messages" (a chat) or "text"')


def build_draft_vocab(
    tokenizer: Tokenizer,
    sources: list[str | Path],
    size: int,
    vocab_size: int,
    glob: str = "*",
    always: Iterable[int] = (),
    settings: dict | None = None,
) -> DraftVocab:
    """The `size` most frequent tokens of the corpus (ties to the lower id), `always` among them
    (EOS ids: a draft that can end a reply). Where the corpus has fewer distinct tokens, the
    lowest unseen ids fill the rest. settings: recorded with the counts (e.g. the model). A
    progress bar counts the corpus' bytes read."""
    always = sorted(set(always))
    if not 0 < size <= vocab_size or len(always) > size:
        raise DraftVocabError(f"a draft vocabulary size must be in {max(1, len(always))}..{vocab_size}, got {size}")
    files = corpus_files(sources, glob)
    counts = np.zeros(max(vocab_size, tokenizer.vocab_size), dtype=np.int64)
    pending: list[int] = []  # ids counted a few million at a time

    def count() -> None:
        counts[:] += np.bincount(np.asarray(pending, dtype=np.int64), minlength=counts.size)
        pending.clear()

    num_texts = 0
    for text in corpus_texts(files, tokenizer):
        pending += tokenizer.encode(text)
        num_texts += 1
        if len(pending) >= 1 << 22:
            count()
    count()
    if counts[vocab_size:].any():
        raise DraftVocabError(f"the tokenizer produces ids past the model's vocabulary of {vocab_size}")
    total = int(counts.sum())
    if total == 0:
        raise DraftVocabError(f"no tokens in {[str(s) for s in sources]}")
    ranked = counts[:vocab_size].copy()
    ranked[always] = -1  # placed first, below
    order = np.lexsort((np.arange(vocab_size), -ranked))  # most frequent first, ties to the lower id
    d2t = always + [int(t) for t in order[: size - len(always)]]
    recorded = {
        "sources": [str(s) for s in sources],
        "glob": glob,
        "size": size,
        "files": len(files),
        "texts": num_texts,
        "tokens": total,
        "distinct_tokens": int((counts > 0).sum()),
        "coverage": float(counts[d2t].sum()) / total,  # the corpus' tokens the subset holds
        "always_included": always,
        "target_vocab_size": vocab_size,
        **(settings or {}),
    }
    return DraftVocab(tuple(d2t), tokenizer_fingerprint(tokenizer), recorded)


# ---------------------------------------------------------------------------------------------
# on the device


class DraftHead:
    """A draft vocabulary on the lm_head's device: d2t [Vd], its inverse t2d [V] (-1 off the
    subset) and `lm_head` [Vd, H], a contiguous copy of the selected rows made once (the step
    backends' MTP head reads it instead of the full lm_head)."""

    def __init__(self, vocab: DraftVocab, lm_head: torch.Tensor | QuantWeight):
        V, device = lm_head.shape[0], lm_head.device
        vocab.check(V)
        self.vocab, self.vocab_size, self.size = vocab, V, vocab.size
        self.d2t = torch.tensor(vocab.d2t, dtype=torch.long, device=device)  # [Vd]
        self.t2d = torch.full((V,), -1, dtype=torch.long, device=device)  # [V]
        self.t2d[self.d2t] = torch.arange(vocab.size, device=device)
        self.lm_head = select_rows(lm_head, self.d2t)  # [Vd, H] (Q8_0 rows with their scales)

    def to_target(self, draft_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Draft rows [N] -> target ids [N] (into out)."""
        return torch.index_select(self.d2t, 0, draft_ids.reshape(-1), out=out)

    def project(
        self, history: TokenHistory | None, target_ids: torch.Tensor
    ) -> tuple[TokenHistory | None, torch.Tensor]:
        """The penalty history over the subset and target_ids [M] (drafts so far: in the subset by
        construction) as draft rows."""
        if history is None:  # no penalty reads either
            return None, target_ids
        subset = TokenHistory(history.prompt_mask[self.d2t], history.output_counts[self.d2t])
        return subset, self.t2d[target_ids.long()]

    def scatter(self, probs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """q over the subset [N, Vd] -> q over target ids [N, V] (zero off the subset) into out."""
        return draft_probs_on_target_vocab(probs, self.d2t, self.vocab_size, out=out)
