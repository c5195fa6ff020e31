"""Requests -> prompt token ids and engine sampling params: model name, chat template rendering
(replayed tool-call arguments given as JSON text become objects first), tokenizing, length and
field checks, the structured-output constraint (built in structured.py). Every refusal is an
`APIError` (a 4xx naming the field); template and tokenizer failures are refused with a fixed
message, never their internal text.

A prompt too long for the context is refused on its characters before it is tokenized: a token
covers at most `max_chars_per_token` characters of (NFC-normalised) text, a bound read from the
vocabulary once. Blocking (rendering, tokenizing): the routes run these in a worker thread. Does
not know HTTP or the engine core.
"""

from __future__ import annotations

import json
import logging
import unicodedata
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from nextn.config.serve import ServerOptions
from nextn.core import RequestError, SamplingParams
from nextn.engine.llm import template_role
from nextn.engine.scheduler import common_prefix
from nextn.server import protocol as P
from nextn.server import structured
from nextn.server.chat_output import THINK_END, THINK_START, ReasoningStart, reasoning_start
from nextn.server.model import ServedModel
from nextn.server.responses import BYTE_LEVEL_ALPHABET
from nextn.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger("nextn.server")

MAX_BATCH = 64  # prompts in one (non-streamed) /v1/completions request


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def max_chars_per_token(tok: Tokenizer) -> int:
    """The most characters one token can cover: a byte-level piece covers at most its lead
    (non-continuation) bytes; any other piece (added tokens) at most its length."""
    most = 1
    for i in range(tok.vocab_size):
        piece = tok.id_to_token(i) or ""
        if all(c in BYTE_LEVEL_ALPHABET for c in piece):
            n = sum(BYTE_LEVEL_ALPHABET[c] & 0xC0 != 0x80 for c in piece)
        else:
            n = len(piece)
        most = max(most, n)
    return most


class Prompts:
    def __init__(self, model: ServedModel, model_names: tuple[str, ...], opts: ServerOptions):
        """model_names: the names served (the first is the one responses carry)."""
        self.model, self.tok, self.model_names = model, model.tokenizer, tuple(model_names)
        self.opts = opts
        self.reasoning_parser = reasoning_parser = opts.reasoning_parser
        if reasoning_parser and None in (self.tok.token_to_id(THINK_START), self.tok.token_to_id(THINK_END)):
            raise ValueError(
                f"--reasoning-parser {reasoning_parser}: the tokenizer has no {THINK_START} and {THINK_END} tokens"
            )
        self.max_len = model.max_model_len
        self.max_chars = self.max_len * max_chars_per_token(self.tok)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (*self.model_names, self.model.model_name):
            served = ", ".join(f"`{n}`" for n in self.model_names)
            raise APIError(
                400,
                f"The model `{name[:100]}` does not exist; this server serves {served}.",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, param: str) -> list[int]:
        """Tokenize, after the character bound says the text may fit the context."""
        if len(text) > self.max_chars and len(unicodedata.normalize("NFC", text)) > self.max_chars:
            raise APIError(
                400,
                f"'{param}' has {len(text)} characters: more than this model's context of {self.max_len} tokens "
                f"can hold ({self.max_chars} characters at most).",
                param=param,
                code="context_length_exceeded",
            )
        try:
            return self.tok.encode(text)
        except Exception:
            log.info("tokenizer failed on %s", param, exc_info=True)
            raise APIError(400, f"'{param}' cannot be tokenized", param=param) from None

    def check(self, prompt_ids: list[int], param: str) -> None:
        try:
            self.model.check_prompt(prompt_ids, SamplingParams())
        except RequestError as e:
            too_long = len(prompt_ids) >= self.max_len
            raise APIError(400, str(e), param=param, code="context_length_exceeded" if too_long else None) from None

    # --- chat

    def render(self, messages: list[P.ChatMessage], req: P.ChatTemplateFields, add_generation_prompt: bool) -> str:
        kwargs = {**(self.opts.default_chat_template_kwargs or {}), **(req.chat_template_kwargs or {})}
        if req.tools and req.tool_choice != "none":
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            return self.tok.apply_chat_template(template_messages(messages), add_generation_prompt, **kwargs)
        except APIError:
            raise
        except TokenizerError as e:  # the template's own raise_exception (or no template): written for users
            raise APIError(400, str(e), param="messages") from None
        except Exception:
            log.info("chat template failed", exc_info=True)
            raise APIError(
                400,
                "the chat template cannot render these messages (check the types in messages, tools and "
                "chat_template_kwargs)",
                param="messages",
            ) from None

    def chat_ids(self, req: P.ChatTemplateFields, messages: list[P.ChatMessage]) -> tuple[list[int], int | None, str]:
        """(prompt ids, session checkpoint position, prompt text): the checkpoint goes where the
        conversation ends and the generation prompt starts, since the next turn re-renders this
        reply after that point."""
        text = self.render(messages, req, req.add_generation_prompt)
        prompt_ids = self.encode(text, "messages")
        checkpoint_at = None
        if req.add_generation_prompt:
            history_ids = self.encode(self.render(messages, req, False), "messages")
            checkpoint_at = common_prefix(history_ids, prompt_ids)
        return prompt_ids, checkpoint_at, text

    def chat(self, req: P.ChatCompletionRequest) -> tuple[list[int], SamplingParams, int | None, ReasoningStart | None]:
        """(prompt ids, params, session checkpoint position, where the reply starts with respect to
        the reasoning: None without a reasoning parser)."""
        self.check_model(req.model)
        with field_errors():
            tools = structured.tool_grammar(req, self.tok)
            found = structured.request_constraint(req)
            if tools is not None and found is not None:
                raise P.FieldError("tool_choice", f"cannot be combined with {found[0]}")
            if tools is not None:
                found = ("tool_choice", {"grammar": tools})
            constraint = structured.checked(*found, self.tok) if found else None
        prompt_ids, checkpoint_at, text = self.chat_ids(req, req.messages)
        self.check(prompt_ids, "messages")
        start = reasoning_start(text) if self.reasoning_parser else None
        if constraint is not None and start is not None:
            with field_errors():
                constraint = structured.checked(found[0], structured.reasoning_grammar(constraint, start), self.tok)
        self.check_logprobs(req)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = resolve_max_tokens(requested, len(prompt_ids), self.max_len, param)
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = self.params(req, max_tokens, top, req.prompt_logprobs, constraint)
        return prompt_ids, params, checkpoint_at, start

    # --- completions

    def completion(self, req: P.CompletionRequest) -> list[tuple[list[int], str | None, SamplingParams]]:
        """(prompt ids, prompt text if given as text, params) per candidate: best_of (default n) per
        prompt of the batch, in prompt order (choice_params)."""
        self.check_model(req.model)
        p = req.prompt
        prompts = [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)
        if len(prompts) > 1 and req.stream:
            raise APIError(400, "a batch of prompts cannot be streamed", param="prompt")
        n = req.n or 1
        best_of = req.best_of or n
        if best_of < n:
            raise APIError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
        if best_of > n and req.stream:  # vLLM's too: the n kept are known only once all best_of have ended
            raise APIError(400, f"best_of ({best_of}) above n ({n}) cannot be streamed", param="best_of")
        if len(prompts) * best_of > MAX_BATCH:
            raise APIError(400, f"at most {MAX_BATCH} prompts (times best_of) per request", param="prompt")
        self.check_logprobs(req)
        if req.echo and req.stream and req.logprobs is not None:
            raise APIError(400, "echo with logprobs cannot be streamed", param="echo")
        with field_errors():
            found = structured.request_constraint(req)
            constraint = structured.checked(*found, self.tok) if found else None
        # echo with logprobs lists the prompt's logprobs too: the engine computes the larger top count
        echo_lp = req.logprobs if req.echo else None
        wanted = [n for n in (req.prompt_logprobs, echo_lp) if n is not None]
        prompt_lp = max(wanted) if wanted else None
        out = []
        for prompt in prompts:
            ids = self.encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
            self.check(ids, "prompt")
            requested = req.max_tokens if req.max_tokens is not None else 16
            max_tokens = resolve_max_tokens(requested, len(ids), self.max_len, "max_tokens")
            # best_of ranks candidates by their tokens' logprobs: computed, shown only when asked
            logprobs = 0 if req.logprobs is None and best_of > n else req.logprobs
            params = self.params(req, max_tokens, logprobs, prompt_lp, constraint)
            out += [(ids, prompt if isinstance(prompt, str) else None, p) for p in choice_params(params, best_of)]
        return out

    def check_logprobs(self, req: P.SamplingRequest) -> None:
        """The logprob counts a request asks for, at most the server's --max-logprobs (vLLM's)."""
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(req, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > self.opts.max_logprobs:
                raise APIError(
                    400,
                    f"{name} is {value}: this server returns at most {self.opts.max_logprobs} (--max-logprobs)",
                    param=name,
                )

    def params(
        self,
        req: P.SamplingRequest,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        structured_outputs: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The request's own values over the checkpoint's generation_config defaults over ours,
        checked against the model (stop_token_ids within its vocabulary)."""
        try:
            params = self.model.default_sampling_params(
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                temperature=req.temperature,
                top_k=None if req.top_k is None else max(0, req.top_k),
                top_p=req.top_p,
                min_p=req.min_p,
                repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty,
                presence_penalty=req.presence_penalty,
                seed=req.seed,
                ignore_eos=req.ignore_eos,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                stop=req.stop_list,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=structured_outputs,
            )
            self.model.check_params(params)
            return params
        except ValueError as e:
            name = str(e).split()[0]  # SamplingParams' (and check_params') messages start with the field's name
            raise APIError(400, str(e), param=name if name in type(req).model_fields else None) from None

    # --- /tokenize

    def tokenize(self, req: P.TokenizeRequest) -> list[int]:
        self.check_model(req.model)
        if req.messages is not None:
            return self.encode(self.render(req.messages, req, req.add_generation_prompt), "messages")
        return self.encode(req.prompt, "prompt")


@contextmanager
def field_errors():
    """A FieldError raised inside (a request field that cannot be used) becomes a 400 naming it."""
    try:
        yield
    except P.FieldError as e:
        raise APIError(400, f"{e.param}: {e.message}", param=e.param) from None


def choice_params(params: SamplingParams, count: int) -> list[SamplingParams]:
    """The params of a prompt's `count` choices (n, or best_of candidates), each its own engine
    request: choice i of a seeded request seeded with seed + i (vLLM's), so it equals the n=1
    request with that seed."""
    seeded = (params.seed is not None and i > 0 for i in range(count))
    return [replace(params, seed=wrap_seed(params.seed + i)) if s else params for i, s in enumerate(seeded)]


def wrap_seed(seed: int) -> int:
    """seed + i kept a signed 64-bit seed (core.SEED_RANGE), wrapping as the Philox key does."""
    return (seed + 2**63) % 2**64 - 2**63


def resolve_max_tokens(requested: int | None, prompt_len: int, max_len: int, param: str) -> int:
    room = max_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            400,
            f"'{param}' is too large: {requested}. This model's maximum context length is {max_len} tokens "
            f"and your request has {prompt_len} input tokens ({requested} > {max_len} - {prompt_len}).",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def template_messages(messages: list[P.ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        try:
            role = template_role(m.role, f"messages[{i}]")
        except RequestError as e:
            raise APIError(400, str(e), param=f"messages[{i}].role") from None
        d = m.model_dump(exclude_none=True)  # keeps name, tool_calls, tool_call_id, reasoning_content, ...
        d["role"] = role
        d["content"] = text_content(m.content, i)
        for j, call in enumerate(d.get("tool_calls") or ()):
            call["function"]["arguments"] = tool_arguments(call["function"]["arguments"], i, j)
        out.append(d)
    return out


def tool_arguments(arguments: str | dict, i: int, j: int) -> dict:
    """A replayed tool call's arguments as the object templates iterate over: OpenAI clients send
    the JSON text the server gave them."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError as e:
        value = e
    if not isinstance(value, dict):
        raise APIError(
            400,
            f"messages[{i}].tool_calls[{j}].function.arguments: not a JSON object",
            param=f"messages[{i}].tool_calls[{j}].function.arguments",
        )
    return value


def text_content(content: str | list[P.ContentPart] | None, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if part.type != "text":
            raise APIError(
                400,
                f"{where}: content type {part.type[:50]!r} is not supported (this server takes text parts only)",
                param=where,
            )
        if part.text is None:
            raise APIError(400, f"{where}.text: missing (a text part carries its text)", param=f"{where}.text")
        texts.append(part.text)
    return "\n".join(texts)
