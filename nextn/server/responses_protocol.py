"""The OpenAI Responses API's wire format (/v1/responses), both ways: the request nextn accepts (the
subset vLLM serves) and the response object, its output items and its usage.

A request is strict as the chat request is (protocol.RequestModel: unknown top-level keys, wrong
types and fields nextn does not implement are a 400 naming them); its `input` items are read in
responses_api.py, which names a bad item's field itself. Function tools only; `text.format` takes
text, json_object and json_schema. Does not know the engine.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from nextn.server.protocol import INT32_MAX, FieldError, OpenAIModel, RequestModel, tool_choice_word
from nextn.server.response_models import SpecDecodeUsage

# ---------------------------------------------------------------------------------------------
# Requests


class ResponsesTool(OpenAIModel):
    """A function tool, flat as the Responses API writes it (chat nests it under `function`)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _a_function(self):
        if self.type != "function":
            raise FieldError("type", f"{self.type[:50]!r} tools are not supported (this server calls functions only)")
        if self.name is None:
            raise FieldError("name", "is required")
        return self


class ResponsesToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise FieldError("schema", "is required when type is 'json_schema'")
        return self


class ResponsesText(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; other values change the reply: a 400


class ReasoningOptions(OpenAIModel):
    """OpenAI's reasoning options: the model here thinks as its template says (`chat_template_kwargs`)."""

    effort: None = None
    summary: None = None
    generate_summary: None = None


class ResponsesRequest(RequestModel):
    unsupported: ClassVar[dict[str, Any]] = {
        "previous_response_id": None,  # nothing is stored: send the conversation as `input`
        "conversation": None,
        "background": False,
        "include": [],
        "truncation": "disabled",
        "prompt": None,
        "max_tool_calls": None,
        "top_logprobs": 0,
        "stream_options": None,
    }

    model: str | None = None
    input: str | list[dict[str, Any]]  # read item by item in responses_api.py
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # vLLM's extras
    seed: int | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    reasoning: ReasoningOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's, e.g. {"enable_thinking": false}
    stream: bool = False
    # informational: taken and ignored (nothing is stored)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v):
        return tool_choice_word(v)


# ---------------------------------------------------------------------------------------------
# Responses


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningItem(OpenAIModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    spec_decode: SpecDecodeUsage | None = None  # nextn's


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    previous_response_id: None = None
    store: bool = False
    truncation: Literal["disabled"] = "disabled"
