"""/v1/responses, the OpenAI Responses API (the subset vLLM serves): a request is read as the chat
request it stands for (`input` items as messages, `instructions` as the system message, function
tools, `text.format` as response_format), so the chat path's template rendering, tool-call grammar,
structured output and reasoning split serve it unchanged (prepare.Prompts.chat, structured.py,
chat_output.ChatOutputParser); only the input items and the output's shape are this module's.

The reply's parts become output items: a `reasoning` item (the text inside `<think>`, with
--reasoning-parser), a `message` item with one output_text part, and a `function_call` item per
tool call. Streamed, the same items are built by the typed events (response.created, then
output_item.added / *.delta / *.done per item, then response.completed carrying the whole response,
its status "incomplete" when max_output_tokens cut it), so the streamed response is the
non-streamed one. Nothing is stored: `previous_response_id` is refused. Does not know the engine.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from nextn.core import RequestOutput
from nextn.server import protocol as P
from nextn.server import response_models as R
from nextn.server import responses_protocol as Q
from nextn.server.chat_output import THINK_END, ChatOutputParser, Parts, ReasoningStart
from nextn.server.completions import Server, output_parser, run_to_end, stream_error_info
from nextn.server.prepare import APIError, field_errors
from nextn.server.responses import to_json, usage

TEXT = {"format": {"type": "text"}}  # the response's `text` when the request sets no format
# the fields the chat request has too, with the same meaning
SAME_FIELDS = ("model", "temperature", "top_p", "top_k", "seed", "parallel_tool_calls", "chat_template_kwargs")
ROLES = ("user", "system", "developer", "assistant")
# the chat request's fields a refusal may name -> the Responses request's
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format": "text.format",
    "tool_choice.function.name": "tool_choice.name",
}


async def create_response(srv: Server, req: Q.ResponsesRequest, request: Request) -> Response:
    chat = chat_request(req)
    try:
        prompt_ids, params, checkpoint_at, reasoning = await run_in_threadpool(srv.prompts.chat, chat)
    except APIError as e:
        raise renamed(e) from None
    job = srv.submit(prompt_ids, params, checkpoint_at)
    base = Q.ResponseObject(
        id=new_id("resp"),
        created_at=R.now(),
        status="in_progress",
        model=srv.model_name,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        tool_choice=req.tool_choice.model_dump() if isinstance(req.tool_choice, Q.ResponsesToolChoice) else "auto",
        parallel_tool_calls=req.parallel_tool_calls,
        text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else TEXT,
        metadata=req.metadata or {},
    )
    if isinstance(req.tool_choice, str):
        base.tool_choice = req.tool_choice
    items = OutputItems(output_parser(srv, chat, reasoning))
    if req.stream:
        return StreamingResponse(stream(srv, base, job, items, reasoning), media_type="text/event-stream")
    out = await run_to_end(job, request)
    items.push(out.text)
    items.finish()
    return Response(to_json(finished(srv, base, items, out, reasoning)), media_type="application/json")


def new_id(prefix: str) -> str:
    """OpenAI's id form for responses and their items: `resp_...`, `msg_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def finished(
    srv: Server, base: Q.ResponseObject, items: OutputItems, out: RequestOutput, reasoning: ReasoningStart | None
) -> Q.ResponseObject:
    counted = usage([out], srv.model.num_speculative_tokens)
    cut = out.finish_reason == "length"
    return base.model_copy(
        update=dict(
            status="incomplete" if cut else "completed",
            incomplete_details=Q.IncompleteDetails(reason="max_output_tokens") if cut else None,
            output=items.items,
            usage=Q.ResponseUsage(
                input_tokens=counted.prompt_tokens,
                input_tokens_details=Q.InputTokensDetails(cached_tokens=counted.prompt_tokens_details.cached_tokens),
                output_tokens=counted.completion_tokens,
                output_tokens_details=Q.OutputTokensDetails(reasoning_tokens=reasoning_tokens(srv, out, reasoning)),
                total_tokens=counted.total_tokens,
                spec_decode=counted.spec_decode,
            ),
        )
    )


def reasoning_tokens(srv: Server, out: RequestOutput, reasoning: ReasoningStart | None) -> int:
    """The reply's tokens up to its `</think>` (all of them when it never closed a think block it
    started in); 0 without a reasoning parser or a think block."""
    if reasoning is None or reasoning == "after":
        return 0
    end = srv.model.tokenizer.token_to_id(THINK_END)
    if end in out.token_ids:
        return out.token_ids.index(end) + 1
    return len(out.token_ids) if reasoning == "inside" else 0


async def stream(
    srv: Server, base: Q.ResponseObject, job, items: OutputItems, reasoning: ReasoningStart | None
) -> AsyncIterator[str]:
    seq = 0

    def event(body: dict[str, Any]) -> str:
        nonlocal seq
        data = json.dumps({**body, "sequence_number": seq}, ensure_ascii=False)
        seq += 1
        return f"event: {body['type']}\ndata: {data}\n\n"

    try:
        yield event({"type": "response.created", "response": dumped(base)})
        yield event({"type": "response.in_progress", "response": dumped(base)})
        async for ev in job.events():
            for e in items.push(ev.text):
                yield event(e)
            if ev.output is not None:
                for e in items.finish():
                    yield event(e)
                done = finished(srv, base, items, ev.output, reasoning)
                yield event({"type": "response.completed", "response": dumped(done)})
    except Exception as e:  # the response has started: report in the stream
        error = stream_error_info(e)
        yield event({"type": "error", "code": error.code, "message": error.message, "param": None})
    finally:
        job.cancel()


def dumped(model) -> dict:
    return json.loads(to_json(model))


# ---------------------------------------------------------------------------------------------
# The request as a chat request


def chat_request(req: Q.ResponsesRequest) -> P.ChatCompletionRequest:
    with field_errors():
        messages = input_messages(req)
    fields: dict[str, Any] = {name: getattr(req, name) for name in SAME_FIELDS}
    fields |= {"messages": messages, "max_tokens": req.max_output_tokens}
    if req.tools:
        keys = {"name", "description", "parameters"}
        functions = [t.model_dump(include=keys, exclude_none=True) for t in req.tools]
        fields["tools"] = [{"type": "function", "function": fn} for fn in functions]
    if isinstance(req.tool_choice, Q.ResponsesToolChoice):
        fields["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    else:
        fields["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    try:
        return P.ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # the fields were checked above: a value the chat request takes otherwise
        err = e.errors()[0]
        raise APIError(400, f"input: {err['msg']}", param="input") from None


def renamed(e: APIError) -> APIError:
    """A refusal of the chat request, naming the Responses request's field."""
    for old, new in PARAMS.items():
        if e.param is not None and (e.param == old or e.param.startswith((f"{old}[", f"{old}."))):
            param = new if old == "messages" else new + e.param[len(old) :]
            message = e.message.replace(f"'{old}'", f"'{new}'").replace(f"{old}:", f"{new}:")
            return APIError(e.status, message, e.type, param, e.code, e.headers)
    return e


def input_messages(req: Q.ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages: message items as messages; function_call items
    as the tool calls of the assistant turn they follow (a new one if none), function_call_output
    items as tool messages, a reasoning item as the next assistant turn's reasoning_content."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    reasoning = None
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = item_text(item.get("content") or [], f"{where}.content", ("reasoning_text",))
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise P.FieldError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {str(role)[:50]!r}")
            message = {"role": role, "content": item_text(item.get("content"), f"{where}.content")}
        elif kind == "function_call":
            call = {"id": text_field(item, "call_id", where), "type": "function"}
            call["function"] = {"name": text_field(item, "name", where), "arguments": arguments(item, where)}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:  # this turn's calls
                last.setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": "", "tool_calls": [call]}
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else item_text(output, f"{where}.output")
            message = {"role": "tool", "tool_call_id": text_field(item, "call_id", where), "content": content}
        else:
            kinds = "message, function_call, function_call_output or reasoning"
            raise P.FieldError(f"{where}.type", f"{str(kind)[:50]!r} items are not supported (give {kinds})")
        if reasoning is not None and message["role"] == "assistant":
            message["reasoning_content"] = reasoning
        reasoning = None
        messages.append(message)
    return messages


def item_text(content: Any, where: str, kinds: tuple[str, ...] = ("input_text", "output_text")) -> str:
    """A message's content: a string, or text parts (joined by newlines, as the chat path's)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.FieldError(where, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            shown = str(kind)[:50]
            raise P.FieldError(f"{where}[{j}].type", f"{shown!r} parts are not supported (give {' or '.join(kinds)})")
        texts.append(text_field(part, "text", f"{where}[{j}]"))
    return "\n".join(texts)


def text_field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise P.FieldError(f"{where}.{key}", "must be a string")
    return value


def arguments(item: dict, where: str) -> dict:
    """A replayed call's arguments: the JSON object text the server gave."""
    text = text_field(item, "arguments", where)
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise P.FieldError(f"{where}.arguments", "not a JSON object")
    return value


# ---------------------------------------------------------------------------------------------
# The reply as output items


class OutputItems:
    """A reply's text -> output items, through the chat path's parser; each push and the finish
    return the stream events that build them. At most one reasoning item (the reply starts with
    it) and one message item (the content, around any calls, as the non-streamed message's
    content is one string), then a function_call item per call; no item at all is an empty message."""

    def __init__(self, parser: ChatOutputParser):
        self.parser = parser
        self.items: list[Q.OutputItem] = []
        self.reasoning: Q.ReasoningItem | None = None
        self.message: Q.MessageItem | None = None
        self.open: list[Q.ReasoningItem | Q.MessageItem] = []

    def push(self, text: str) -> list[dict]:
        return self._parts(self.parser.push(text))

    def finish(self) -> list[dict]:
        events = self._parts(self.parser.finish())
        if not self.items:
            events += self._text("message", "")
        for item in self.open:
            events += self._close(item)
        self.open = []
        return events

    def _parts(self, parts: Parts) -> list[dict]:
        events = []
        if parts.reasoning:
            events += self._text("reasoning", parts.reasoning)
        if parts.content:
            if self.reasoning in self.open:  # the reasoning is over
                self.open.remove(self.reasoning)
                events += self._close(self.reasoning)
            events += self._text("message", parts.content)
        for call in parts.tool_calls:
            fn = call.function
            item = Q.FunctionCallItem(id=new_id("fc"), call_id=call.id, name=fn.name, arguments=fn.arguments)
            at = len(self.items)
            self.items.append(item)
            ids = {"item_id": item.id, "output_index": at}
            added = item.model_copy(update={"arguments": "", "status": "in_progress"})
            events += [
                {"type": "response.output_item.added", "output_index": at, "item": added.model_dump()},
                {"type": "response.function_call_arguments.delta", **ids, "delta": fn.arguments},
                {"type": "response.function_call_arguments.done", **ids, "name": fn.name, "arguments": fn.arguments},
                {"type": "response.output_item.done", "output_index": at, "item": item.model_dump()},
            ]
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        """`text` added to the reasoning or the message item (opened first if it is not)."""
        events = []
        item = self.reasoning if kind == "reasoning" else self.message
        if item is None:
            if kind == "reasoning":
                item = self.reasoning = Q.ReasoningItem(id=new_id("rs"), status="in_progress")
                part = Q.ReasoningText(text="")
            else:
                item = self.message = Q.MessageItem(id=new_id("msg"), status="in_progress")
                part = Q.OutputText(text="")
            self.items.append(item)
            self.open.append(item)
            events.append({"type": "response.output_item.added", **self._at(item), "item": item.model_dump()})
            events.append({"type": "response.content_part.added", **self._ids(item), "part": part.model_dump()})
            item.content.append(part)
        item.content[0].text += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        events.append({"type": f"response.{name}.delta", **self._ids(item), "delta": text})
        return events

    def _close(self, item: Q.ReasoningItem | Q.MessageItem) -> list[dict]:
        item.status = "completed"
        part = item.content[0]
        name = "reasoning_text" if isinstance(item, Q.ReasoningItem) else "output_text"
        return [
            {"type": f"response.{name}.done", **self._ids(item), "text": part.text},
            {"type": "response.content_part.done", **self._ids(item), "part": part.model_dump()},
            {"type": "response.output_item.done", **self._at(item), "item": item.model_dump()},
        ]

    def _at(self, item) -> dict:
        return {"output_index": self.items.index(item)}

    def _ids(self, item) -> dict:
        return {"item_id": item.id, **self._at(item), "content_index": 0}
