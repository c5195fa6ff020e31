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

import dataclasses
import logging
import operator
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from nextn.config import DEFAULT_MAX_MODEL_LEN, resolve_device, resolve_dtype
from nextn.config.engine_args import DEFAULT_K_WITH_HEAD, EngineArgs
from nextn.config.model import ModelConfig, read_generation_config
from nextn.core import (
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
from nextn.models.loader import load_model, model_config
from nextn.models.random_weights import preset_config, random_model
from nextn.parallel.launch import RankError, Ranks, check_ranks, initialized, rank, rank_device, start
from nextn.spec.draft_vocab import DraftVocab, load_draft_vocab
from nextn.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

# the roles a chat message may have (OpenAI's; "developer" is rendered as "system"): LLM.chat's and the server's
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

__all__ = ["CHAT_ROLES", "LLM", "RequestError", "StreamEvent", "template_role"]


class LLM:
    def __init__(self, model: str | Path | None = None, **settings):
        """model: a checkpoint directory, a Hugging Face hub id, or None for the bundled model.
        settings: the engine's, EngineArgs' fields (nextn.config.engine_args; docs/flags.md lists them
        with their flags), validated before any download or weight is read. The main ones:
        num_speculative_tokens (or vLLM's speculative_config={"method": "mtp",
        "num_speculative_tokens": K}; without either K is 3 with an MTP head, 0 without one); device
        and dtype ("auto": cuda when available; the checkpoint's dtype on CUDA, float32 on the CPU);
        max_model_len, max_num_seqs, gpu_memory_utilization; quantization / kv_cache_dtype "fp8";
        prefill "chunked" or "steps" and enable_prefix_caching; random_weights (a released shape's
        preset with random weights, beside a `tokenizer` directory); tensor_parallel_size N > 1 (the
        model sharded over N processes started here, rank r on cuda:r, `close()` stops them; in a
        process that already belongs to a group of N, torchrun's, this rank's share); k_policy "fixed"
        (every round at K: the Python API's default) or "auto" (serve's and generate's).
        LLM.from_args(EngineArgs(...)) takes the settings as one object."""
        self._start(EngineArgs.of(model=model, **settings))

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLM:
        """The LLM of settings already made (and checked): `nextn generate`'s, the server's core's."""
        llm = cls.__new__(cls)
        llm._start(args)
        return llm

    def _start(self, args: EngineArgs) -> None:
        self.args = args
        device = resolve_device(args.device)  # before a download: a CUDA request on a CPU torch fails at once
        model_dir = (
            None if args.random_weights is not None else resolve_model(args.model, args.revision, args.download_dir)
        )
        self._boxes: dict[int, deque] = {}
        self._abandoned: list = []  # streams dropped before their first event (see stream)
        self._ranks = _start_ranks(args, device, model_dir)
        try:
            self._load(model_dir, rank_device(device))
        except BaseException:
            self.close()
            raise

    def _load(self, model_dir: Path | None, device: str) -> None:
        """The tokenizer, this rank's model and the engine (with the other ranks ready, if it started them).
        model_dir None: the random_weights preset's model."""
        args = self.args
        preset = args.random_weights
        # the engine config's `model` is the directory the tokenizer comes from: a server's API process
        # reads it there (nextn.engine.core.model_facts)
        tokenizer_dir = model_dir if args.tokenizer is None else Path(args.tokenizer)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        # checked before the weights load: the vocabulary, the context, the draft vocabulary
        cfg = _model_config(model_dir, preset)
        source = f"the {preset} preset" if preset is not None else str(model_dir)
        if args.tokenizer is not None and self.tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer_dir} has {self.tokenizer.vocab_size} tokens, more than the "
                f"vocab_size {cfg.vocab_size} of {source}"
            )
        limit_where = source if preset is not None or model_dir.is_file() else model_dir / "config.json"
        max_len = _max_model_len(args.max_model_len, cfg.max_position_embeddings, limit_where)
        draft_vocab = (
            None if args.draft_vocab is None else _draft_vocab(args.draft_vocab, cfg.vocab_size, self.tokenizer)
        )
        dtype = resolve_dtype(args.dtype, device, cfg.dtype)  # what load_model resolves it to (presets: bfloat16)
        # the configuration checked again before the weights load (K provisional while no head is known)
        args.engine_config(tokenizer_dir, device, dtype, None, draft_vocab, max_len)
        tp = (rank(), args.tensor_parallel_size)
        if preset is not None:  # drawn on the device (seconds, even for the large shapes)
            self.model = random_model(preset, device, dtype, quantization=args.quantization, tp=tp)
            self.model_name, self.sampling_defaults = preset, {}
        else:
            self.model = load_model(model_dir, device=device, dtype=dtype, quantization=args.quantization, tp=tp)
            # the model as the user gave it (vLLM's served name): a client loads the tokenizer from that path
            self.model_name = str(args.model) if args.model is not None else model_dir.name
            self.sampling_defaults = _read_sampling_defaults(
                model_dir, args.generation_config, args.override_generation_config
            )
        has_head, k = self.model.mtp is not None, args.k
        if k is None:
            k = DEFAULT_K_WITH_HEAD if has_head else 0
            if not has_head:
                log.warning("%s has no MTP head; plain decoding (spec K=0)", source)
        if k > 0 and not has_head:
            raise ValueError(f"num_speculative_tokens={k} needs an MTP head; {source} has none")
        self.config = args.engine_config(tokenizer_dir, device, dtype, k, draft_vocab, max_len)
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


def _start_ranks(args: EngineArgs, device: str, model_dir: Path | None) -> Ranks | None:
    """Under tensor parallelism, from a process of its own: the other ranks, started (this process
    becomes rank 0) after the checks that need no process (a size the devices or the heads refuse)."""
    size = args.tensor_parallel_size
    check_ranks(size, device)
    if size == 1 or initialized():
        return None
    _model_config(model_dir, args.random_weights).shard(0, size)
    model = None if model_dir is None else str(model_dir)
    return start(size, device, _follow, dataclasses.replace(args, model=model, device=device))


def _model_config(model_dir: Path | None, preset: str | None) -> ModelConfig:
    """The whole model's config: the random-weight preset's, else the checkpoint's."""
    return preset_config(preset) if preset is not None else model_config(model_dir)


def _follow(conn, args: EngineArgs) -> None:
    """A follower rank (nextn.parallel.launch): its LLM, a word to rank 0, then its engine's loop."""
    try:
        llm = LLM.from_args(args)
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


def _draft_vocab(draft_vocab: str | Path | DraftVocab, vocab_size: int, tokenizer: Tokenizer) -> DraftVocab:
    """A draft vocabulary file loaded (or a DraftVocab), checked against the checkpoint."""
    if isinstance(draft_vocab, str | Path):
        return load_draft_vocab(draft_vocab, vocab_size, tokenizer)
    draft_vocab.check(vocab_size, tokenizer)
    return draft_vocab


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
