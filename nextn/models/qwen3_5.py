"""The hybrid trunk of Qwen3.5 (dense and MoE) and Qwen3-Next: module names are the checkpoint's,
so `state_dict()` keys are the text-only export's keys (`model.*`, `lm_head.*`, `mtp.*`).

One forward serves prefill (chunked delta rule, states written in place) and the multi-token
step used by decode (1 token) and verify (K+1 tokens), which keeps per-token states for rollback.
"""
from __future__ import annotations

import torch
from torch import nn

from nextn.cache import HybridCache
from nextn.layers.linear import STEP_ROWS, Linear, row_invariant_linear
from nextn.config import FULL, ModelConfig
from nextn.layers.attention import Attention
from nextn.layers.ffn import MLP, SparseMoeBlock
from nextn.layers.gdn import GatedDeltaNet, GatedDeltaNetNext
from nextn.layers.norm import RMSNorm
from nextn.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kind: str, moe: bool):
        super().__init__()
        self.kind = kind
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == FULL:
            self.self_attn = Attention(cfg)
        else:
            gdn_cls = GatedDeltaNetNext if cfg.family == "qwen3_next" else GatedDeltaNet
            self.linear_attn = gdn_cls(cfg, layer_idx)
        self.mlp = SparseMoeBlock(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache: HybridCache | None, start: int, num_real: int | None, kv=None):
        """num_real: None for prefill / training; for a step, the real rows of the padded x."""
        h = self.input_layernorm(x)
        if self.kind == FULL:
            layer_kv = kv if kv is not None else (cache.kv[self.layer_idx] if cache is not None else None)
            h = self.self_attn(h, cos, sin, layer_kv, start, num_real)
        else:
            h = self.linear_attn(h, cache, num_real)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), num_real)


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, kind, cfg.is_moe_layer(i)) for i, kind in enumerate(cfg.layer_types)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, num_mtp_layers: int = 0):
        super().__init__()
        from nextn.models.mtp import MTPHead  # the head builds on this module's DecoderLayer

        self.cfg = cfg
        self.model = TextModel(cfg)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPHead(cfg) if num_mtp_layers > 0 else None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        cache: HybridCache | None = None,
        keep_states: bool = False,
    ) -> torch.Tensor:
        """Returns the last layer's hidden states before the final norm [B, T, H].

        With a cache, tokens sit at positions cache.seq_len + [0, T). keep_states=False (prefill)
        commits them at once; keep_states=True (decode / verify) leaves them for `cache.commit(n)`.
        """
        T = input_ids.shape[1]
        start = cache.seq_len if cache is not None else 0
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds the cache capacity {cache.max_len}")
        num_real = None
        if keep_states:
            # every step runs STEP_ROWS rows whatever T is: decode and verify share one shape,
            # so each row's arithmetic is the same in both (and one CUDA graph fits all K)
            if T > STEP_ROWS:
                raise ValueError(f"a step takes at most {STEP_ROWS} tokens, got {T}")
            num_real = T
            input_ids = torch.cat([input_ids, input_ids.new_zeros(input_ids.shape[0], STEP_ROWS - T)], dim=1)
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(start, start + x.shape[1], device=input_ids.device)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, start, num_real)
        if cache is not None:
            if keep_states:
                cache.step_tokens = T
            else:
                cache.seq_len += T
        return x[:, :T]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    def logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(normed_hidden, self.lm_head_weight).float()
