"""A sequence's device state between rounds and across turns: the trunk cache, the MTP head's
draft K/V with the rows still waiting to be written there, and a prompt-end checkpoint.

Invariants (N = len(tokens), the committed tokens the trunk cache holds):
- `last_hidden` is the head-input hidden of token N-1 and `last_logits` the trunk logits after it.
- MTP rows 1..N-1 exist: rows 1..draft_len sit in the draft K/V (slot p-1 holds row p), the rest
  are `pending_row_ids` / `pending_row_hidden` (row p = token p with hidden p-1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nextn.cache import CacheSnapshot, HybridCache, LayerKV


@dataclass
class Checkpoint:
    """State at a prompt end, kept so a later request that rewrote what followed can resume here."""

    num_tokens: int
    cache: CacheSnapshot
    last_hidden: torch.Tensor
    last_logits: torch.Tensor
    draft_len: int
    pending_row_ids: list[int]
    pending_row_hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        extra = (self.last_hidden, self.last_logits, self.pending_row_hidden)
        return self.cache.nbytes + sum(t.numel() * t.element_size() for t in extra)


@dataclass
class SeqState:
    cache: HybridCache
    draft_kv: LayerKV | None  # the MTP layer's K/V (None without a head)
    hidden_size: int
    tokens: list[int] = field(default_factory=list)
    last_hidden: torch.Tensor | None = None  # [H]
    last_logits: torch.Tensor | None = None  # [V] float32
    draft_len: int = 0
    pending_row_ids: list[int] = field(default_factory=list)
    pending_row_hidden: torch.Tensor | None = None  # [n, H]
    checkpoint: Checkpoint | None = None

    def __post_init__(self):
        if self.pending_row_hidden is None:
            self.pending_row_hidden = self.cache_device_zeros(0)

    def cache_device_zeros(self, n: int) -> torch.Tensor:
        any_kv = next(iter(self.cache.kv.values()))
        return torch.zeros(n, self.hidden_size, device=any_kv.key.device, dtype=any_kv.key.dtype)

    @property
    def next_row(self) -> int:
        """Position of the first MTP row neither in the draft K/V nor pending."""
        return self.draft_len + len(self.pending_row_ids) + 1

    def commit(self, token_ids: list[int], hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Record tokens the cache now holds (their trunk forward already ran).

        hidden [T, H]: head-input hiddens of these tokens; logits [V]: trunk logits after the last.
        Queues their MTP rows (token p with hidden p-1), skipping rows a draft pass already wrote.
        """
        first = len(self.tokens)
        last_hidden = self.last_hidden
        self.tokens.extend(token_ids)
        self.last_hidden, self.last_logits = hidden[-1], logits
        if self.draft_kv is None:
            return
        pred_hidden = hidden[:-1] if last_hidden is None else torch.cat([last_hidden[None], hidden[:-1]])
        row_pos = range(first if first > 0 else 1, first + len(token_ids))
        offset = 0 if first > 0 else 1  # row 0 has no predecessor
        skip = max(0, self.next_row - row_pos.start)
        ids = token_ids[offset + skip :]
        rows = pred_hidden[skip:]
        assert len(ids) == rows.shape[0]
        self.pending_row_ids.extend(ids)
        self.pending_row_hidden = torch.cat([self.pending_row_hidden, rows.to(self.pending_row_hidden.dtype)])

    def take_rows(self) -> tuple[list[int], torch.Tensor]:
        ids, hidden = self.pending_row_ids, self.pending_row_hidden
        self.pending_row_ids, self.pending_row_hidden = [], self.cache_device_zeros(0)
        return ids, hidden

    def make_checkpoint(self) -> None:
        self.checkpoint = Checkpoint(
            len(self.tokens), self.cache.snapshot(), self.last_hidden.clone(), self.last_logits.clone(),
            self.draft_len, list(self.pending_row_ids), self.pending_row_hidden.clone(),
        )

    def rewind_to_checkpoint(self) -> None:
        c = self.checkpoint
        self.cache.restore(c.cache)
        del self.tokens[c.num_tokens :]
        self.last_hidden, self.last_logits = c.last_hidden.clone(), c.last_logits.clone()
        # draft K/V is position-addressed and only grows past the checkpoint: truncating restores it
        self.draft_len = c.draft_len
        self.pending_row_ids = list(c.pending_row_ids)
        self.pending_row_hidden = c.pending_row_hidden.clone()

    @property
    def nbytes(self) -> int:
        n = self.cache.nbytes
        if self.draft_kv is not None:
            n += 2 * self.draft_kv.key.numel() * self.draft_kv.key.element_size()
        return n + (self.checkpoint.nbytes if self.checkpoint else 0)
