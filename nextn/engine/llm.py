"""The Python API, shaped like vLLM's: `LLM(model, speculative_config={"method": "mtp",
"num_speculative_tokens": K})`, `LLM.generate(prompts, sampling_params)` (one output per prompt,
each with `.outputs[0].text` / `.outputs[0].token_ids`), `LLM.chat(messages)`; and nextn's own
single-request forms, `LLM.generate(prompt_token_ids=[...], params=SamplingParams(...))` and
`LLM.stream`, a generator of one request's events.

A thin layer over the engine (nextn.engine.engine): it finds the model (a directory or a hub id),
loads it and its tokenizer (or draws a random-weight preset's weights, beside a tokenizer directory
given), resolves device and dtype "auto", reads the checkpoint's sampling defaults
(generation_config.json), validates the configuration once and runs the engine loop for its caller.
It does not schedule: a batch of prompts goes to the engine at once, and the engine decides how
they share it.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from nextn.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_MODEL_LEN,
    EngineConfig,
    SpecConfig,
    check_kernels,
    check_kv_cache_dtype,
    check_quantization,
    resolve_device,
    resolve_dtype,
)
from nextn.core import (
    GENERATION_CONFIG_KEYS,
    RequestError,
    RequestOutput,
    SamplingParams,
    sampling_defaults,
    vllm_logprobs,
    with_defaults,
)
from nextn.engine.engine import Engine, StreamEvent
from nextn.engine.replica import Leader, follow
from nextn.hub import resolve_model
from nextn.model_config import ModelConfig, read_generation_config
from nextn.models.loader import load_model
from nextn.models.random_weights import preset_config, random_model
from nextn.parallel.launch import RankError, Ranks, check_ranks, initialized, rank, rank_device, start
from nextn.spec.draft_vocab import DraftVocab, load_draft_vocab
from nextn.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_K_WITH_HEAD = 3
# speculative_config "method" values that mean the checkpoint's own MTP head (vLLM's names)
MTP_METHODS = ("mtp", "qwen3_next_mtp")
# the roles a chat message may have (OpenAI's; "developer" is rendered as "system"): LLM.chat's and the server's
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

__all__ = ["CHAT_ROLES", "LLM", "RequestError", "StreamEvent", "template_role"]


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        device: str = "auto",
        dtype: str = "auto",
        num_speculative_tokens: int | None = None,
        p_min: float = 0.0,
        adaptive_k: bool = False,
        hidden_after_norm: bool = True,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        kernels: str = "auto",
        prefill: str = "chunked",
        max_num_batched_tokens: int | None = None,
        speculative_config: dict | None = None,
        quantization: str | None = None,
        draft_vocab: str | Path | DraftVocab | None = None,
        grammar_draft_mask: bool = True,
        tensor_parallel_size: int = 1,
        trace: bool = False,
        kv_cache_dtype: str = "auto",
        k_policy: str = "fixed",
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        random_weights: str | None = None,
        tokenizer: str | Path | None = None,
        seed: int | None = None,
        enforce_eager: bool = False,
        generation_config: str = "auto",
        override_generation_config: dict | None = None,
        revision: str | None = None,
        download_dir: str | None = None,
        enable_prefix_caching: bool | None = None,
        prefix_block_size: int | None = None,
        prefix_cache_gb: float | None = None,
    ):
        """model: a checkpoint directory, a Hugging Face hub id, or None for the bundled model.
        random_weights: instead of a checkpoint (model None), a preset of a released shape
        (nextn.models.random_weights.PRESETS, e.g. "qwen3.5-9b") with random weights drawn on the
        device (MTP head included; bfloat16 on CUDA under dtype "auto"); it needs `tokenizer`.
        tokenizer: a directory with a tokenizer.json (and tokenizer_config.json: eos token, chat
        template) used instead of the checkpoint's; its vocabulary must fit the model's vocab_size.
        device "auto": cuda when available; dtype "auto": the checkpoint's on CUDA, float32 on CPU.
        max_model_len: tokens per sequence, at most the checkpoint's max_position_embeddings (None:
        DEFAULT_MAX_MODEL_LEN, 8192, or the checkpoint's own if that is less).
        speculative_config (vLLM's): {"method": "mtp", "num_speculative_tokens": K}, the same as
        num_speculative_tokens=K; without either, K is 3 with an MTP head and 0 without one.
        quantization "fp8": a bf16 checkpoint's weights quantized at load (FP8 checkpoints load as
        they are). draft_vocab: a file from `nextn draft-vocab` (or a DraftVocab): the head drafts
        over those tokens only (checked against this checkpoint's vocabulary and tokenizer).
        grammar_draft_mask: under structured outputs, the head drafts from grammar-masked logits
        (off: only the verify is masked; the output is the same, the acceptance lower).
        tensor_parallel_size N > 1: the model sharded over N processes (rank r on cuda:r), started
        here (this process is rank 0; `close()` stops the others), or, in a process that already
        belongs to a group of N (torchrun), this rank's share: every rank then makes the same calls.
        trace: each output's `rounds` holds a record per verify round (K, drafts, accepted, the
        wall time of its draft, verify and commit); rounds then run one at a time.
        kv_cache_dtype "fp8": the attention layers' K/V cache in e4m3 with per-row scales.
        k_policy "fixed" (the Python API's default): every round at K; "auto" (serve's and generate's
        default): each step's K chosen for the batch's tokens/s, 0..K (nextn.spec.k_policy).
        gpu_memory_utilization (vLLM's): the fraction of the GPU's memory nextn may use (weights,
        cache, activations, graphs); max_num_seqs None: as many sequences as fit it, up to 256
        (nextn.engine.memory); on the CPU 8, and this does not apply.
        vLLM's too: seed, the engine's default seeds (a sampled request without its own seed takes the
        next of a sequence drawn from it, so the same requests in the same order repeat; None: fresh
        ones); enforce_eager, no CUDA graphs; generation_config "auto" (the checkpoint's
        generation_config.json sampling defaults), "vllm" (none: SamplingParams' own) or a directory
        holding a generation_config.json; override_generation_config, values over those defaults
        (vLLM's names: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens, ...);
        revision and download_dir, for a hub id (huggingface_hub's revision and cache_dir).
        enable_prefix_caching (vLLM's): requests share the state of the prompt blocks they start with
        (nextn.cache.prefix); None: on where it is exact, prefill "steps" (a cached prefix then
        changes nothing a request emits), off under "chunked", where True is an error.
        prefix_block_size: tokens per cached block (default 128 on the CPU, 256 on a GPU);
        prefix_cache_gb: what the cache may hold (default a tenth of the engine's memory budget)."""
        settings = {name: value for name, value in locals().items() if name != "self"}
        k = _speculative_tokens(num_speculative_tokens, speculative_config)
        check_quantization(quantization)
        check_kv_cache_dtype(kv_cache_dtype)  # before the weights load
        _check_weights_source(model, random_weights, tokenizer)
        device = resolve_device(device)  # before a download: a CUDA request on a CPU torch fails at once
        check_kernels(kernels, device)
        # every setting checked before a download or a weight is read: K and the context provisional
        # (the checkpoint's head and limit are known later), a draft vocabulary file not yet read
        vocab = DraftVocab((0,)) if isinstance(draft_vocab, str | Path) else draft_vocab
        dtype_name = resolve_dtype(dtype, device, None)
        _engine_config(model, device, dtype_name, DEFAULT_K_WITH_HEAD if k is None else k, settings, vocab)
        _check_generation_config(generation_config, override_generation_config)
        model_dir = None if random_weights is not None else resolve_model(model, revision, download_dir)
        self._boxes: dict[int, deque] = {}
        self._abandoned: list = []  # streams dropped before their first event (see stream)
        self._ranks = _start_ranks(tensor_parallel_size, device, model_dir, settings)
        try:
            self._load(model, model_dir, rank_device(device), dtype, k, settings)
        except BaseException:
            self.close()
            raise

    def _load(self, model, model_dir: Path | None, device: str, dtype: str, k: int | None, settings: dict) -> None:
        """The tokenizer, this rank's model and the engine (with the other ranks ready, if it started them).
        model_dir None: the random_weights preset's model."""
        s = settings
        tp, quantization, draft_vocab = s["tensor_parallel_size"], s["quantization"], s["draft_vocab"]
        preset = s["random_weights"]
        # the engine config's `model` is the directory the tokenizer comes from: a server's API process
        # reads it there (nextn.engine.core.model_facts)
        tokenizer_dir = model_dir if s["tokenizer"] is None else Path(s["tokenizer"])
        self.tokenizer = Tokenizer(tokenizer_dir)
        # checked before the weights load: the vocabulary, the context, the draft vocabulary
        cfg = _model_config(model_dir, preset)
        source = f"the {preset} preset" if preset is not None else str(model_dir)
        if s["tokenizer"] is not None and self.tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer_dir} has {self.tokenizer.vocab_size} tokens, more than the "
                f"vocab_size {cfg.vocab_size} of {source}"
            )
        limit_where = source if preset is not None else model_dir / "config.json"
        max_len = _max_model_len(s["max_model_len"], cfg.max_position_embeddings, limit_where)
        if draft_vocab is not None:
            draft_vocab = _draft_vocab(draft_vocab, cfg.vocab_size, self.tokenizer)
        dtype = resolve_dtype(dtype, device, cfg.dtype)  # what load_model resolves it to (presets: bfloat16)
        # the configuration checked again before the weights load (K provisional while no head is known)
        _engine_config(tokenizer_dir, device, dtype, DEFAULT_K_WITH_HEAD if k is None else k, s, draft_vocab, max_len)
        if preset is not None:  # drawn on the device (seconds, even for the large shapes)
            self.model = random_model(preset, device, dtype, quantization=quantization, tp=(rank(), tp))
            self.model_name, self.sampling_defaults = preset, {}
        else:
            self.model = load_model(model_dir, device=device, dtype=dtype, quantization=quantization, tp=(rank(), tp))
            # the model as the user gave it (vLLM's served name): a client loads the tokenizer from that path
            self.model_name = str(model) if model is not None else model_dir.name
            self.sampling_defaults = _read_sampling_defaults(
                model_dir, s["generation_config"], s["override_generation_config"]
            )
        has_head = self.model.mtp is not None
        if k is None:
            k = DEFAULT_K_WITH_HEAD if has_head else 0
            if not has_head:
                log.warning("%s has no MTP head; plain decoding (spec K=0)", source)
        if k > 0 and not has_head:
            raise ValueError(f"num_speculative_tokens={k} needs an MTP head; {source} has none")
        self.config = _engine_config(tokenizer_dir, device, dtype, k, s, draft_vocab, max_len)
        leader = None if self._ranks is None else Leader(self._ranks)
        self.engine = Engine(self.model, self.tokenizer, self.config, leader)
        self.config = self.engine.config  # max_num_seqs resolved
        log.info(self.engine.pool.describe())
        if self._ranks is not None:
            failed = [f"rank {r}: {m}" for r, m in enumerate(self._ranks.receive(), start=1) if m != _READY]
            if failed:
                raise RankError(f"tensor-parallel {'; '.join(failed)}")

    def close(self) -> None:
        """Stop the tensor-parallel ranks this LLM started (nothing to do on one rank)."""
        if getattr(self, "_ranks", None) is not None:
            _drop_graphs(getattr(self, "engine", None))
            self._ranks.close()

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.spec.num_speculative_tokens

    @property
    def stats(self):
        return self.engine.stats

    def default_sampling_params(self, **request) -> SamplingParams:
        """SamplingParams of a request: its own values (None = not given) over the checkpoint's
        generation_config.json defaults over SamplingParams' own."""
        return with_defaults(self.sampling_defaults, **request)

    # --- vLLM's API

    def generate(
        self,
        prompts=None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        prompt: str | None = None,
        use_sessions: bool = False,
        use_tqdm: bool | Callable = True,
    ) -> list[RequestOutput] | RequestOutput:
        """vLLM's form: `prompts` a str, a list of str, or a list of token-id lists (or vLLM's
        {"prompt": ...} / {"prompt_token_ids": ...} dicts); `sampling_params` one for all or one
        per prompt (default: the checkpoint's defaults). Returns one RequestOutput per prompt, in
        prompt order.

        nextn's single-request form: `prompt_token_ids=[...]` (or a flat list of ids as `prompts`)
        or `prompt="..."`, with `params=` or `sampling_params=`; returns that one RequestOutput.

        `SamplingParams(structured_outputs=...)` constrains a request to a grammar (nextn.grammar);
        one that does not compile is a ValueError naming the reason, before anything runs.
        use_tqdm (vLLM's): a progress bar over the prompts finished (the form with prompts only; a
        callable: the tqdm class to use)."""
        if params is not None:
            if sampling_params is not None:
                raise TypeError("give sampling_params or params, not both")
            sampling_params = params
        single = prompts is None or _is_token_ids(prompts)
        if single:
            if prompts is not None:
                if prompt_token_ids is not None:
                    raise TypeError("give the prompt token ids once")
                prompt_token_ids = prompts
            if isinstance(sampling_params, Sequence):
                raise TypeError("one prompt takes one SamplingParams")
            *_, last = self.stream(prompt_token_ids, sampling_params, prompt, use_sessions)
            return last.output
        if prompt_token_ids is not None or prompt is not None:
            raise TypeError("give prompts, or prompt_token_ids / prompt, not both")
        texts, ids = self._prompts(prompts)
        params = self._params_per_prompt(sampling_params, len(ids))
        return self._generate_all(texts, ids, params, use_sessions, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool | Callable = True,
    ) -> list[RequestOutput]:
        """vLLM's `chat`: one conversation (a list of {"role", "content"} messages) or a list of
        them, rendered with the checkpoint's chat template; one RequestOutput per conversation. A
        role outside CHAT_ROLES is refused; "developer" is rendered as "system", as the server does."""
        batch = not (messages and isinstance(messages[0], dict))
        conversations = messages if batch else [messages]
        conversations = [
            _template_messages(c, f"messages[{n}]" if batch else "messages") for n, c in enumerate(conversations)
        ]
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, **kwargs) for c in conversations]
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm)

    def get_tokenizer(self) -> Tokenizer:
        """vLLM's: the tokenizer (encode, decode, apply_chat_template)."""
        return self.tokenizer

    def _finished(self, out: RequestOutput, prompt: str | None, ids: list[int]) -> RequestOutput:
        """A finished output with its prompt, and its logprobs as vLLM's Logprob objects too."""
        out.prompt, out.prompt_token_ids = prompt, ids
        if out.logprobs is not None:
            out.sample_logprobs = vllm_logprobs(out.logprobs, lambda t: self.tokenizer.decode([t]))
        return out

    # --- one request

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt(prompt_token_ids, params, self.model.cfg.vocab_size, self.config.max_model_len)

    def check_params(self, params: SamplingParams) -> None:
        check_params(params, self.model.cfg.vocab_size)

    def prompt_ids(self, prompt_token_ids: list[int] | None, prompt: str | None, params: SamplingParams) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("give prompt_token_ids or prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = _as_ints(prompt_token_ids)
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

        params None: the checkpoint's defaults (`default_sampling_params()`).
        checkpoint_at (sessions): where the kept rewind checkpoint goes, default the prompt end. A chat
        server passes the end of the conversation before the generation prompt: the next request
        re-renders the reply after it, and may tokenize the boundary differently (a newline merges
        with a reply that starts with one) or drop a "<think>" the generation prompt opened.
        """
        params = params or self.default_sampling_params()
        ids = self.prompt_ids(prompt_token_ids, prompt, params)
        req = self._add(ids, params, use_sessions, checkpoint_at)
        events = self._run(req, prompt, ids)
        # a stream dropped unstarted never runs _run's cleanup: its request would hold a slot and
        # gather events; the next engine step aborts it (marked here, not aborted inside the GC)
        weakref.finalize(events, self._abandoned.append, req)
        return events

    def _run(self, req, prompt: str | None, ids: list[int]) -> Iterator[StreamEvent]:
        done = False
        try:
            while not done:
                ev = self._next_event(req)
                if isinstance(ev, BaseException):
                    done = True
                    raise ev
                if ev.output is not None:
                    done = True
                    self._finished(ev.output, prompt, ids)
                yield ev
        finally:
            self._boxes.pop(req.request_id, None)
            if not done:  # the consumer stopped early: rounds are atomic, the slot stays consistent
                self.engine.abort(req)

    # --- the engine loop, shared by every open caller: any caller's engine step (a stream,
    # generate) advances every request, so each event goes to its request's box in self._boxes
    # (request id -> its events not yet taken): open streams interleave with each other and with
    # generate, none losing its events

    @classmethod
    def of_engine(cls, engine: Engine) -> LLM:
        """An LLM over an engine built elsewhere (tests drive a hand-made engine through its loops)."""
        llm = cls.__new__(cls)
        llm._ranks, llm._boxes, llm._abandoned = None, {}, []
        llm.engine, llm.config, llm.tokenizer, llm.model = engine, engine.config, engine.tokenizer, engine.model
        return llm

    def _add(self, ids: list[int], params: SamplingParams, use_sessions: bool, checkpoint_at: int | None = None):
        req = self.engine.add(ids, params, use_sessions, checkpoint_at)
        self._boxes[req.request_id] = deque()
        return req

    def _next_event(self, req) -> StreamEvent | BaseException:
        """The request's next event, stepping the engine until there is one."""
        box = self._boxes[req.request_id]
        while not box:
            while self._abandoned:  # streams dropped unstarted (their boxes still here)
                gone = self._abandoned.pop()
                if self._boxes.pop(gone.request_id, None) is not None:
                    self.engine.abort(gone)
            if not self.engine.has_work:  # (its last event was taken: no step would bring another)
                raise RuntimeError(f"request {req.request_id} is no longer in the engine")
            for r, ev in self.engine.step():
                if r.request_id in self._boxes:  # else nobody waits for it (aborted)
                    self._boxes[r.request_id].append(ev)
        return box.popleft()

    # --- many requests

    def _prompts(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        """vLLM's prompt forms -> (texts, token ids) per prompt."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        texts, ids = [], []
        for p in prompts:
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    p = p["prompt_token_ids"]
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise RequestError(f"a prompt dict holds 'prompt' or 'prompt_token_ids', got {sorted(p)}")
            if isinstance(p, str):
                texts.append(p)
                ids.append(self.tokenizer.encode(p))
            elif _is_token_ids(p) or (isinstance(p, list | tuple) and not p):  # empty: check_prompt names it
                texts.append(None)
                ids.append(_as_ints(p))
            else:
                raise RequestError(f"a prompt is a str or a list of token ids, got {type(p).__name__}")
        return texts, ids

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
        return sampling_params

    def _generate_all(self, texts, ids, params, use_sessions: bool, use_tqdm=False) -> list[RequestOutput]:
        """Every request is added before the first step, so the engine runs them together."""
        bar = (use_tqdm if callable(use_tqdm) else tqdm)(
            total=len(ids), desc="Processed prompts", unit="prompt", disable=use_tqdm is False
        )
        for p, sp in zip(ids, params, strict=True):
            self.check_prompt(p, sp)
        reqs, outputs = [], [None] * len(ids)
        try:
            for p, sp in zip(ids, params, strict=True):  # a bad grammar raises here: the ones added are aborted
                reqs.append(self._add(p, sp, use_sessions))
            for i, req in enumerate(reqs):  # the steps run for one advance them all
                while outputs[i] is None:
                    ev = self._next_event(req)
                    if isinstance(ev, BaseException):
                        raise ev
                    if ev.output is not None:
                        outputs[i] = self._finished(ev.output, texts[i], ids[i])
                        bar.update(1)
        finally:
            bar.close()
            for req, out in zip(reqs, outputs, strict=False):
                self._boxes.pop(req.request_id, None)
                if out is None:
                    self.engine.abort(req)
        return outputs


_READY = "ready"


def _start_ranks(size: int, device: str, model_dir: Path | None, settings: dict) -> Ranks | None:
    """Under tensor parallelism, from a process of its own: the other ranks, started (this process
    becomes rank 0) after the checks that need no process (a size the devices or the heads refuse)."""
    check_ranks(size, device)
    if size == 1 or initialized():
        return None
    _model_config(model_dir, settings["random_weights"]).shard(0, size)
    model = None if model_dir is None else str(model_dir)
    return start(size, device, _follow, {**settings, "model": model, "device": device})


def _check_weights_source(model, random_weights: str | None, tokenizer: str | Path | None) -> None:
    """A checkpoint or a random-weight preset, not both; a preset known and given a tokenizer; a
    tokenizer directory that holds a tokenizer.json (before any download or weight)."""
    if random_weights is not None:
        if model is not None:
            raise ValueError(
                f"random_weights={random_weights!r} replaces the checkpoint: give it or a model ({model}), not both"
            )
        preset_config(random_weights)  # an unknown preset names the known ones
        if tokenizer is None:
            raise ValueError(
                f"random_weights={random_weights!r} needs a tokenizer: a directory with tokenizer.json "
                "(--tokenizer DIR; bench/qwen_tokenizer.py writes Qwen3.5's)"
            )
    if tokenizer is not None and not (Path(tokenizer) / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer {tokenizer}: no tokenizer.json there (give the directory that holds it)")


def _model_config(model_dir: Path | None, preset: str | None) -> ModelConfig:
    """The whole model's config: the random-weight preset's, else the checkpoint's."""
    return preset_config(preset) if preset is not None else ModelConfig.from_hf(model_dir)


def _follow(conn, settings: dict) -> None:
    """A follower rank (nextn.parallel.launch): its LLM, a word to rank 0, then its engine's loop."""
    try:
        llm = LLM(**settings)
    except Exception as e:
        conn.send(f"{type(e).__name__}: {' '.join(str(e).split())}")
        return
    conn.send(_READY)
    follow(llm.engine, conn)
    _drop_graphs(llm.engine)


def _drop_graphs(engine) -> None:
    """Before a rank leaves its process group: its CUDA graphs, whose captured NCCL work keeps the
    communicator from being destroyed (destroy_process_group would wait for them forever: runs 33-35)."""
    if engine is not None and engine.runner.use_graphs:
        engine.runner.drop_graphs()


def check_prompt(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """A prompt (and its params) against a model's vocabulary and context: LLM's check and the server's."""
    if not prompt_token_ids:
        raise RequestError("the prompt is empty")
    bad = [t for t in prompt_token_ids if _token_id(t) is None]
    if bad:
        raise RequestError(f"prompt token ids must be integers, got {bad[:5]}")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(prompt_token_ids) >= max_model_len:
        raise RequestError(f"prompt of {len(prompt_token_ids)} tokens does not fit the context of {max_model_len}")
    check_params(params, vocab_size)


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: its token ids against the model's vocabulary (a stop
    id past it could never fire)."""
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise RequestError(f"stop_token_ids out of range [0, {vocab_size}): {bad[:5]}")


def template_role(role, where: str) -> str:
    """A chat message's role as the chat template takes it: one of CHAT_ROLES, "developer" (OpenAI's
    newer name) as "system"; any other is a RequestError naming `where` (LLM.chat's and the server's)."""
    if role not in CHAT_ROLES:
        shown = repr(role[:50] if isinstance(role, str) else role)
        raise RequestError(f"{where}: unknown role {shown}; expected one of {', '.join(CHAT_ROLES)}")
    return "system" if role == "developer" else role


def _template_messages(conversation: list[dict], where: str) -> list[dict]:
    """A conversation's messages as the chat template takes them (template_role)."""
    return [
        {**m, "role": template_role(m.get("role") if isinstance(m, dict) else None, f"{where}[{i}]")}
        for i, m in enumerate(conversation)
    ]


def _max_model_len(max_model_len: int | None, limit: int, where) -> int:
    """max_model_len, or its default, within the checkpoint's max_position_embeddings (read from `where`)."""
    if max_model_len is None:
        return min(DEFAULT_MAX_MODEL_LEN, limit)
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} is more than the checkpoint supports: max_position_embeddings "
            f"{limit} in {where}"
        )
    return max_model_len


def _engine_config(
    model, device: str, dtype: str, k: int, s: dict, draft_vocab: DraftVocab | None, max_len: int | None = None
) -> EngineConfig:
    """The engine's configuration from LLM's settings `s` (max_len None: theirs, else the default)."""
    spec = SpecConfig(
        num_speculative_tokens=k,
        p_min=s["p_min"],
        adaptive=s["adaptive_k"],
        hidden_after_norm=s["hidden_after_norm"],
        draft_vocab=draft_vocab,
        grammar_draft_mask=s["grammar_draft_mask"],
        k_policy=s["k_policy"],
    )
    if max_len is None:
        max_len = DEFAULT_MAX_MODEL_LEN if s["max_model_len"] is None else s["max_model_len"]
    return EngineConfig(
        str(model),
        device,
        dtype,
        spec,
        max_len,
        s["max_num_seqs"],
        s["kernels"],
        s["prefill"],
        s["max_num_batched_tokens"],
        quantization=s["quantization"],
        tensor_parallel_size=s["tensor_parallel_size"],
        trace=s["trace"],
        kv_cache_dtype=s["kv_cache_dtype"],
        gpu_memory_utilization=s["gpu_memory_utilization"],
        enforce_eager=s["enforce_eager"],
        seed=s["seed"],
        enable_prefix_caching=s["enable_prefix_caching"],
        prefix_block_size=s["prefix_block_size"],
        prefix_cache_gb=s["prefix_cache_gb"],
    )


def _token_id(t) -> int | None:
    """t as a token id: an integer, Python's, numpy's or a 0-d torch tensor's (what iterating an
    array of ids gives); None for anything else, a bool included."""
    if isinstance(t, bool):
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None


def _is_token_ids(x) -> bool:
    return (
        isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0 and all(_token_id(t) is not None for t in x)
    )


def _as_ints(ids) -> list:
    """A prompt's ids as Python ints; anything that is not a token id is left for check_prompt to name."""
    return [t if (i := _token_id(t)) is None else i for t in ids]


def _speculative_tokens(num_speculative_tokens: int | None, speculative_config: dict | None) -> int | None:
    """K from nextn's argument or vLLM's speculative_config (None: the default for the checkpoint)."""
    if speculative_config is None:
        return num_speculative_tokens
    cfg = dict(speculative_config)
    unknown = sorted(set(cfg) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ValueError(
            f"speculative_config keys {unknown} are not supported: nextn takes 'method' and "
            "'num_speculative_tokens' (its own draft settings are LLM arguments: p_min, adaptive_k)"
        )
    method = cfg.get("method", "mtp")
    if method not in MTP_METHODS:
        raise ValueError(f"speculative_config method {method!r}: nextn drafts with the MTP head ({MTP_METHODS})")
    k = cfg.get("num_speculative_tokens")
    if k is not None and not isinstance(k, int):
        raise ValueError(f"speculative_config num_speculative_tokens must be an integer, got {k!r}")
    if num_speculative_tokens is not None and k is not None and k != num_speculative_tokens:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} and speculative_config's {k} disagree")
    return k if k is not None else num_speculative_tokens


def _draft_vocab(draft_vocab: str | Path | DraftVocab, vocab_size: int, tokenizer: Tokenizer) -> DraftVocab:
    """A draft vocabulary file loaded (or a DraftVocab), checked against the checkpoint."""
    if isinstance(draft_vocab, str | Path):
        return load_draft_vocab(draft_vocab, vocab_size, tokenizer)
    draft_vocab.check(vocab_size, tokenizer)
    return draft_vocab


def _check_generation_config(generation_config, override: dict | None) -> None:
    """vLLM's generation_config ("auto", "vllm" or a directory) and override_generation_config (a dict)."""
    if not isinstance(generation_config, str | Path) or (
        generation_config not in ("auto", "vllm") and not (Path(generation_config) / "generation_config.json").is_file()
    ):
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a directory holding a generation_config.json, "
            f"got {generation_config!r}"
        )
    if override is not None and not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be a dict, got {override!r}")
    if override:
        unknown = sorted(set(override) - {*GENERATION_CONFIG_KEYS, "do_sample"})
        if unknown:
            raise ValueError(
                f"override_generation_config keys {unknown} are not sampling defaults nextn reads "
                f"(it takes {', '.join((*GENERATION_CONFIG_KEYS, 'do_sample'))})"
            )
        sampling_defaults(override)  # a bad value named before the load


def _read_sampling_defaults(model_dir: Path, generation_config="auto", override: dict | None = None) -> dict:
    """The sampling defaults, logged once (a request's own values win): the checkpoint's recommended
    values (generation_config "auto"), none ("vllm") or another directory's, with `override` over them."""
    source = {"vllm": None, "auto": model_dir}.get(generation_config, Path(generation_config))
    try:
        defaults = sampling_defaults(read_generation_config(source)) if source is not None else {}
    except ValueError as e:
        raise ValueError(f"{source / 'generation_config.json'}: {e}") from None
    defaults.update(sampling_defaults(override) if override else {})
    if defaults:
        shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
        log.info("sampling defaults from generation_config.json: %s (a request's own values win)", shown)
    return defaults
