"""Prompt pieces in a trunk step (`ModelRunner.prefill`, or riding a round's: `ModelRunner.ride`, a
mixed step): a piece of a sequence's prompt (`Piece`), the pieces packed for one step with the buffers
and indices a mixed round's graph reads (`Riding`), and the pad piece that fills a mixed round's pieces
to a bucket of rows and chunks (`Pad`, nextn.engine.rounds._pad_piece). `runner` below is the
nextn.engine.runner.ModelRunner whose buffers they use (not imported: the runner imports this)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from nextn.cache import SlotCache
from nextn.cache.hybrid import reset_ctl, to_device
from nextn.engine.sequence import Sequence


class Piece(NamedTuple):
    """A prefill's tokens for one sequence, after its committed ones; on_logits(start, rows [T, V])
    takes the logits of all its rows (prompt logprobs; row i follows token_ids[start + i]), None:
    only its last row's are made."""

    seq: Sequence
    token_ids: list[int]
    on_logits: Callable[[int, torch.Tensor], None] | None = None


class Riding(NamedTuple):
    """Prompt pieces ready for a trunk step (`ModelRunner.ride`): their slots, row counts and
    tokens packed in order, the rows whose logits are wanted (`wanted`, counted from their first
    row: each piece's last, or all of its rows where it asks), the highest position they reach
    and whether their GDN rows run by the chunked rule."""

    pieces: list[Piece]
    caches: list[SlotCache]
    rows: list[int]
    offsets: list[int]  # each piece's first row, counted from their first
    ids: torch.Tensor  # [their rows] long, on the device
    wanted: list[range]
    top: int
    chunked: bool
    # riding a round (`staged`): its trunk step's (logits, hidden) and `indices`, made before the round
    out: tuple[torch.Tensor, torch.Tensor] | None = None
    index: tuple[torch.Tensor, torch.Tensor] | None = None
    pad: Pad | None = None  # rows after the pieces' that fill their sizes to a bucket (a mixed round's)

    @property
    def all_caches(self) -> list[SlotCache]:
        """The pieces' slots, and the pad's last."""
        return self.caches if self.pad is None else [*self.caches, self.pad.cache]

    @property
    def all_rows(self) -> list[int]:
        return self.rows if self.pad is None else [*self.rows, self.pad.rows]

    @property
    def chunks(self) -> int | None:
        """The pieces' chunks in all with a pad (StepBatch's chunks), else None (their own)."""
        return None if self.pad is None else self.pad.chunks

    def indices(self, runner, verify_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logit rows, kept): the indices of a trunk step's rows whose logits are made (the
        verify_rows rows before the pieces', a round's, all of them, and the pieces' wanted rows),
        and each piece's rows int32 [pieces, 1] for its commit. Riding a round: written into
        buffers held per size (a mixed round's graph, keyed by the pieces' count and total rows,
        reads them whatever their split); a prefill apart: made now."""
        rows = torch.tensor([*range(verify_rows), *(verify_rows + r for w in self.wanted for r in w)])
        kept = torch.tensor(self.rows, dtype=torch.int32)[:, None]
        if verify_rows == 0:
            return to_device(rows, runner.device), to_device(kept, runner.device, torch.int32)
        held = []
        for name, t in (("logit rows", rows), ("kept", kept)):  # (a pageable copy each, queued)
            make = lambda t=t: torch.empty_like(t, device=runner.device)  # noqa: E731
            held.append(runner.held((f"riding {name}", tuple(t.shape)), make).copy_(t, non_blocking=True))
        return held[0], held[1]

    def staged(self, runner, verify_rows: int) -> Riding:
        """These pieces ready to ride a round of verify_rows rows: their ids in a buffer held per row
        count, their trunk step's outputs (`buffers`) in `out` and its indices in `index`, all made
        before the round (a mixed round's graph reads them and writes `out`; `landed` reads that after)."""
        n, rows = self.ids.shape[0], sum(self.all_rows)
        held = runner.held(("riding ids", rows), lambda: self.ids.new_empty(rows))
        held[:n].copy_(self.ids)
        if self.pad is not None:  # its ids 0, its slot an empty sequence (SEQ_LEN 0: its rows in capacity)
            held[n:].fill_(0)
            reset_ctl(self.pad.cache.ctl, self.pad.cache.cols)
        index = self.indices(runner, verify_rows)
        return self._replace(ids=held, out=self.buffers(runner, verify_rows), index=index)

    def buffers(self, runner, verify_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden) of a trunk step of verify_rows rows and then the pieces': the verify
        rows' and the wanted rows' logits [verify_rows + wanted, V] float32, every row's hidden
        [verify_rows + rows, H]. Riding a round: the runner's step rows (which hold them when each
        piece wants its last row alone: pieces asking prompt logprobs prefill apart) and a hidden
        buffer made once per row count (a mixed round's graph writes them, `landed` reads them
        after; the head's catch-up there takes its rows before the next step writes them again)."""
        V, H = runner.cfg.vocab_size, runner.cfg.hidden_size
        wanted, rows = sum(len(w) for w in self.wanted), verify_rows + sum(self.all_rows)
        if verify_rows == 0:
            logits = torch.empty(wanted, V, dtype=torch.float32, device=runner.device)
            return logits, torch.empty(rows, H, dtype=runner.dtype, device=runner.device)
        if wanted > len(self.pieces):
            raise ValueError("prompt pieces that ask for prompt logprobs do not ride a round")
        make = lambda: torch.empty(rows, H, dtype=runner.dtype, device=runner.device)  # noqa: E731
        # (members and pieces hold distinct slots: at most a slot's verify rows each)
        hidden = runner.held(("riding hidden", rows), make)
        return runner.step_logits[: verify_rows + wanted], hidden


class Pad(NamedTuple):
    """A mixed round's pad piece (nextn.engine.rounds.launch): rows after the prompt pieces' so that
    their rows and chunks in all fill a bucket (`StepBatch.sizes`: ragged prompts' mixed rounds then
    share graphs), on a slot no request holds, reset to an empty sequence before the round (its K/V
    rows from position 0, within any slot's capacity; its GDN rows from that slot's half-0 state, which
    no one reads). Its ids are 0; it is never committed, its logits never made, its rows never read:
    every kernel computes a row from its own sequence alone, so it changes no other row's bits."""

    cache: SlotCache
    rows: int
    chunks: int  # the pieces' chunks in all, the pad's own and the empty ones after its rows included
