"""The MTP ("NextN") head: one full-attention decoder layer with its own K/V cache, fed
fc(cat(norm(embed(token)), norm(hidden))), sharing the trunk's embedding and lm_head.

Row convention: row p embeds token x_p, pairs it with the trunk hidden of its predecessor
h_{p-1}, sits at rope position p and predicts x_{p+1}. Its K/V live in slot p - 1.
"""

from __future__ import annotations

import torch
from torch import nn

from nextn.config import FULL
from nextn.config.model import ModelConfig
from nextn.layers.attention import KV
from nextn.layers.linear import Linear
from nextn.layers.norm import RMSNorm
from nextn.ops import OPS, Ops


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_cls: type[nn.Module]):
        super().__init__()
        H = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = Linear(2 * H, H, bias=False)
        # the MTP layer is the trunk's decoder layer (nextn.models.decoder), dense or MoE like it
        self.layers = nn.ModuleList([layer_cls(cfg, 0, FULL, moe=cfg.num_experts > 0)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,  # [B, T, H] embeddings of tokens x_p
        hidden: torch.Tensor,  # [B, T, H] trunk (or previous draft step) hiddens h_{p-1}
        rope: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) [T, rotary_dim] at positions p
        kv: KV | list[KV] | None,
        slot: int | list[int],  # K/V slot of the first row (= its position - 1); a step: per sequence
        step=None,  # a StepBatch: embeds / hidden [1, M, H] hold its sequences' rows (the step attention)
        ops: Ops | None = None,
    ) -> torch.Tensor:
        """Returns the layer output before mtp.norm [B, T, H]."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.layers[0](x, rope, step, slot, ops or OPS["torch"](), kv=kv)
