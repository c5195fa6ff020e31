"""The training objective of a trunk with its MTP head, on one batch of packed sequences.

MTP row convention (the one inference uses): row p embeds token x_p, pairs it with the trunk's
post-final-norm hidden of its predecessor h_{p-1}, sits at rope position p and predicts x_{p+1}.
For a batch x [B, L+1] the trunk reads x[:, :L] and predicts x[:, 1:]; head row r (p = r + 1)
predicts x[:, r + 2], so the head's targets are x[:, 2:] and line up with the trunk's logits at
positions 1..L-1: `head_agree` (head argmax == trunk argmax) is teacher-forced draft acceptance.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from nextn.models.qwen3_5 import CausalLM


class Losses(NamedTuple):
    objective: torch.Tensor  # what the optimizer minimises
    trunk: torch.Tensor  # next-token CE
    head: torch.Tensor  # the head's CE on the token two ahead
    head_acc: torch.Tensor  # head top-1 == true token
    head_agree: torch.Tensor  # head top-1 == trunk top-1


def trunk_hidden(model: CausalLM, inputs: torch.Tensor) -> torch.Tensor:
    """inputs [B, L] -> the trunk's hidden after the final norm [B, L, H]."""
    return model.final_norm(model(inputs))


def head_logits(model: CausalLM, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """x [B, L+1] tokens, hidden [B, L, H] post-norm trunk hidden -> head logits [B, L-1, V]."""
    L = hidden.shape[1]
    positions = torch.arange(1, L, device=x.device)
    cos, sin = model.rotary.cos_sin(positions, hidden.dtype)
    embeds = model.model.embed_tokens(x[:, 1:L])  # x_p for p = 1..L-1
    out = model.mtp(embeds, hidden[:, : L - 1], cos, sin, kv=None, slot=0)  # paired with h_{p-1}
    return model.logits(model.mtp.norm(out))


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten().long())


def joint_losses(model: CausalLM, x: torch.Tensor, head_weight: float) -> Losses:
    """Trunk and head trained together: trunk CE + head_weight * head CE."""
    hidden = trunk_hidden(model, x[:, :-1])
    trunk_logits = model.logits(hidden)
    logits = head_logits(model, x, hidden)
    trunk, head = _ce(trunk_logits, x[:, 1:]), _ce(logits, x[:, 2:])
    return Losses(trunk + head_weight * head, trunk, head, *_head_metrics(logits, trunk_logits, x))


def distill_losses(model: CausalLM, x: torch.Tensor) -> Losses:
    """Frozen trunk: the head learns the trunk's next-token distribution (soft cross-entropy),
    which is what drafting is judged against."""
    with torch.no_grad():
        hidden = trunk_hidden(model, x[:, :-1])
        trunk_logits = model.logits(hidden)
        teacher = torch.softmax(trunk_logits[:, 1:], dim=-1)
    logits = head_logits(model, x, hidden)
    soft = -(teacher * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    head = _ce(logits.detach(), x[:, 2:])
    return Losses(soft, _ce(trunk_logits, x[:, 1:]), head, *_head_metrics(logits, trunk_logits, x))


def _head_metrics(logits: torch.Tensor, trunk_logits: torch.Tensor, x: torch.Tensor):
    with torch.no_grad():
        pick = logits.argmax(-1)
        acc = (pick == x[:, 2:]).float().mean()
        agree = (pick == trunk_logits[:, 1:].argmax(-1)).float().mean()
    return acc, agree
