"""The caches of every sequence slot in one allocation made up front, one layout for the reference
modules and the Triton step, and the rule that commits a step.

Per slot: attention K/V per full-attention layer (position-addressed, append-only); per Gated
DeltaNet layer step buffers in two halves (the conv window with a step's inputs, one base state,
the gates b and a of the step's rows), which every step and chunked prefill write; a prompt-end
checkpoint of the GDN states; the MTP head's draft K/V; the
engine's own per-slot buffers (named in `CacheLayout.extra`); and `ctl`, the slot's counters on
the device:

  SEQ_LEN      committed tokens: the next step's row 0 sits at this position
  STATE_AT     half holding the base recurrent state (0 or 1)
  STATE_WRITE  half the next step writes (the other one)
  CONV_AT      window column where the committed conv columns start
  CONV_WRITE   first window column the next step writes (0 or WC)
  DRAFT_LEN    MTP rows written with true hiddens (rows 1..DRAFT_LEN sit in draft slots 0..DRAFT_LEN-1)
  NUM_GEN      tokens the running request has emitted (the index of its next uniform)
  ACCEPTED     drafts the last round accepted
  PENDING      committed rows the base state does not hold yet (the last verify's kept rows)

The committed recurrent state is the base state advanced by the PENDING rows, whose inputs are in
the window (columns CONV_AT - PENDING ..) and whose gates are in the base's half. A verify keeps
no per-row states: each step first folds the pending rows into the base (the same per-row code as
its own rows, so the same bits), stores that in the half it writes, then runs its rows; keeping
`kept` of them makes them pending. A row's state is thus computed twice, but a slot holds two
states a layer instead of 2 (K+1), and a step writes one state instead of K+1 (the 9B shape at
K=3: 96 MiB a sequence instead of 384). An empty sequence is zeros in half 0.

With `kv_cache_dtype="fp8"` the full-attention layers' K/V are e4m3, each row of D values (a
position's kv head) with a float32 scale beside it (`key_scale.{i}`, nextn.ops.fp8.quantize_rows);
the MTP head's draft K/V stay in the model dtype (fp8 draft K/V cost acceptance). A row's bytes
depend on that row alone, so moving positions (commits, rewinds) needs nothing more.

A step never writes where the committed state lives, so a step that is not kept needs no undo, and
`commit_ctl` keeps tokens by moving the pointers: nothing is copied. Owns the tensors and that
rule; does not know models, tokens or sampling.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nextn.config import FULL, GDN_CHUNK, STEP_ROWS
from nextn.config.model import ModelConfig
from nextn.ops.fp8 import E4M3


def to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list (or CPU tensor) on the device without waiting for it: `torch.tensor(values,
    device=cuda)` copies and then synchronises the stream, so the host would wait for every launch
    queued ahead (a prefill step's trunk, the rounds in flight) before it could queue the next; a
    non-blocking copy from pageable memory is staged at once and runs in stream order."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.to(device=device, dtype=dtype, non_blocking=True)


KV_BLOCK = 64  # K/V storage is allocated in whole blocks (the step attention reads whole blocks)
SEQ_LEN, STATE_AT, STATE_WRITE, CONV_AT, CONV_WRITE, DRAFT_LEN, NUM_GEN, ACCEPTED, PENDING = range(9)
NUM_CTL = 9


@dataclass(frozen=True)
class CacheLayout:
    num_slots: int
    max_len: int  # tokens a sequence may commit
    step_states: int  # R: rows a kept step may leave pending (the longest verify)
    draft: bool  # the MTP head's draft K/V
    extra: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()  # engine buffers, per slot
    kv_cache_dtype: str = "auto"  # "fp8": the attention layers' K/V in e4m3 with per-row scales
    scratch: int = 0  # of num_slots, the last ones no request holds (nextn.config.SCRATCH_SLOTS)

    @property
    def sequences(self) -> int:
        """The slots requests may hold."""
        return self.num_slots - self.scratch

    @property
    def capacity(self) -> int:
        """K/V positions per slot: a round queued ahead, and head rows past the committed ones,
        write up to 2 * STEP_ROWS positions beyond max_len."""
        return -(-(self.max_len + 2 * STEP_ROWS) // KV_BLOCK) * KV_BLOCK


class KV(NamedTuple):
    """One attention layer's K/V: every slot's [S, capacity, Hkv, D], or one slot's [capacity, Hkv, D].
    fp8: key / value are e4m3 and each row's value is e4m3 * its scale [S, capacity, Hkv] /
    [capacity, Hkv] float32 (nextn.ops.fp8.quantize_rows); otherwise the scales are None."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None


def window_cols(cfg: ModelConfig) -> int:
    """WC: columns of one half of a step's conv window (the carried columns, then the inputs)."""
    return cfg.linear_conv_kernel_dim - 1 + STEP_ROWS


def tensor_specs(cfg: ModelConfig, layout: CacheLayout, dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
    """Name -> (shape, dtype) of every tensor the cache holds, slot first."""
    S, cap, f32 = layout.num_slots, layout.capacity, torch.float32
    kv = (S, cap, cfg.num_key_value_heads, cfg.head_dim)
    fp8 = layout.kv_cache_dtype == "fp8"
    n = sum(t != FULL for t in cfg.layer_types)
    ckpt_conv = (S, n, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1 + layout.step_states)
    state = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    specs = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == FULL:
            specs[f"key.{i}"] = specs[f"value.{i}"] = (kv, E4M3 if fp8 else dtype)
            if fp8:
                specs[f"key_scale.{i}"] = specs[f"value_scale.{i}"] = (kv[:3], f32)  # a scale per row of D
    specs.update(
        {
            "window": ((S, n, cfg.conv_dim, 2 * window_cols(cfg)), dtype),
            "states": ((S, n, 2, *state), f32),
            "gates": ((S, n, 2 * layout.step_states, 2 * cfg.linear_num_value_heads), dtype),
            "ckpt_conv": (ckpt_conv, dtype),
            "ckpt_recurrent": ((S, n, *state), f32),
            "ckpt_gates": ((S, n, layout.step_states, 2 * cfg.linear_num_value_heads), dtype),
            "ckpt_pending": ((S,), torch.int32),
            "ctl": ((S, NUM_CTL), torch.int32),
        }
    )
    if layout.draft:
        specs["draft_key"] = specs["draft_value"] = (kv, dtype)
    for name, shape, extra_dtype in layout.extra:
        specs[name] = ((S, *shape), extra_dtype)
    return specs


def nbytes_of(specs: dict[str, tuple[tuple, torch.dtype]]) -> int:
    total = 0
    for shape, dtype in specs.values():
        numel = 1
        for d in shape:
            numel *= d
        total += numel * dtype.itemsize
    return total


class HybridCache:
    def __init__(self, cfg: ModelConfig, layout: CacheLayout, device, dtype: torch.dtype):
        self.cfg, self.layout = cfg, layout
        self.tensors = {
            name: torch.zeros(shape, device=device, dtype=dt)
            for name, (shape, dt) in tensor_specs(cfg, layout, dtype).items()
        }
        self.ctl = self.tensors["ctl"]
        reset_ctl(self.ctl, window_cols(cfg))
        # decoder layer index -> its index among the GDN layers (their stacked buffers)
        self.gdn_index = {i: j for j, i in enumerate(i for i, t in enumerate(cfg.layer_types) if t != FULL)}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def kv(self, layer_idx: int) -> KV:
        """Every slot's K/V of a decoder layer (with their scales in an fp8 cache)."""
        return KV(*(self.tensors.get(f"{name}.{layer_idx}") for name in KV._fields))

    def draft_kv(self) -> KV:
        """Every slot's MTP head K/V (the model dtype whatever kv_cache_dtype)."""
        return KV(self.tensors["draft_key"], self.tensors["draft_value"])

    def slot(self, slot: int) -> SlotCache:
        return SlotCache(self, slot)


def reset_ctl(ctl: torch.Tensor, cols: int) -> None:
    """An empty sequence: nothing committed, its (zero) states in half 0, the next step writing half 1."""
    ctl.zero_()
    ctl[..., STATE_WRITE].fill_(1)  # (fills: a host scalar set into a device tensor waits for the stream)
    ctl[..., CONV_WRITE].fill_(cols)


class GDNParts(NamedTuple):
    """One slot's committed GDN state of a layer, as stored: the conv columns after the committed
    tokens [D, W-1], the base recurrent state [HV, K, V], and where rows are pending (the base does
    not hold them yet) their window columns [D, W-1+P] (carried, then the P rows' inputs) and gates
    [P, 2*HV] (b, then a); else None twice."""

    conv: torch.Tensor
    base: torch.Tensor
    rows: torch.Tensor | None = None
    gates: torch.Tensor | None = None


class SlotCache:
    """One sequence slot's view of the cache: what the reference modules and the step read."""

    def __init__(self, cache: HybridCache, slot: int):
        self.cache, self.slot, self.cfg = cache, slot, cache.cfg
        self.max_len = cache.layout.max_len
        self.ctl = cache.ctl[slot]  # [NUM_CTL]
        self.rows = cache.layout.step_states
        self.cols = window_cols(cache.cfg)

    def t(self, name: str) -> torch.Tensor:
        """The slot's part of a cache tensor."""
        return self.cache.tensors[name][self.slot]

    def kv(self, layer_idx: int) -> KV:
        """Attention K/V of a decoder layer [capacity, Hkv, D] (scales [capacity, Hkv] in an fp8 cache)."""
        return self._own(self.cache.kv(layer_idx))

    def draft_kv(self) -> KV:
        return self._own(self.cache.draft_kv())

    def _own(self, kv: KV) -> KV:
        return KV(*(None if t is None else t[self.slot] for t in kv))

    # --- the host's reading of ctl (the reference path and prefill; a device sync on CUDA)

    def get(self, field: int) -> int:
        return int(self.ctl[field])

    @property
    def seq_len(self) -> int:
        return self.get(SEQ_LEN)

    def gdn_parts(self, layer_idx: int) -> GDNParts:
        """What the committed GDN state of a layer is made of (views): see `GDNParts`."""
        j, W = self.cache.gdn_index[layer_idx], self.cfg.linear_conv_kernel_dim
        conv_at, state_at, p = self.get(CONV_AT), self.get(STATE_AT), self.get(PENDING)
        base, window, R = self.t("states")[j][state_at], self.t("window")[j], self.rows
        conv = window[:, conv_at : conv_at + W - 1]
        if not p:
            return GDNParts(conv, base)
        return GDNParts(conv, base, window[:, conv_at - p : conv_at + W - 1], self.t("gates")[j][state_at * R :][:p])

    def committed_gdn(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv columns [D, W-1], recurrent state [HV, K, V]) after the committed tokens, where no
        rows are pending (after a prefill, a reset or a fold); else the layer's fold computes it
        (nextn.layers.gdn.GatedDeltaNet.committed)."""
        parts = self.gdn_parts(layer_idx)
        if parts.gates is not None:
            raise ValueError(
                f"slot {self.slot}: {len(parts.gates)} rows are pending in GDN layer {layer_idx}: "
                "the committed state needs the layer's fold (GatedDeltaNet.committed)"
            )
        return parts.conv, parts.base

    def committed_gdn_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of every GDN layer's committed conv columns [G, D, W-1] and recurrent state
        [G, HV, K, V], gathered at ctl's device values: no host read, so a prefix snapshot does not
        wait for the device. No rows may be pending (a prefill step leaves none; `committed_gdn`
        checks it per layer with host reads)."""
        return self._gathered(self.cfg.linear_conv_kernel_dim - 1)

    def _gathered(self, width: int, pending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Every GDN layer's window columns [G, D, width] from CONV_AT (from CONV_AT - PENDING with
        pending: the pending rows' columns first; indices past the window clamped to its last) and
        base state [G, HV, K, V], gathered at ctl's device values (copies, no host read)."""
        ctl, window = self.ctl, self.t("window")
        first = ctl[CONV_AT : CONV_AT + 1].long()
        if pending:
            first = first - ctl[PENDING : PENDING + 1].long()
        cols = (first + torch.arange(width, device=ctl.device)).clamp_(max=window.shape[-1] - 1)
        state_at = ctl[STATE_AT : STATE_AT + 1].long()
        return window.index_select(2, cols), self.t("states").index_select(1, state_at)[:, 0]

    def load_gdn(self, conv: torch.Tensor, recurrent: torch.Tensor, num_tokens: int, draft_len: int) -> None:
        """An empty slot's GDN states set to every layer's conv columns [G, D, W-1] and recurrent
        state [G, HV, K, V] after num_tokens tokens, in half 0 (as `reset` leaves them), with no
        host read; DRAFT_LEN set to draft_len."""
        self.t("states")[:, 0].copy_(recurrent)
        self.t("window")[:, :, : conv.shape[-1]].copy_(conv)
        ctl = torch.zeros(NUM_CTL, dtype=torch.int32)
        reset_ctl(ctl, self.cols)
        ctl[SEQ_LEN], ctl[DRAFT_LEN] = num_tokens, draft_len
        self.ctl.copy_(ctl, non_blocking=True)

    def write_step(
        self, layer_idx: int, window: torch.Tensor, state: torch.Tensor, gates: torch.Tensor | None = None
    ) -> None:
        """A step's conv window [D, W-1+T], state [HV, K, V] (a verify's base, or a prefill step's
        or chunk's last) and a verify's rows' gates [T, 2*HV] (b then a) into the write half."""
        j = self.cache.gdn_index[layer_idx]
        at, w = self.get(CONV_WRITE), self.get(STATE_WRITE)
        self.t("window")[j][:, at : at + window.shape[-1]] = window
        self.t("states")[j][w] = state
        if gates is not None:
            self.t("gates")[j][w * self.rows : w * self.rows + gates.shape[0]] = gates

    def set(self, **fields: int) -> None:
        """ctl fields from host ints, queued (a fill each: `ctl[f] = value` copies a host scalar
        and waits for the stream, the rounds queued ahead, before the host goes on)."""
        for name, value in fields.items():
            self.ctl[globals()[name.upper()]].fill_(value)

    def commit(self, kept: int, store_all: bool = True) -> None:
        """Keep `kept` tokens of the last step (host-driven: prefill)."""
        self.ctl.copy_(commit_ctl(self.ctl, kept, self.cols, store_all))

    def commit_chunk(self, num_tokens: int) -> None:
        """After a chunked prefill of num_tokens (its last state and conv columns in the write halves)."""
        self.commit(num_tokens, store_all=False)

    def snapshot_gdn(self) -> None:
        """The committed GDN states into the slot's checkpoint buffers (a prompt-end checkpoint):
        the base, the pending rows' window columns and gates as they are (copies: no fold), every
        layer's in one gather at ctl's device values, with no host read: a checkpoint does not wait
        for the device (a served prompt ends in one). The columns and gate rows past the pending
        rows are copied too and never read (`restore_gdn` reads PENDING of them)."""
        ctl, R = self.ctl, self.rows
        conv, base = self._gathered(self.t("ckpt_conv").shape[-1], pending=True)
        self.t("ckpt_conv").copy_(conv)
        self.t("ckpt_recurrent").copy_(base)
        rows = ctl[STATE_AT : STATE_AT + 1].long() * R + torch.arange(R, device=ctl.device)
        self.t("ckpt_gates").copy_(self.t("gates").index_select(1, rows))
        self.t("ckpt_pending").copy_(ctl[PENDING])

    def restore_gdn(self, num_tokens: int) -> None:
        """Rewind to the checkpoint taken after num_tokens tokens: its base, columns and gates
        into half 0 of the step buffers, the next step writing half 1 (no host read)."""
        R, cols = self.rows, self.t("ckpt_conv").shape[-1]
        self.t("states")[:, 0].copy_(self.t("ckpt_recurrent"))
        self.t("window")[:, :, :cols].copy_(self.t("ckpt_conv"))
        self.t("gates")[:, :R].copy_(self.t("ckpt_gates"))
        self.set(seq_len=num_tokens, state_at=0, state_write=1, conv_write=self.cols)
        p = self.t("ckpt_pending")
        self.ctl[CONV_AT] = p
        self.ctl[PENDING] = p

    def reset(self) -> None:
        """An empty sequence: zero states and conv columns in half 0 (K/V are position-addressed: no need)."""
        reset_ctl(self.ctl, self.cols)
        self.t("states")[:, 0].zero_()
        self.t("window")[:, :, : self.cfg.linear_conv_kernel_dim - 1].zero_()


class ChunkLayout(NamedTuple):
    """Prompt pieces of a step batch (its sequences lo..hi, rows contiguous) for the chunked delta rule
    (nextn.models.qwen3_5_step.TritonStep: the pieces' GDN): one after another in whole chunks of
    GDN_CHUNK rows, each padded to its last chunk's end (nextn.ops.triton_gdn_chunk's chunk_starts)."""

    index: torch.Tensor  # [1, chunks * GDN_CHUNK] long: each laid-out row's row of the step, or M (a zero row)
    real: torch.Tensor  # [rows] long: the step's rows in the layout, in order
    starts: torch.Tensor  # [pieces + 1] int32: piece p's chunks starts[p] .. starts[p + 1]
    bound: int  # rows a piece may have (the conv pre-pass's grid): the longest, or all (`StepBatch.resplit`)


class StepBatch:
    """The sequences of one step, their rows packed in order: sequence b owns rows offsets[b] ..
    offsets[b+1] of the step's ids, logits and hiddens. Host tuples for the reference modules;
    int32 device tensors for the kernels, made once (a CUDA graph holds them)."""

    def __init__(
        self,
        caches: list[SlotCache],
        rows: list[int],
        max_pos: int | None = None,
        pieces_from: int | None = None,
        *,
        chunked: bool = False,
        chunks: int | None = None,
    ):
        """max_pos: a bound on every row's position known on the host (an eager prefill step's: the
        attention then launches for the positions rows can reach), None in a graph. pieces_from: a
        mixed step's, its sequences from this index on prompt pieces (each kept whole, as a prefill
        step keeps it), the ones before verify rows (the step's trunk). chunked: the prompt pieces'
        GDN rows run by the chunked delta rule from their committed states (which hold no pending
        rows: the caller folds them first), in chunks of 64 rows from each piece's first: other bits
        than a decode row's, so a prompt cut at whole chunks gives one piece's (`chunk_layout`).
        chunks: the pieces' chunks in all, where the last piece (a pad: nextn.engine.rounds.launch)
        takes those the others leave (at least its own; the ones past its rows are zero rows)."""
        if not caches or len(caches) != len(rows) or min(rows) < 1:
            raise ValueError(f"a step batch needs one row count >= 1 per sequence, got {list(rows)}")
        if pieces_from is not None and not 0 <= pieces_from < len(rows):
            raise ValueError(f"a mixed step batch of {len(rows)} sequences has no pieces from {pieces_from}")
        self.caches, self.rows, self.max_pos, self.pieces_from = tuple(caches), tuple(rows), max_pos, pieces_from
        self.chunked, self.num_chunks = chunked, chunks
        if chunks is not None and (pieces_from is None or not chunked or sum(_chunks(rows[pieces_from:])) > chunks):
            raise ValueError(f"the chunked pieces of rows {tuple(rows)} do not fit {chunks} chunks")
        self.cache = caches[0].cache
        self.offsets = tuple(itertools.accumulate(rows, initial=0))
        self.num_rows = self.offsets[-1]
        device = self.cache.ctl.device
        slots = [c.slot for c in caches]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a step batch holds each slot once, got {slots}")
        self.seqs = to_device([slots, self.offsets[:-1], rows], device, torch.int32)  # [3, B]
        self.slot_index = self.seqs[0].long()  # [B]
        # (device ops from seqs, output sizes known: no host work per row, no sync)
        B, M = len(rows), self.num_rows
        self.row_seq = torch.repeat_interleave(torch.arange(B, device=device), self.seqs[2], output_size=M)  # [M]
        self.row_idx = torch.arange(M, device=device, dtype=torch.int32) - self.seqs[1][self.row_seq]
        self.row_slot = self.seqs[0][self.row_seq]  # [M] int32
        self._flat: dict[int, torch.Tensor] = {}
        self._chunks: dict[tuple[int, int], ChunkLayout] = {}
        self._source: torch.Tensor | None = None

    def follow(self, slots: torch.Tensor) -> None:
        """Take the sequences' slots from slots (int32 [B] on the device) from now on: `refresh`
        derives every slot tensor from it, in device ops a CUDA graph captures, so one graph of a
        batch size serves whichever slots run (the caller writes slots before each replay)."""
        if slots.dtype != torch.int32 or slots.shape != (len(self.caches),):
            raise ValueError(f"a step batch of {len(self.caches)} sequences follows int32 [{len(self.caches)}] slots")
        self._source = slots

    def refresh(self, caches: list[SlotCache], fused: bool = False) -> None:
        """The batch now runs these slots' sequences (same row counts): the host tuple, and the slot
        tensors re-derived from the followed device slots (which hold these slots); fused: in one
        Triton launch a flat-row table (nextn.sample.triton_sample.follow_slots), these ops its reference."""
        self.caches = tuple(caches)
        src = self._source
        if fused:
            from nextn.sample.triton_sample import follow_slots

            follow_slots(src, self.seqs[0], self.slot_index, self.row_seq, self.row_idx, self.row_slot, self._flat)
            return
        self.seqs[0].copy_(src)
        self.slot_index.copy_(src)
        torch.index_select(src, 0, self.row_seq, out=self.row_slot)
        for R, flat in self._flat.items():
            flat.copy_(self.slot_index[self.row_seq] * R + self.row_idx)

    def __len__(self) -> int:
        return len(self.caches)

    def field(self, f: int) -> torch.Tensor:
        """ctl field f of every sequence [B] int32 (a device gather)."""
        return self.cache.ctl[self.slot_index, f]

    def row_positions(self, first: torch.Tensor) -> torch.Tensor:
        """[M] int32 positions of every row, from each sequence's first position first [B]."""
        return first[self.row_seq] + self.row_idx

    def keeps(self, store_all: bool) -> tuple[bool, ...]:
        """Whether a trunk step keeps every state of each sequence (a verify's rows) or its last (a
        prefill's): store_all for all of them, or in a mixed step (pieces_from, which takes store_all)
        the verify rows' before the pieces."""
        if self.pieces_from is None:
            return (store_all,) * len(self.rows)
        if not store_all:
            raise ValueError("a mixed step (verify rows, then prompt pieces) keeps its verify rows' states")
        return tuple(s < self.pieces_from for s in range(len(self.rows)))

    @staticmethod
    def sizes(rows, pieces_from: int | None, chunked: bool, chunks: int | None = None) -> tuple:
        """What the device work of a step batch with these row counts depends on, its graphs' key:
        the rows; in a chunked mixed step the verify rows and, of the prompt pieces after them, their
        count, total rows and chunks (their own, or `chunks`): any split of those is the same
        launches (`resplit`)."""
        rows = tuple(rows)
        if pieces_from is None or not chunked:
            return rows
        pieces = rows[pieces_from:]
        total = sum(_chunks(pieces)) if chunks is None else chunks
        return (*rows[:pieces_from], ("pieces", len(pieces), sum(pieces), total))

    def resplit(self, rows) -> None:
        """A mixed step's prompt pieces now have these row counts (the same sequences, verify rows and
        total rows, and under `chunked` the same chunks): the host tuples, and the device tensors made
        from the split (seqs' offsets and rows, row_seq, row_idx, the chunk layouts) rewritten in place
        by queued copies, so a CUDA graph keyed by those sizes (nextn.engine.runner.ModelRunner.batch)
        serves any split of them; the slot tensors made from row_seq follow in `refresh`, which the
        graph runs. Call it before the work that reads them is launched (a graph's replay, not its capture)."""
        rows = tuple(rows)
        if rows == self.rows:
            return
        split, chunks = self.pieces_from, self.num_chunks
        sizes = (split, self.chunked, chunks)
        same = split is not None and min(rows) >= 1 and self.sizes(rows, *sizes) == self.sizes(self.rows, *sizes)
        if not same or (chunks is not None and sum(_chunks(rows[split:])) > chunks):
            raise ValueError(f"a mixed step of rows {self.rows} keeps its sizes (StepBatch.sizes), not {rows}")
        self.rows, self.offsets = rows, tuple(itertools.accumulate(rows, initial=0))
        row_seq = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
        row_idx = torch.arange(self.num_rows) - torch.tensor(self.offsets)[row_seq]
        writes = [
            (self.seqs[1:], torch.tensor([self.offsets[:-1], rows])),
            (self.row_seq, row_seq),
            (self.row_idx, row_idx),
        ]
        for (lo, hi), layout in self._chunks.items():
            writes += zip((layout.index, layout.real, layout.starts), self._layout(lo, hi), strict=True)
        for held, host in writes:  # (a pageable copy each, queued: no wait for the stream)
            held.copy_(host.to(held.dtype), non_blocking=True)

    def chunk_layout(self, lo: int, hi: int) -> ChunkLayout:
        """Sequences lo..hi one after another in whole chunks (`ChunkLayout`), made once (a graph holds
        them; `resplit` rewrites them). Its bound on a piece's rows: the longest piece's, or in a mixed
        step (whose split a graph's replays change) all the pieces' rows."""
        if (lo, hi) not in self._chunks:
            index, real, starts = self._layout(lo, hi)
            device = self.cache.ctl.device
            bound = sum(self.rows[lo:hi]) if self.pieces_from is not None else max(self.rows[lo:hi])
            made = (to_device(index, device), to_device(real, device), to_device(starts, device, torch.int32))
            self._chunks[(lo, hi)] = ChunkLayout(*made, bound)
        return self._chunks[(lo, hi)]

    def _layout(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index [1, chunks * GDN_CHUNK], real [rows], starts [pieces + 1]) of `ChunkLayout`, on the host."""
        rows, chunks = torch.tensor(self.rows[lo:hi]), _chunks(self.rows[lo:hi])
        if self.num_chunks is not None and hi == len(self.rows):  # the last piece takes the chunks left
            chunks[-1] += self.num_chunks - sum(_chunks(self.rows[self.pieces_from :]))
        starts = torch.tensor([0, *itertools.accumulate(chunks)])
        piece = torch.repeat_interleave(torch.arange(len(rows)), rows)
        first = torch.cumsum(rows, 0) - rows
        n = int(rows.sum())
        real = starts[piece] * GDN_CHUNK + torch.arange(n) - first[piece]
        index = torch.full((1, int(starts[-1]) * GDN_CHUNK), self.num_rows, dtype=torch.long)
        index[0, real] = self.offsets[lo] + torch.arange(n)
        return index, real, starts

    def flat_rows(self, R: int) -> torch.Tensor:
        """[M] long: where each row sits in a per-slot buffer [S, R, ...] flattened to [S * R, ...]
        (sequence b's row i at slot * R + i)."""
        if R not in self._flat:
            self._flat[R] = self.slot_index[self.row_seq] * R + self.row_idx.long()
        return self._flat[R]


def _chunks(rows) -> list[int]:
    """Whole chunks of the chunked delta rule each piece of rows takes."""
    return [-(-n // GDN_CHUNK) for n in rows]


def commit_ctl(ctl: torch.Tensor, kept, cols: int, store_all: bool = True, round_: bool = False) -> torch.Tensor:
    """ctl [NUM_CTL] (or [B, NUM_CTL], kept [B, 1]) after keeping `kept` (an int, or a device
    tensor: no host read) tokens of a step that wrote the halves at STATE_WRITE / CONV_WRITE; the
    next step writes the other halves.
    store_all: the step kept its base state, its rows' gates and its whole conv window (a verify:
    the kept rows become pending), else only the last state and the window's last W-1 columns (a
    prefill step, of any number of rows; kept is then all of them).
    round_: the step was a round's verify: also DRAFT_LEN += ACCEPTED + 1 (the rows the round's
    head pass wrote), NUM_GEN += kept, ACCEPTED = kept - 1. The one commit rule of the engine."""
    a_idx, a, b_idx, b, k, c = commit_table(cols, store_all, round_, ctl.device)
    return ctl[..., a_idx] * a + ctl[..., b_idx] * b + kept * k + c


_TABLES: dict = {}


def commit_table(cols: int, store_all: bool, round_: bool, device) -> tuple[torch.Tensor, ...]:
    """new[f] = ctl[a_idx[f]] * a[f] + ctl[b_idx[f]] * b[f] + kept * k[f] + c[f]: commit_ctl as a
    few vector ops (each field's rule is affine in two old fields and kept)."""
    key = (cols, store_all, round_, str(device))
    if key not in _TABLES:
        rule = {  # field: (a_field, a, b_field, b, k, c)
            SEQ_LEN: (SEQ_LEN, 1, SEQ_LEN, 0, 1, 0),
            STATE_AT: (STATE_WRITE, 1, SEQ_LEN, 0, 0, 0),
            STATE_WRITE: (STATE_WRITE, -1, SEQ_LEN, 0, 0, 1),
            CONV_AT: (CONV_WRITE, 1, SEQ_LEN, 0, int(store_all), 0),  # a prefill step writes the last columns only
            CONV_WRITE: (CONV_WRITE, -1, SEQ_LEN, 0, 0, cols),
            DRAFT_LEN: (DRAFT_LEN, 1, ACCEPTED, int(round_), 0, int(round_)),
            NUM_GEN: (NUM_GEN, 1, SEQ_LEN, 0, int(round_), 0),
            ACCEPTED: (ACCEPTED, 1 - int(round_), SEQ_LEN, 0, int(round_), -int(round_)),
            PENDING: (PENDING, 0, SEQ_LEN, 0, int(store_all), 0),
        }
        cols_ = list(zip(*(rule[f] for f in range(NUM_CTL)), strict=True))
        _TABLES[key] = tuple(
            torch.tensor(col, device=device, dtype=torch.long if i in (0, 2) else torch.int32)
            for i, col in enumerate(cols_)
        )
    return _TABLES[key]
