"""The model runner: the one place that runs the trunk on a sequence state (prefill, and the
multi-token step shared by decode and verify) and turns hiddens into logits and head inputs.

Does not choose tokens (the selector does) or decide how many stay (the round loop does).
"""
from __future__ import annotations

from typing import Callable

import torch

from nextn.cache import HybridCache, LayerKV
from nextn.config import SpecConfig
from nextn.engine.state import SeqState
from nextn.layers.linear import STEP_ROWS
from nextn.models.qwen3_5 import CausalLM

PREFILL_CHUNK = 2048  # tokens per prefill forward: bounds attention score memory
PREFILL_MODES = ("chunked", "steps")


class ModelRunner:
    cache_cls = HybridCache  # the caches a state of this runner holds

    def __init__(self, model: CausalLM, spec: SpecConfig, prefill: str = "chunked"):
        """prefill "chunked": the chunked delta rule over up to PREFILL_CHUNK tokens per forward
        (fast); "steps": the decode/verify step over STEP_ROWS tokens at a time, so every token's
        state is computed with the same arithmetic however the sequence was split into requests
        (a resumed session equals a cold run bitwise)."""
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        self.model = model
        self.spec = spec
        self.prefill = prefill
        self.cfg = model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    @property
    def drafts(self) -> bool:
        """Whether states need the MTP head's draft K/V (a head, and K > 0)."""
        return self.model.mtp is not None and self.spec.num_speculative_tokens > 0

    def new_state(self, max_len: int) -> SeqState:
        cache = self.cache_cls(self.cfg, max_len, self.device, self.dtype)
        draft_kv = None
        if self.drafts:  # without it, plain decoding queues no head rows
            draft_kv = LayerKV(1, max_len, self.cfg.num_key_value_heads, self.cfg.head_dim, self.device, self.dtype)
        return SeqState(cache, draft_kv, self.cfg.hidden_size)

    def head_input(self, pre_norm: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The hidden the MTP head consumes: after the final norm (default) or before it."""
        return normed if self.spec.hidden_after_norm else pre_norm

    @torch.inference_mode()
    def extend(self, state: SeqState, token_ids: list[int],
               on_logits: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """Prefill `token_ids` after the state's committed tokens (see `prefill` for how).

        on_logits(start, logits [T, V]): if given, called per chunk with the logits of every row
        (row i follows token_ids[start + i]); for prompt logprobs.
        """
        if len(state.tokens) + len(token_ids) > state.cache.max_len:
            raise ValueError(
                f"{len(state.tokens) + len(token_ids)} tokens exceed the context of {state.cache.max_len}"
            )
        if self.prefill == "steps":
            return self._extend_by_steps(state, token_ids, on_logits)
        for s in range(0, len(token_ids), PREFILL_CHUNK):
            chunk = token_ids[s : s + PREFILL_CHUNK]
            ids = torch.tensor([chunk], device=self.device)
            h = self.model(ids, state.cache, keep_states=False)[0]
            normed = self.model.final_norm(h)
            if on_logits:
                on_logits(s, self.model.logits(normed))
            # the last row alone, as always: a batched matmul may round it differently
            logits = self.model.logits(normed[-1:])[0]
            state.commit(chunk, self.head_input(h, normed), logits)

    def _extend_by_steps(self, state: SeqState, token_ids: list[int], on_logits) -> None:
        for s in range(0, len(token_ids), STEP_ROWS):
            piece = token_ids[s : s + STEP_ROWS]
            logits, hidden = self.step(state, torch.tensor(piece, device=self.device))
            state.cache.commit(len(piece))
            if on_logits:
                on_logits(s, logits)
            state.commit(piece, hidden, logits[-1])

    @torch.inference_mode()
    def step(self, state: SeqState, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `token_ids` [T] (decode T=1, verify T=K+1) keeping per-token states.

        Returns (logits [T, V] float32, head-input hiddens [T, H]); the caller then calls
        `state.cache.commit(n)` and `state.commit(...)` with the tokens it keeps.
        """
        h = self.model(token_ids[None], state.cache, keep_states=True)[0]
        normed = self.model.final_norm(h)
        return self.model.logits(normed), self.head_input(h, normed)
