"""The hybrid trunk of Qwen3.5 (dense and MoE) and Qwen3-Next: module names are the checkpoint's,
so `state_dict()` keys are the text-only export's keys (`model.*`, `lm_head.*`, `mtp.*`).

One module forward serves prefill (the Ops table's chunked delta rule, final states to the slot's
home) and the reference decode / verify step of a batch of sequences (their rows packed, states
after each token to each slot's step buffers). The forward never moves positions: the runner
commits.
The fused Triton step is a sibling forward (nextn.models.qwen3_5_step) over the same weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from nextn.cache import SlotCache, StepBatch
from nextn.config import FULL, STEP_ROWS
from nextn.config.model import ModelConfig
from nextn.layers.attention import KV
from nextn.layers.linear import Linear, QuantLinear
from nextn.layers.norm import RMSNorm
from nextn.layers.rotary import RotaryEmbedding
from nextn.models.decoder import DecoderLayer
from nextn.models.mtp import MTPHead
from nextn.ops import OPS, Ops
from nextn.ops.fp8 import QuantWeight, dense
from nextn.ops.linear import pad_dim1, row_invariant_linear
from nextn.parallel.comm import embed, gather_vocab
from nextn.parallel.shard import vocab_rows


class HeadRows(NamedTuple):
    """CausalLM.head_rows's result: the logits, and the hiddens a chain feeds the next head step,
    after mtp.norm or before it (SpecConfig.hidden_after_norm)."""

    logits: torch.Tensor  # [n or 1, V or Vd] float32
    normed: torch.Tensor  # [n or 1, H] after mtp.norm
    hidden: torch.Tensor  # [n or 1, H] before it

    def chained(self, after_norm: bool) -> torch.Tensor:
        return self.normed if after_norm else self.hidden


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_rows(cfg), cfg.hidden_size)  # this rank's rows
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, kind, cfg.is_moe_layer(i)) for i, kind in enumerate(cfg.layer_types)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, num_mtp_layers: int = 0):
        super().__init__()
        self.cfg = cfg
        self.model = TextModel(cfg)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, vocab_rows(cfg), bias=False)
        self.mtp = MTPHead(cfg, DecoderLayer) if num_mtp_layers > 0 else None

    @property
    def lm_head_weight(self) -> torch.Tensor | QuantWeight:
        """[V, H], or this rank's rows of it under tensor parallelism; a QuantWeight where a GGUF
        file's lm_head stays Q8_0 (nextn.models.loader.load_gguf)."""
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.fp8 if isinstance(self.lm_head, QuantLinear) else self.lm_head.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ids [...] -> [..., H] (gathered from the ranks' rows under tensor parallelism)."""
        return embed(ids, self.model.embed_tokens.weight, self.cfg)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        cache: SlotCache | StepBatch | None = None,
        ops: Ops | None = None,
        store_all: bool | tuple[bool, ...] = True,
    ) -> torch.Tensor:
        """Returns the last layer's hidden states before the final norm [B, T, H].

        With a SlotCache (prefill, B = 1), tokens sit at positions cache.seq_len + [0, T) and the
        GDN states go home. With a StepBatch (the reference step), input_ids [1, M] are its
        sequences' rows, each sequence's at its slot's positions; the GDN states stay in the step
        buffers (the state after every token, or the last only when not store_all) for the
        caller's commit; store_all may be one flag a sequence (a mixed step's). ops: the kernels of
        prefill / training (default: the references).
        """
        T = input_ids.shape[1]
        if isinstance(cache, StepBatch):
            start = [c.seq_len for c in cache.caches]
            keeps = store_all if isinstance(store_all, tuple) else (store_all,) * len(start)
            for first, rows, keep in zip(start, cache.rows, keeps, strict=True):
                if (keep and rows > STEP_ROWS) or first + rows > cache.cache.layout.capacity:
                    raise ValueError(f"a step of {rows} rows at position {first} does not fit the cache")
            positions = [first + i for first, rows in zip(start, cache.rows, strict=True) for i in range(rows)]
            # whole tiles of STEP_ROWS rows: every op's shape is a multiple of the step's, so a
            # row's arithmetic (SIMD tails included) does not depend on the batch
            input_ids = pad_dim1(input_ids, -(-T // STEP_ROWS) * STEP_ROWS)
            positions += [positions[-1]] * (input_ids.shape[1] - T)
        else:
            start = cache.seq_len if cache is not None else 0
            if cache is not None and start + T > cache.max_len:
                raise ValueError(f"sequence of {start + T} tokens exceeds the cache capacity {cache.max_len}")
            positions = range(start, start + T)
        ops = ops or OPS["torch"]()
        x = self.embed(input_ids)
        rope = self.rotary.cos_sin(torch.tensor(positions, device=input_ids.device), x.dtype)
        for layer in self.model.layers:
            x = layer(x, rope, cache, start, ops, store_all=store_all)
        return x[:, :T]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    def committed_gdn(self, cache: SlotCache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv columns [D, W-1], recurrent state [HV, K, V]) of a GDN layer after the slot's
        committed tokens, its pending rows folded in (nextn.cache.hybrid)."""
        return self.model.layers[layer_idx].linear_attn.committed(cache)

    def head_rows(
        self,
        kv: KV,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        first_pos: int,
        last_only: bool = True,
        ops: Ops | None = None,
        lm_head: torch.Tensor | None = None,
    ) -> HeadRows:
        """The MTP head over rows of tokens ids [n] with predecessor hiddens [n, H] at positions
        first_pos.. (K/V slots first_pos-1..), any number of rows (a prompt's catch-up, replay,
        training checks); the last row only with last_only. lm_head [Vd, H]: the rows to score (a
        draft vocabulary's, nextn.spec.draft_vocab); default all."""
        embeds = self.embed(ids)[None]
        positions = torch.arange(first_pos, first_pos + ids.numel(), device=ids.device)
        rope = self.rotary.cos_sin(positions, embeds.dtype)
        out = self.mtp(embeds, hidden[None], rope, kv, first_pos - 1, ops=ops)[0]
        out = out[-1:] if last_only else out
        normed = self.mtp.norm(out)
        return HeadRows(self.logits(normed, lm_head), normed, out)

    def logits(self, normed_hidden: torch.Tensor, lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits over the lm_head's rows [.., V] (gathered from the ranks' under tensor
        parallelism), or over the given rows [Vd, H] (a draft vocabulary's, never sharded)."""
        if lm_head is not None:
            return scores(normed_hidden, lm_head)
        local = scores(normed_hidden, self.lm_head_weight)
        return gather_vocab(local.reshape(-1, local.shape[-1]), self.cfg).view(*local.shape[:-1], -1)


# rows of a quantized lm_head dequantized at a time: the 9B's whole Q8_0 lm_head (248,320 x 4,096) is
# ~6 GB of float32 and bf16 temporaries, more than the engine sets aside beside its cache
SCORE_ROWS = 16384


def scores(x: torch.Tensor, w: torch.Tensor | QuantWeight) -> torch.Tensor:
    """Float32 logits x @ w.T over the rows of w [V, H] (in x's dtype; a quantized one dequantized
    SCORE_ROWS rows at a time, each row's values what dequantizing it whole gives)."""
    if not isinstance(w, QuantWeight):
        return row_invariant_linear(x, w).float()
    parts = []
    for i in range(0, w.weight.shape[0], SCORE_ROWS):  # (dense refuses compacted scales: the step's)
        rows = w._replace(weight=w.weight[i : i + SCORE_ROWS], scale=w.scale[:, i : i + SCORE_ROWS])
        parts.append(row_invariant_linear(x, dense(rows, x.dtype)).float())
    return torch.cat(parts, dim=-1)


class ReferenceStep:
    """The step interface of nextn.models.qwen3_5_step.TritonStep over the module forward: the CPU
    path, and the oracle the fused step is tested against. Reads positions on the host."""

    def __init__(self, model: CausalLM, hidden_after_norm: bool = True):
        self.model, self.after_norm = model, hidden_after_norm

    def trunk(
        self,
        batch: StepBatch,
        ids: torch.Tensor,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        store_all: bool = True,
        live: torch.Tensor | None = None,
        logit_rows: torch.Tensor | None = None,
    ) -> None:
        """ids [M]: the batch's rows; logits [M, V] float32 (or [n, V] of the rows logit_rows [n]
        long) and head-input hiddens [M, H] written. live (the rows of each sequence that count, as
        the fused step takes it): every row is computed here; the rows that count are the same either way.
        A mixed step (batch.pieces_from, with store_all): its prompt pieces kept whole, as
        TritonStep.trunk keeps them."""
        h = self.model(ids[None], batch, store_all=batch.keeps(store_all))[0]
        normed = self.model.final_norm(h)
        logits.copy_(self.model.logits(normed if logit_rows is None else normed.index_select(0, logit_rows)))
        hidden.copy_(normed if self.after_norm else h)

    def fold(self, caches: list[SlotCache]) -> None:
        """Each slot's pending GDN rows into its base state, as TritonStep.fold: the folded state and
        carried columns into the write halves; the caller commits 0 tokens."""
        for layer in self.model.model.layers:
            if layer.kind != FULL:
                for cache in caches:
                    conv, state = layer.linear_attn.committed(cache)
                    cache.write_step(layer.layer_idx, conv, state)

    def head(
        self,
        batch: StepBatch,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        first: torch.Tensor,
        rows: torch.Tensor | None,
        out: tuple[torch.Tensor, torch.Tensor],
        lm_head: torch.Tensor | None = None,
    ) -> None:
        """MTP rows of a batch: ids [M] paired with hidden [M, H]; sequence b's first row in draft
        K/V slot first[b] (int32 [B]; rope position first[b] + 1). rows [B] (packed row indices; None:
        every row) give the logits [B or M, V] and the hiddens to chain [B or M, H], written into
        out = (logits, chained). lm_head [Vd, H]: score these rows only (a draft vocabulary's copy;
        logits [B or M, Vd]); default the full lm_head."""
        logits, chained = out
        slots = [int(p) for p in first.tolist()]
        positions = [s + 1 + i for s, n in zip(slots, batch.rows, strict=True) for i in range(n)]
        M = len(positions)
        padded = -(-M // STEP_ROWS) * STEP_ROWS  # whole tiles, like the trunk's step
        positions += [positions[-1]] * (padded - M)
        embeds = self.model.embed(pad_dim1(ids[None], padded))
        rope = self.model.rotary.cos_sin(torch.tensor(positions, device=ids.device), embeds.dtype)
        kv = [c.draft_kv() for c in batch.caches]
        h = self.model.mtp(embeds, pad_dim1(hidden[None], padded), rope, kv, slots, step=batch)[0, :M]
        if rows is not None:
            h = h.index_select(0, rows)
        normed = self.model.mtp.norm(h)
        logits.copy_(self.model.logits(normed, lm_head))
        chained.copy_(normed if self.after_norm else h)
