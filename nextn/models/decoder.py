"""One decoder layer of the hybrid trunk (and of the MTP head): a Gated DeltaNet or gated
full-attention mixer, then a dense or sparse-MoE FFN, each behind a zero-centred RMSNorm and a
residual. Module names are the checkpoint's. Under tensor parallelism (cfg.tp_size > 1) the mixer
and the FFN hold a rank's heads and columns (nextn.parallel.shard) and their outputs are
all-reduced before the residual.
"""

from __future__ import annotations

import torch
from torch import nn

from nextn.cache import SlotCache, StepBatch
from nextn.config import FULL
from nextn.config.model import ModelConfig
from nextn.layers.attention import KV, Attention
from nextn.layers.ffn import MLP, SparseMoeBlock
from nextn.layers.gdn import GatedDeltaNet, GatedDeltaNetNext
from nextn.layers.norm import RMSNorm
from nextn.ops import Ops
from nextn.parallel.comm import all_reduce


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kind: str, moe: bool):
        super().__init__()
        self.cfg, self.kind, self.layer_idx = cfg, kind, layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == FULL:
            self.self_attn = Attention(cfg)
        else:
            gdn_cls = GatedDeltaNetNext if cfg.family == "qwen3_next" else GatedDeltaNet
            self.linear_attn = gdn_cls(cfg, layer_idx)
        self.mlp = SparseMoeBlock(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: SlotCache | StepBatch | None,
        start: int | list[int],
        ops: Ops,
        kv: KV | list[KV] | None = None,
        store_all: bool | tuple[bool, ...] = True,
    ):
        """x [B, T, H] at positions start.. (prefill with a SlotCache, training without), or a step's
        packed rows [1, M, H] (a StepBatch; start: each sequence's first position); rope: (cos, sin)
        [T or M, rotary_dim] at the rows' positions. kv: the attention cache(s) to use instead of the
        slots' (the MTP head's)."""
        h = self.input_layernorm.using(ops)(x)
        step = cache if isinstance(cache, StepBatch) else None
        if self.kind == FULL:
            if kv is None and step is not None:
                kv = [c.kv(self.layer_idx) for c in step.caches]
            elif kv is None and cache is not None:
                kv = cache.kv(self.layer_idx)
            h = self.self_attn(h, *rope, kv, start, step, ops)
        else:
            h = self.linear_attn(h, cache, ops, store_all)
        # under tensor parallelism each block ends in a partial sum: one all-reduce per block
        x = x + all_reduce(h, self.cfg)
        return x + all_reduce(self.mlp(self.post_attention_layernorm.using(ops)(x), ops), self.cfg)
