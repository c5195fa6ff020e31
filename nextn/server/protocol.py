"""The OpenAI wire format, inbound: pydantic models of the requests nextn accepts.

A request body's fields are typed strictly (JSON `true` is not an integer, `"4"` not a number; an
integer is a float) and range-checked wherever a value reaches the chat template, the tokenizer or
the engine, so a bad value is a 400 naming its field before anything is queued. Every top-level
key must be known: a misspelled field is a 400, never a default silently used instead. OpenAI's
informational fields (`user`, `metadata`, ...) are declared and ignored; a field nextn does not
implement (OpenAI's `reasoning_effort`, vLLM's `use_beam_search`, ...) is a 400 unless sent at the
value that means off. Nested objects (messages, tools, ...) keep unknown keys: OpenAI clients echo
an assistant message back with keys such as `refusal` set to null. Text with a lone UTF-16
surrogate (JSON allows "\ud800"; no tokenizer or UTF-8 encoder does) is refused, not replaced.
Besides the standard fields, requests take vLLM's extras (`top_k`/`min_p`/`repetition_penalty`/
`ignore_eos`/`stop_token_ids`/`return_token_ids`/`prompt_logprobs`). Also holds `OpenAIModel`, the
base of every wire model; the responses nextn sends are in response_models.py. Does not know the
engine.
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

INT32_MAX = 2**31 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


class FieldError(ValueError):
    """A validation error that knows the request field it is about (the 400's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message  # param: relative to where pydantic raised it


def lone_surrogate_path(body: Any) -> str | None:
    """The path of the first string (value or key) in a parsed JSON body that holds a lone UTF-16
    surrogate, or None. Iterative: a deeply nested body must not exhaust the stack here."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, str):
            if _SURROGATE.search(obj):
                return path or "body"
        elif isinstance(obj, dict):
            for k, v in obj.items():
                name = k.encode("utf-8", "backslashreplace").decode() if isinstance(k, str) else str(k)
                key = f"{path}.{name}" if path else name
                if isinstance(k, str) and _SURROGATE.search(k):
                    return key
                stack.append((key, v))
        elif isinstance(obj, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
    return None


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------------------------
# Requests


class RequestModel(OpenAIModel):
    """A request body: strict types, no unknown top-level keys (nested models stay permissive)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # fields nextn does not implement -> the value meaning off: taken at it or null, else a 400 (an
    # empty value is not always off: OpenAI's `web_search_options: {}` turns search on)
    unsupported: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, body):
        path = lone_surrogate_path(body)
        if path is not None:
            raise FieldError(path, "text holds a lone UTF-16 surrogate (not valid Unicode); send UTF-8 text")
        if not isinstance(body, dict):
            return body  # pydantic says what it should be
        for key, value in body.items():
            if key in cls.model_fields:
                continue
            if key not in cls.unsupported:
                close = difflib.get_close_matches(key, cls.model_fields, 1)
                raise FieldError(key[:100], "unknown field" + (f"; did you mean '{close[0]}'?" if close else ""))
            off = cls.unsupported[key]
            if value is not None and value != off:
                off_too = f" (send {json.dumps(off)} or leave it out)" if off is not None else ""
                raise FieldError(key, f"is not supported by this server{off_too}")
        return {k: v for k, v in body.items() if k in cls.model_fields}


class StreamOptions(OpenAIModel):
    """Strict as a request body is (a client never echoes it back with keys of its own)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (with include_usage)
    include_obfuscation: bool | None = None  # OpenAI's padding of the chunks against side channels: none sent

    @model_validator(mode="after")
    def _continuous_needs_usage(self):
        if self.continuous_usage_stats and not self.include_usage:  # it would do nothing
            raise FieldError("continuous_usage_stats", "needs include_usage: true")
        return self


class FunctionCall(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; some clients an object


class ToolCall(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise FieldError("json_schema.schema", "is required when type is 'json_schema'")
        return self


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ContentPart(OpenAIModel):
    type: str  # only "text" is rendered (prepare.py names the part otherwise)
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: str  # checked against the roles nextn renders (prepare.py), so the error names the message
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class SamplingRequest(RequestModel):
    """Fields /v1/chat/completions and /v1/completions share."""

    unsupported: ClassVar[dict[str, Any]] = {
        "logit_bias": {},
        # vLLM's
        "use_beam_search": False,
        "length_penalty": 1.0,
        "truncate_prompt_tokens": None,
        "bad_words": [],
        "allowed_token_ids": None,
        "continue_final_message": False,
        "documents": None,
        "skip_special_tokens": True,  # output text skips them
    }

    model: str | None = None
    user: str | None = None  # informational (OpenAI's end-user id): ignored
    # None (absent or null) means the OpenAI default
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # vLLM's extra; 0 or -1 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    ignore_eos: bool = False
    n: int | None = Field(None, ge=1, le=64)  # choices per prompt, each its own engine request
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extra: the prompt's and the output's token ids
    # vLLM's extras nextn implements
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (prepare.py)
    # structured outputs: at most one of these per request (structured.py maps them, 400 for two)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {"json" | "regex" | "choice" | "grammar" | ...}
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "cannot be streamed")
        return self

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:  # OpenAI's 400 too: it would do nothing
            raise FieldError("stream_options", "is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def tool_choice_word(v: Any) -> Any:
    """A tool_choice given as a word is one of the three (its own message, not pydantic's union's)."""
    if isinstance(v, str) and v not in ("none", "auto", "required"):
        raise ValueError(f"must be 'none', 'auto', 'required' or a named function, got {v[:50]!r}")
    return v


class ChatTemplateFields(RequestModel):
    """What the chat template is rendered with, besides the messages (chat completions and /tokenize)."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # "none": no tools rendered
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v):
        return tool_choice_word(v)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        """The server sets `messages` and `add_generation_prompt`; `tools` must be typed as the field is."""
        for key in ("messages", "add_generation_prompt"):
            if v and key in v:
                raise FieldError(key, "is set by the server; use the request field")
        if v and "tools" in v:
            try:
                v = {**v, "tools": [t.model_dump(exclude_none=True) for t in _TOOLS.validate_python(v["tools"])]}
            except ValidationError as e:
                err = e.errors()[0]
                where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"])
                raise FieldError(f"tools{where}", err["msg"]) from None
        return v


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    unsupported: ClassVar[dict[str, Any]] = {
        **SamplingRequest.unsupported,
        # OpenAI's, each changes the reply
        "modalities": ["text"],
        "audio": None,
        "prediction": None,
        "reasoning_effort": None,
        "verbosity": None,
        "web_search_options": None,
        "moderation": None,
        "functions": None,  # the deprecated forms of tools and tool_choice
        "function_call": None,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (prepare.py)
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: the reply starts with the last message's content when it is the assistant's
    # informational (billing, storage, caching, tracking at OpenAI): taken and ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs: true")
        return self


_TOOLS = TypeAdapter(list[Tool])


class CompletionRequest(SamplingRequest):
    unsupported: ClassVar[dict[str, Any]] = {**SamplingRequest.unsupported, "suffix": ""}

    # a string, token ids, or a batch of either (non-streamed batches only)
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (prepare.py)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=64)  # candidates the n choices are picked from (vLLM's)


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template."""

    # vLLM's; nextn's prompts never get special tokens added by the tokenizer (as the engine sees them)
    unsupported: ClassVar[dict[str, Any]] = {"add_special_tokens": False, "continue_final_message": False}

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt and messages")
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
