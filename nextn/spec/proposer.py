"""The MTP proposer: drafts K tokens with the model's NextN head, autoregressively.

Each round it first writes the head's pending rows (committed tokens with their true trunk
hiddens, plus the pending bonus with the hidden of its predecessor) into the draft K/V in one
batched pass; the last row's output gives draft 1. Drafts 2..K chain the head's own output
hidden. Chain rows sit past the committed rows and are overwritten by the next round.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from nextn.cache import LayerKV
from nextn.config import SpecConfig
from nextn.engine.runner import PREFILL_CHUNK
from nextn.engine.selector import TokenSelector
from nextn.engine.state import SeqState
from nextn.models.qwen3_5 import CausalLM


class Draft(NamedTuple):
    token_ids: torch.Tensor  # [k] long
    probs: torch.Tensor | None  # [k, V] the law each draft was drawn from (None: greedy, one-hot)


class MTPProposer:
    def __init__(self, model: CausalLM, spec: SpecConfig):
        if model.mtp is None:
            raise ValueError("the checkpoint has no MTP head (mtp.* tensors)")
        self.model, self.head, self.spec = model, model.mtp, spec

    def run_rows(self, kv: LayerKV, ids: torch.Tensor, hidden: torch.Tensor, first_pos: int, last_only: bool = True):
        """Run head rows for tokens ids [n] with predecessor hiddens [n, H] at positions first_pos..
        (K/V slots first_pos-1..). Returns (logits [n or 1, V], hiddens to chain [n or 1, H])."""
        embeds = self.model.model.embed_tokens(ids)[None]
        positions = torch.arange(first_pos, first_pos + ids.numel(), device=ids.device)
        cos, sin = self.model.rotary.cos_sin(positions, embeds.dtype)
        out = self.head(embeds, hidden[None], cos, sin, kv, first_pos - 1)[0]
        out = out[-1:] if last_only else out
        normed = self.head.norm(out)
        chained = normed if self.spec.hidden_after_norm else out
        return self.model.logits(normed), chained

    def _head(self, state: SeqState, ids: torch.Tensor, hidden: torch.Tensor, first_pos: int):
        """One draft pass over the state's draft K/V (the step a fast path replaces)."""
        return self.run_rows(state.draft_kv, ids, hidden, first_pos)

    @torch.inference_mode()
    def propose(self, state: SeqState, bonus: int, k: int, selector: TokenSelector) -> Draft:
        """Draft up to k tokens following `bonus` (the pending token, not yet in the trunk cache).

        The chain runs all k steps without reading anything back, then is cut at the first draft
        whose own-pick probability is below p_min (one host read; zero drafts if the first is).
        """
        logits, chained, n = self._first_pass(state, bonus)
        tokens, probs, confidence = [], [], []
        no_drafts = logits.new_zeros(0, dtype=torch.long)
        for j in range(k):
            token, q, conf = selector.draft(logits, torch.cat(tokens) if tokens else no_drafts)
            tokens.append(token)
            probs.append(q)
            confidence.append(conf)
            if j + 1 < k:
                logits, chained = self._head(state, token, chained, n + 1 + j)
        token_ids = torch.cat(tokens)
        keep = self._confident_prefix(torch.cat(confidence))
        q = None if probs[0] is None else torch.cat(probs)[:keep]
        return Draft(token_ids[:keep], q)

    def _first_pass(self, state: SeqState, bonus: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Write the state's pending head rows and the bonus's row; returns (the last row's logits
        [1, V], its hidden to chain [1, H], n: the bonus's position)."""
        row_ids, row_hidden = state.take_rows()
        n = len(state.tokens)  # the bonus is token n; its row pairs it with hidden n-1
        ids = torch.tensor(row_ids + [bonus], device=row_hidden.device)
        hidden = torch.cat([row_hidden, state.last_hidden[None]])
        # the rows' catch-up (a whole prompt after a prefill) runs in prefill-sized chunks
        for s in range(0, ids.numel(), PREFILL_CHUNK):
            logits, chained = self._head(state, ids[s : s + PREFILL_CHUNK], hidden[s : s + PREFILL_CHUNK],
                                         state.draft_len + 1 + s)
        state.draft_len = n
        return logits, chained, n

    def _confident_prefix(self, confidence: torch.Tensor) -> int:
        """Drafts before the first whose own-pick probability is below p_min (one host read)."""
        if self.spec.p_min <= 0.0:
            return confidence.numel()
        return int((confidence >= self.spec.p_min).long().cumprod(0).sum())
