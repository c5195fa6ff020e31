"""The OpenAI wire format, outbound: pydantic models of the responses nextn sends.

They carry nextn's extras (`usage.spec_decode`, vLLM's `token_ids`/`prompt_token_ids`/
`prompt_logprobs`, `reasoning_content`) beside the standard fields; responses.to_json leaves the
unset extras out, so plain OpenAI payloads stay plain. Filled in by responses.py, chat_output.py and
completions.py; the base class `OpenAIModel` is in protocol.py. Does not know the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import Field

from nextn.server.protocol import OpenAIModel


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class SpecDecodeUsage(OpenAIModel):
    """The request's speculative decoding counters (vLLM's names where it has them)."""

    num_drafts: int  # verify rounds that had at least one draft token
    num_draft_tokens: int
    num_accepted_tokens: int
    num_rounds: int  # all verify rounds, zero-draft ones included
    num_zero_draft_rounds: int  # rounds that verified the pending token alone (a gate cut draft 1)
    drafted_per_position: list[int]
    accepted_per_position: list[int]
    accept_length_histogram: list[int]  # rounds by drafts accepted, 0..K
    acceptance_rate: float
    mean_acceptance_length: float  # tokens per verify round: 1 + accepted / rounds


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class Usage(OpenAIModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    spec_decode: SpecDecodeUsage | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(OpenAIModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the text inside <think>...</think>
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(OpenAIModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    """A streamed tool call: the first delta of a call has its id, type and name; the next ones
    fragments of its arguments, to be appended in order."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(OpenAIModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, on the first chunk


class CompletionLogprobs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIModel):
    prompt: str


class PromptLogprob(OpenAIModel):
    """vLLM's prompt_logprobs entry (one per listed token id)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely; None when outside the top listed
    decoded_token: str


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nextn"
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
