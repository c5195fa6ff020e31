"""The Python API: `LLM(model=..., device=..., dtype=..., num_speculative_tokens=K)`,
`LLM.generate(prompt_token_ids=[...], params=SamplingParams(...))` and `LLM.stream`, a generator
of one request's events. A thin layer over the engine (nextn.engine.engine): it loads the model
and tokenizer, validates the configuration once and runs the engine loop for its caller.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

from nextn.config import DEFAULT_MODEL_DIR, EngineConfig, SpecConfig
from nextn.core import RequestOutput, SamplingParams
from nextn.engine.engine import Engine, StreamEvent
from nextn.models.loader import load_model
from nextn.tokenizer import Tokenizer

DEFAULT_K_WITH_HEAD = 3

__all__ = ["LLM", "RequestError", "StreamEvent"]


class RequestError(ValueError):
    """A request the engine refuses (the engine stays usable)."""


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        num_speculative_tokens: int | None = None,
        p_min: float = 0.0,
        adaptive_k: bool = False,
        hidden_after_norm: bool = True,
        max_model_len: int = 8192,
        max_num_seqs: int = 8,
        kernels: str = "auto",
        prefill: str = "chunked",
    ):
        model_dir = Path(model) if model is not None else DEFAULT_MODEL_DIR
        self.model = load_model(model_dir, device=device, dtype=dtype)
        self.tokenizer = Tokenizer(model_dir)
        self.model_name = model_dir.name
        has_head = self.model.mtp is not None
        if num_speculative_tokens is None:
            num_speculative_tokens = DEFAULT_K_WITH_HEAD if has_head else 0
            if not has_head:
                print(f"nextn: {model_dir} has no MTP head; plain decoding (spec K=0)", file=sys.stderr)
        if num_speculative_tokens > 0 and not has_head:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} needs an MTP head; {model_dir} has none")
        spec = SpecConfig(num_speculative_tokens, p_min, adaptive_k, hidden_after_norm)
        max_len = min(max_model_len, self.model.cfg.max_position_embeddings)
        self.config = EngineConfig(str(model_dir), device, dtype, spec, max_len, max_num_seqs, kernels, prefill)
        self.engine = Engine(self.model, self.tokenizer, self.config)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.spec.num_speculative_tokens

    @property
    def stats(self):
        return self.engine.stats

    def generate(
        self,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        prompt: str | None = None,
        use_sessions: bool = False,
    ) -> RequestOutput:
        *_, last = self.stream(prompt_token_ids, params, prompt, use_sessions)
        return last.output

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise RequestError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit the context of {self.config.max_model_len}"
            )

    def prompt_ids(self, prompt_token_ids: list[int] | None, prompt: str | None, params: SamplingParams) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("give prompt_token_ids or prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = list(prompt_token_ids)
        self.check_prompt(prompt_token_ids, params)
        return prompt_token_ids

    def stream(
        self,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        prompt: str | None = None,
        use_sessions: bool = False,
        checkpoint_at: int | None = None,
    ) -> Iterator[StreamEvent]:
        """Yields one event per round; the last one carries the RequestOutput.

        checkpoint_at (sessions): where the kept rewind checkpoint goes, default the prompt end. A chat
        server passes the end of the conversation before the generation prompt: the next request
        re-renders the reply after it, and may tokenize the boundary differently (a newline merges
        with a reply that starts with one) or drop a "<think>" the generation prompt opened.
        """
        params = params or SamplingParams()
        ids = self.prompt_ids(prompt_token_ids, prompt, params)
        return self._run(self.engine.add(ids, params, use_sessions, checkpoint_at))

    def _run(self, req) -> Iterator[StreamEvent]:
        done = False
        try:
            while not done:
                for r, ev in self.engine.step():
                    if r is not req:
                        continue
                    if isinstance(ev, BaseException):
                        done = True
                        raise ev
                    done = ev.output is not None
                    yield ev
        finally:
            if not done:  # the consumer stopped early: rounds are atomic, the slot stays consistent
                self.engine.abort(req)
