"""The training objective of a trunk with its MTP head, on one batch of packed sequences.

MTP row convention (the one inference uses): row p embeds token x_p, pairs it with the trunk's
post-final-norm hidden of its predecessor h_{p-1}, sits at rope position p and predicts x_{p+1}.
For a batch x [B, L+1] the trunk reads x[:, :L] and predicts x[:, 1:]; head row r (p = r + 1)
predicts x[:, r + 2], so the head's targets are x[:, 2:] and line up with the trunk's logits at
positions 1..L-1: `head_agree` (head argmax == trunk argmax) is teacher-forced draft acceptance.

Chain depths (head distillation, `chain_depth` D > 1) train the draft steps the proposer chains:
depth d row i (base p = i + 1) embeds the true x_{p+d-1} (what an accepted draft equals), pairs it
with depth d-1's output of row i after mtp.norm, sits at position p+d-1 and predicts x_{p+d}; its
attention sees what the draft K/V holds at that step: depth-1 rows 1..p and row i of depths 2..d.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from nextn.layers.attention import attend
from nextn.layers.rotary import apply_rotary
from nextn.models.qwen3_5 import CausalLM
from nextn.ops import Ops


class Losses(NamedTuple):
    objective: torch.Tensor  # what the optimizer minimises
    trunk: torch.Tensor  # next-token CE
    head: torch.Tensor  # the head's CE on the token two ahead
    head_acc: torch.Tensor  # head top-1 == true token
    head_agree: torch.Tensor  # head top-1 == trunk top-1
    accept_len: torch.Tensor  # 1 + sum over depths d of P(depths 1..d all pick the trunk's pick)


def trunk_hidden(model: CausalLM, inputs: torch.Tensor, ops: Ops | None = None) -> torch.Tensor:
    """inputs [B, L] -> the trunk's hidden after the final norm [B, L, H] (ops: the chunked rule's kernel)."""
    return model.final_norm(model(inputs, ops=ops))


def head_logits(model: CausalLM, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """x [B, L+1] tokens, hidden [B, L, H] post-norm trunk hidden -> head logits [B, L-1, V]."""
    L = hidden.shape[1]
    positions = torch.arange(1, L, device=x.device)
    rope = model.rotary.cos_sin(positions, hidden.dtype)
    embeds = model.model.embed_tokens(x[:, 1:L])  # x_p for p = 1..L-1
    out = model.mtp(embeds, hidden[:, : L - 1], rope, kv=None, slot=0)  # paired with h_{p-1}
    return model.logits(model.mtp.norm(out))


def chain_logits(model: CausalLM, x: torch.Tensor, hidden: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """x [B, L+1], hidden [B, L, H] -> head logits of depths 1..depth, depth d [B, L-d, V] (rows
    i = 0..L-d-1, predicting x[:, i+d+1]). The MTP layer is run here by hand because its queries
    also see the other depths' keys: depth 1 causally, depths 2..d only their own row."""
    head = model.mtp
    layer = head.layers[0]
    attn = layer.self_attn
    L, B, hd = hidden.shape[1], x.shape[0], attn.head_dim
    keys, values, out, prev = [], [], [], hidden
    for d in range(1, depth + 1):
        T = L - d
        cos, sin = model.rotary.cos_sin(torch.arange(d, d + T, device=x.device), hidden.dtype)
        embeds = model.model.embed_tokens(x[:, d : d + T])
        h = head.fc(torch.cat([head.pre_fc_norm_embedding(embeds), head.pre_fc_norm_hidden(prev[:, :T])], dim=-1))
        a = layer.input_layernorm(h)
        q, gate = attn.q_proj(a).view(B, T, attn.num_heads, 2 * hd).split(hd, dim=-1)
        q = apply_rotary(attn.q_norm(q), cos, sin)
        keys.append(apply_rotary(attn.k_norm(attn.k_proj(a).view(B, T, attn.num_kv_heads, hd)), cos, sin))
        values.append(attn.v_proj(a).view(B, T, attn.num_kv_heads, hd))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        mask = torch.cat([causal] + [torch.eye(T, dtype=torch.bool, device=x.device)] * (d - 1), dim=1)
        o = attend(q, torch.cat([k[:, :T] for k in keys], 1), torch.cat([v[:, :T] for v in values], 1), mask, False)
        h = h + attn.o_proj(o.reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1)))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        prev = head.norm(h)  # what the proposer chains (SpecConfig.hidden_after_norm)
        out.append(model.logits(prev))
    return out


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten().long())


def joint_losses(model: CausalLM, x: torch.Tensor, head_weight: float, ops: Ops | None = None) -> Losses:
    """Trunk and head trained together: trunk CE + head_weight * head CE."""
    hidden = trunk_hidden(model, x[:, :-1], ops)
    trunk_logits = model.logits(hidden)
    logits = head_logits(model, x, hidden)
    trunk, head = _ce(trunk_logits, x[:, 1:]), _ce(logits, x[:, 2:])
    acc, agree = _head_metrics(logits, trunk_logits, x)
    return Losses(trunk + head_weight * head, trunk, head, acc, agree, 1 + agree)


def distill_losses(
    model: CausalLM,
    x: torch.Tensor,
    depth: int = 1,
    decay: float = 0.7,
    ops: Ops | None = None,
    argmax_weight: float = 0.0,
) -> Losses:
    """Frozen trunk: the head learns the trunk's next-token distribution (soft cross-entropy),
    which is what drafting is judged against; with depth D > 1 also at draft steps 2..D of its
    chain, depth d weighted decay ** (d - 1). Head CE/acc/agree are depth 1's.

    argmax_weight w mixes the trunk's pick into the target: (1 - w) * softmax + w * one-hot of its
    argmax. A head that learns it puts at least w on the pick it shares with the trunk, so its
    confidence in its pick tracks greedy acceptance (argmax agreement) and not the trunk's own
    uncertainty: what a p_min gate reads. w = 0 is pure distribution matching (sampled drafting)."""
    with torch.no_grad():
        hidden = trunk_hidden(model, x[:, :-1], ops)
        trunk_logits = model.logits(hidden)
        teacher = torch.softmax(trunk_logits, dim=-1)  # float32 logits (CausalLM.logits)
        if argmax_weight > 0.0:
            teacher.mul_(1.0 - argmax_weight)
            teacher.scatter_add_(
                -1,
                trunk_logits.argmax(-1, keepdim=True),
                torch.full_like(teacher[..., :1], argmax_weight),
            )
    all_logits = [head_logits(model, x, hidden)] if depth == 1 else chain_logits(model, x, hidden, depth)
    soft = sum(
        decay**d * -(teacher[:, d + 1 :] * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        for d, logits in enumerate(all_logits)
    )
    logits = all_logits[0]
    head = _ce(logits.detach(), x[:, 2:])
    with torch.no_grad():  # teacher-forced chain acceptance over the rows every depth has
        n = all_logits[-1].shape[1]
        agree = torch.stack(
            [lg[:, :n].argmax(-1) == trunk_logits[:, d + 1 : d + 1 + n].argmax(-1) for d, lg in enumerate(all_logits)]
        )
        accept_len = 1 + agree.long().cumprod(0).float().mean((1, 2)).sum()
    return Losses(soft, _ce(trunk_logits, x[:, 1:]), head, *_head_metrics(logits, trunk_logits, x), accept_len)


def _head_metrics(logits: torch.Tensor, trunk_logits: torch.Tensor, x: torch.Tensor):
    with torch.no_grad():
        pick = logits.argmax(-1)
        acc = (pick == x[:, 2:]).float().mean()
        agree = (pick == trunk_logits[:, 1:].argmax(-1)).float().mean()
    return acc, agree
