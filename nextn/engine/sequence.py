"""A sequence slot's host-side record between rounds and across turns: the committed tokens, the
trunk's last hidden and logits, the MTP rows still to be written to the draft K/V, and a
prompt-end checkpoint. The device side (caches, counters) lives in the slot's cache buffers.

Invariants (N = len(tokens), the committed tokens the slot's cache holds):
- `last_hidden` is the head-input hidden of token N-1 and `last_logits` the trunk logits after it;
- MTP rows 1..N-1 exist: rows 1..draft_len sit in the draft K/V, the rest are `pending_ids` with
  `pending_hidden` (row p pairs token p with hidden p-1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Checkpoint:
    """Where a later request that rewrote what followed can resume (GDN states: the slot's
    checkpoint buffers; K/V need nothing: truncation restores them)."""

    num_tokens: int
    last_hidden: torch.Tensor
    last_logits: torch.Tensor
    draft_len: int
    pending_ids: list[int]
    pending_hidden: torch.Tensor | None


@dataclass
class Sequence:
    slot: int
    heads: bool  # the engine drafts: MTP rows are kept
    tokens: list[int] = field(default_factory=list)
    last_hidden: torch.Tensor | None = None  # [H]
    last_logits: torch.Tensor | None = None  # [V] float32
    draft_len: int = 0
    pending_ids: list[int] = field(default_factory=list)
    pending_hidden: torch.Tensor | None = None  # [n, H]
    checkpoint: Checkpoint | None = None

    def commit(self, token_ids: list[int], hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Record tokens the cache now holds. hidden [T, H]: their head-input hiddens; logits [V]:
        the trunk logits after the last. Queues their MTP rows (token p with hidden p-1)."""
        first = len(self.tokens)
        before = self.last_hidden
        self.tokens.extend(token_ids)
        self.last_hidden, self.last_logits = hidden[-1].clone(), logits  # (not a view holding the step's rows)
        if not self.heads:
            return
        pred = hidden[:-1] if before is None else torch.cat([before[None], hidden[:-1]])
        if first == 0:  # row 0 has no predecessor
            token_ids = token_ids[1:]
        self.queue_rows(token_ids, pred)

    def queue_rows(self, ids: list[int], hidden: torch.Tensor) -> None:
        if not ids:
            return
        self.pending_ids.extend(ids)
        rows = hidden[: len(ids)]
        self.pending_hidden = rows if self.pending_hidden is None else torch.cat([self.pending_hidden, rows])

    def take_rows(self) -> tuple[list[int], torch.Tensor | None]:
        ids, hidden = self.pending_ids, self.pending_hidden
        self.pending_ids, self.pending_hidden = [], None
        return ids, hidden

    def make_checkpoint(self) -> None:
        self.checkpoint = Checkpoint(
            len(self.tokens),
            self.last_hidden.clone(),
            self.last_logits.clone(),
            self.draft_len,
            list(self.pending_ids),
            None if self.pending_hidden is None else self.pending_hidden.clone(),
        )

    def rewind_to_checkpoint(self) -> None:
        """Host side of a rewind (the runner restores the device side)."""
        c = self.checkpoint
        del self.tokens[c.num_tokens :]
        self.last_hidden, self.last_logits = c.last_hidden.clone(), c.last_logits.clone()
        # draft K/V is position-addressed and only grew past the checkpoint: its rows stand
        self.draft_len = c.draft_len
        self.pending_ids = list(c.pending_ids)
        self.pending_hidden = None if c.pending_hidden is None else c.pending_hidden.clone()
