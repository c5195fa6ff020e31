"""The Python API: `LLM(model=..., device=..., dtype=..., num_speculative_tokens=K)` and
`LLM.generate(prompt_token_ids=[...], params=SamplingParams(...))`, plus `LLM.stream`, the
per-round generator the server interleaves. Owns the model, tokenizer, kept sessions and the
aggregated spec counters; one request at a time per LLM (callers serialise).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from nextn.config import DEFAULT_MODEL_DIR, EngineConfig, SpecConfig
from nextn.core import RequestOutput, SamplingParams, SpecStats
from nextn.engine.fast import build_engine
from nextn.engine.generate import run_rounds
from nextn.engine.sessions import SessionStore
from nextn.engine.stops import StopStrings
from nextn.models.loader import load_model
from nextn.sampling import token_logprobs, top_logprobs
from nextn.tokenizer import IncrementalDecoder, Tokenizer

DEFAULT_K_WITH_HEAD = 3


class RequestError(ValueError):
    """A request the engine refuses (the engine stays usable)."""


@dataclass
class StreamEvent:
    token_ids: list[int]  # new tokens of this round
    text: str  # their text delta (incomplete UTF-8 held back)
    output: RequestOutput | None  # set on the last event
    logprobs: list[dict] | None = None  # entries of this round's tokens when params.logprobs is set


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
        session_memory_gb: float = 1.0,
        kernels: str = "torch",
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
        self.config = EngineConfig(str(model_dir), device, dtype, spec, max_len, session_memory_gb, kernels, prefill)
        # kernels="triton": Triton step kernels in CUDA graphs (nextn.engine.fast); raises if they cannot run
        self.runner, self.proposer = build_engine(self.model, spec, kernels, prefill=prefill)
        self.stop_ids = set(self.model.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.stop_ids.add(self.tokenizer.eos_token_id)
        self.sessions = SessionStore(int(session_memory_gb * 2**30))
        self.stats = SpecStats()

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.spec.num_speculative_tokens

    def generate(self, prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
                 prompt: str | None = None, use_sessions: bool = False) -> RequestOutput:
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

    def stream(self, prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
               prompt: str | None = None, use_sessions: bool = False,
               checkpoint_at: int | None = None) -> Iterator[StreamEvent]:
        """Yields one event per round; the last one carries the RequestOutput.

        checkpoint_at (sessions): where the kept rewind checkpoint goes, default the prompt end. A chat
        server passes the end of the conversation before the generation prompt: the next request
        re-renders the reply after it, and may tokenize the boundary differently (a newline merges
        with a reply that starts with one) or drop a "<think>" the generation prompt opened.
        """
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("give prompt_token_ids or prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = list(prompt_token_ids)
        self.check_prompt(prompt_token_ids, params)
        return self._stream(prompt_token_ids, params, use_sessions, checkpoint_at)

    def _stream(self, prompt_ids: list[int], params: SamplingParams, use_sessions: bool,
                checkpoint_at: int | None) -> Iterator[StreamEvent]:
        t0 = time.perf_counter()
        # prompt logprobs need the logits of every prompt row: prefill cold
        reuse = use_sessions and params.prompt_logprobs is None
        state, cached = self.sessions.acquire(prompt_ids) if reuse else (None, 0)
        if state is None:
            state = self.runner.new_state(self.config.max_model_len)
        consistent = False  # keep the state only if it ends between rounds
        try:
            split = len(prompt_ids) if checkpoint_at is None else min(max(checkpoint_at, cached), len(prompt_ids))
            prompt_logprobs = self._prefill(state, prompt_ids, cached, split, params.prompt_logprobs, use_sessions)
            _sync(self.runner.device)
            t1 = time.perf_counter()
            stats = SpecStats()
            decoder = IncrementalDecoder(self.tokenizer)
            token_ids: list[int] = []
            logprobs: list[dict] | None = [] if params.logprobs is not None else None
            rounds = run_rounds(self.runner, self.proposer, state, params, self.config.spec,
                                set() if params.ignore_eos else self.stop_ids | set(params.stop_token_ids),
                                stats, want_logits=logprobs is not None)
            stops = StopStrings(params.stop)
            released = 0  # characters of text handed out so far
            for ev in rounds:
                round_ids, finish_reason = ev.token_ids, ev.finish_reason
                text = stops.push(decoder.push(round_ids))
                if stops.hit is not None:  # keep tokens up to the one completing the stop string
                    round_ids = round_ids[: _num_covering(self.tokenizer, token_ids, round_ids, stops.hit)]
                    finish_reason = "stop"
                    rounds.close()  # between rounds: the state stays consistent
                token_ids.extend(round_ids)
                entries = None
                if logprobs is not None:
                    entries = _logprob_entries(ev.logprob_rows, round_ids, params.logprobs) if round_ids else []
                    logprobs.extend(entries)
                if finish_reason is None:
                    released += len(text)
                    yield StreamEvent(round_ids, text, None, entries)
                    continue
                _sync(self.runner.device)
                t2 = time.perf_counter()
                self.stats.merge(stats)
                final_text = stops.text if stops.hit is not None else self.tokenizer.decode(token_ids)
                output = RequestOutput(
                    token_ids=token_ids, text=final_text, finish_reason=finish_reason,
                    prompt_tokens=len(prompt_ids), cached_tokens=cached, spec=stats,
                    prefill_seconds=t1 - t0, decode_seconds=t2 - t1, logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                )
                consistent = True
                # the last delta also carries text held back (a stop-string prefix, split UTF-8)
                yield StreamEvent(round_ids, final_text[released:], output, entries)
                return
        except GeneratorExit:  # the consumer stopped early (client disconnect): rounds are atomic
            consistent = True
            raise
        finally:
            if use_sessions and consistent:
                self.sessions.release(state)

    def _prefill(self, state, prompt_ids: list[int], cached: int, split: int, num_top: int | None,
                 checkpoint: bool) -> list[dict | None] | None:
        """Run prompt_ids[cached:], keeping a checkpoint after prompt_ids[:split] if asked.

        With num_top (then cached is 0), return the prompt logprobs, None for the first token.
        """
        entries: list[dict | None] = [None]  # the first prompt token has no prediction

        def take(start: int, rows: torch.Tensor) -> None:  # rows[i] predicts prompt_ids[start + i + 1]
            targets = prompt_ids[start + 1 : start + 1 + rows.shape[0]]
            if targets:
                entries.extend(_logprob_entries(rows, targets, num_top))

        def extend(lo: int, hi: int) -> None:
            if hi > lo:
                on_logits = None if num_top is None else (lambda start, rows: take(lo + start, rows))
                self.runner.extend(state, prompt_ids[lo:hi], on_logits=on_logits)

        extend(cached, split)
        if checkpoint:
            state.make_checkpoint()
        extend(split, len(prompt_ids))
        return entries if num_top is not None else None


def _num_covering(tokenizer, prior_ids: list[int], round_ids: list[int], text_len: int) -> int:
    """How many of `round_ids` it takes for the decoded text to reach `text_len` characters."""
    for n in range(1, len(round_ids)):
        if len(tokenizer.decode(prior_ids + round_ids[:n])) >= text_len:
            return n
    return len(round_ids)


def _logprob_entries(rows: torch.Tensor, ids: list[int], n: int) -> list[dict]:
    rows = rows[: len(ids)]
    chosen = token_logprobs(rows, torch.tensor(ids, device=rows.device)).tolist()
    top = top_logprobs(rows, n) if n > 0 else None
    entries = []
    for i, (tok, lp) in enumerate(zip(ids, chosen)):
        tops = list(zip(top.ids[i].tolist(), top.logprobs[i].tolist())) if top is not None else []
        entries.append({"token_id": tok, "logprob": lp, "top_logprobs": tops})
    return entries


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
