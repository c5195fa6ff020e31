"""The two generation routes' work (/v1/chat/completions and /v1/completions): a request in,
jobs submitted to the engine core, the outputs formatted as one response or as SSE chunks.

Holds `Server` (what the routes share) with its `submit`, and maps the engine's refusals to
OpenAI-shaped errors: a full queue is a 503 with Retry-After, a stopped engine a 503, a stream that
cannot finish ends with a final error event (a 500's internal text never reaches the client).
Requests become prompts in prepare.py; a chat reply is split into reasoning, content and tool calls
by chat_output.py; the routes, the app and its lifetime are in app.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from nextn.config.serve import ServerOptions
from nextn.core import RequestError, RequestOutput, SamplingParams
from nextn.engine.engine import StreamEvent
from nextn.engine.scheduler import QueueFull
from nextn.server import protocol as P
from nextn.server import response_models as R
from nextn.server import structured
from nextn.server.chat_output import ChatOutputParser, Parts, ReasoningStart
from nextn.server.metrics import Metrics
from nextn.server.model import ServedModel
from nextn.server.prepare import APIError, Prompts, choice_params, text_content
from nextn.server.responses import (
    SSE_DONE,
    LogprobFormatter,
    merge_completion_logprobs,
    sse,
    to_json,
    usage,
)
from nextn.server.worker import ClientGone, EngineWorker, Job, Unavailable

log = logging.getLogger("nextn.server")

RETRY_AFTER_S = 1  # what a 503 for a full queue asks a client to wait


@dataclass
class Server:
    """What the routes share."""

    model: ServedModel
    opts: ServerOptions
    worker: EngineWorker
    metrics: Metrics
    prompts: Prompts
    model_name: str
    created: int
    logprobs: LogprobFormatter

    def submit(self, prompt_ids: list[int], params: SamplingParams, checkpoint_at: int | None = None) -> Job:
        job = Job(prompt_ids, params, asyncio.get_running_loop(), checkpoint_at)
        try:
            self.worker.submit(job)
        except QueueFull as e:
            self.metrics.rejected_request("queue_full")
            raise APIError(
                503,
                f"The server is overloaded ({e}); retry later.",
                type_="server_error",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except Unavailable as e:
            self.metrics.rejected_request("unavailable")
            raise unavailable(e) from None
        return job


def unavailable(e: Unavailable) -> APIError:
    return APIError(503, f"{e}.", type_="server_error", code="service_unavailable")


def stream_error(e: Exception) -> str:
    """The final event of a stream that cannot finish (then [DONE], as vLLM does)."""
    return f"data: {to_json(R.ErrorResponse(error=stream_error_info(e)))}\n\n{SSE_DONE}"


def stream_error_info(e: Exception) -> R.ErrorInfo:
    """What a stream that cannot finish tells the client (a 500's internal text never)."""
    if isinstance(e, Unavailable):
        return R.ErrorInfo(message=f"{e}.", type="server_error", code="service_unavailable")
    if isinstance(e, RequestError):
        return R.ErrorInfo(message=str(e), type="invalid_request_error")
    log.error("stream failed", exc_info=e)
    return R.ErrorInfo(message="The server failed on this request.", type="server_error")


# ---------------------------------------------------------------------------------------------
# Running jobs


async def run_to_end(job: Job, request: Request | None) -> RequestOutput:
    try:
        disconnected = request.is_disconnected if request is not None else None
        async for ev in job.events(disconnected=disconnected):
            if ev.output is not None:
                return ev.output
        raise RuntimeError("the engine ended a request without an output")
    except RequestError as e:  # the engine refused the prompt after all
        raise APIError(400, str(e)) from None
    except Unavailable as e:
        raise unavailable(e) from None
    finally:
        job.cancel()  # a no-op once the job is over; stops the work if this coroutine was cancelled


async def _watch(request: Request, tasks: list[asyncio.Task], poll_s: float = 1.0) -> None:
    """ClientGone (ending the batch's task group) if the client leaves before every task is done
    (the request's receive channel read by one task alone)."""
    while (await asyncio.wait(tasks, timeout=poll_s))[1]:  # some still pending
        if await request.is_disconnected():
            raise ClientGone()


async def run_all(jobs: list[Job], request: Request) -> list[RequestOutput]:
    if len(jobs) == 1:
        return [await run_to_end(jobs[0], request)]
    try:
        async with asyncio.TaskGroup() as tg:  # one watcher polls for a disconnect while any job runs
            tasks = [tg.create_task(run_to_end(job, None)) for job in jobs]
            tg.create_task(_watch(request, tasks))
    except* (APIError, ClientGone) as group:
        raise group.exceptions[0] from None
    finally:
        for job in jobs:
            job.cancel()
    return [t.result() for t in tasks]


def echo_prefix(req: P.ChatCompletionRequest) -> str:
    """vLLM's chat echo: the reply continues the last message when it is the assistant's."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant":
        return ""
    return text_content(last.content, len(req.messages) - 1)


def output_parser(srv: Server, req: P.ChatCompletionRequest, reasoning: ReasoningStart | None) -> ChatOutputParser:
    """The reply's parser: tool calls are parsed when the request gives tools and allows calls
    (without parallel_tool_calls, one: "auto" has no grammar to hold the model to it), in the form
    --tool-call-parser names (None: either); a forced call in the form its grammar wrote, the chat
    template's (structured.tool_grammar)."""
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    forced = structured.forces_call(req)
    form = structured.template_call_form(srv.prompts.tok) if forced else srv.opts.tool_call_form
    return ChatOutputParser(reasoning, tools, req.parallel_tool_calls, form)


def finish_reason(req: P.ChatCompletionRequest, out: RequestOutput, num_calls: int) -> str | None:
    """The reason, "tool_calls" when the model chose to call (OpenAI's and vLLM's: a call forced by
    a named tool_choice finishes "stop")."""
    named = isinstance(req.tool_choice, P.NamedToolChoice)
    return "tool_calls" if num_calls and out.finish_reason == "stop" and not named else out.finish_reason


async def chat_completion(srv: Server, req: P.ChatCompletionRequest, request: Request) -> Response:
    prompt_ids, params, checkpoint_at, reasoning = await run_in_threadpool(srv.prompts.chat, req)
    jobs = submit_all(srv, [(prompt_ids, p) for p in choice_params(params, req.n or 1)], "n", checkpoint_at)
    rid, created = R.new_id("chatcmpl"), R.now()
    parsers = [output_parser(srv, req, reasoning) for _ in jobs]
    if req.stream:
        stream = chat_stream(srv, req, jobs, parsers, rid, created)
        return StreamingResponse(stream, media_type="text/event-stream")
    outs = await run_all(jobs, request)
    choices = [chat_choice(srv, req, i, parser, out) for i, (parser, out) in enumerate(zip(parsers, outs, strict=True))]
    resp = R.ChatCompletionResponse(
        id=rid,
        created=created,
        model=srv.model_name,
        choices=choices,
        usage=usage(outs, srv.model.num_speculative_tokens, outs[:1]),
        prompt_token_ids=prompt_ids if req.return_token_ids else None,
        prompt_logprobs=_prompt_logprobs(srv, req, outs[0]),
    )
    return Response(to_json(resp), media_type="application/json")


def chat_choice(
    srv: Server, req: P.ChatCompletionRequest, index: int, parser: ChatOutputParser, out: RequestOutput
) -> R.ChatChoice:
    parts = parser.push(echo_prefix(req) + out.text)
    rest = parser.finish()
    calls = parts.tool_calls + rest.tool_calls
    message = R.AssistantMessage(
        content=(parts.content + rest.content) or (None if calls else ""),
        reasoning_content=(parts.reasoning + rest.reasoning) or None,
        tool_calls=calls or None,
    )
    return R.ChatChoice(
        index=index,
        message=message,
        finish_reason=finish_reason(req, out, len(calls)),
        stop_reason=out.stop_reason,
        logprobs=srv.logprobs.chat(out.logprobs or []) if req.logprobs else None,  # none at max_tokens 0
        token_ids=out.token_ids if req.return_token_ids else None,
    )


def submit_all(
    srv: Server, requests: list[tuple[list[int], SamplingParams]], param: str, checkpoint_at: int | None = None
) -> list[Job]:
    """One job per (prompt ids, params), all or none: a request of more than the server ever holds
    at once is a 400 naming `param` (no retry would help); a refused one cancels those sent."""
    if len(requests) > srv.worker.capacity:
        raise APIError(
            400,
            f"{len(requests)} sequences (prompts times n or best_of) are more than the server holds at once "
            f"({srv.worker.capacity}: --max-num-seqs plus --max-queue); ask for fewer",
            param=param,
        )
    jobs = []
    try:
        for ids, params in requests:
            jobs.append(srv.submit(ids, params, checkpoint_at))
    except APIError:
        for job in jobs:
            job.cancel()
        raise
    return jobs


async def interleave(jobs: list[Job]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """The jobs' events as they come, each with its job's index (a stream of n choices): until every
    job's last event; the first error ends it (a stream's finally cancels the jobs)."""
    if len(jobs) == 1:
        async for ev in jobs[0].events():
            yield 0, ev
        return
    arrived: asyncio.Queue[tuple[int, StreamEvent | Exception]] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            async for ev in job.events():
                arrived.put_nowait((i, ev))
        except Exception as e:
            arrived.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        open_jobs = len(jobs)
        while open_jobs:
            i, ev = await arrived.get()
            if isinstance(ev, Exception):
                raise ev
            yield i, ev
            open_jobs -= ev.output is not None
    finally:
        for t in tasks:
            t.cancel()


def _prompt_logprobs(srv: Server, req: P.SamplingRequest, out: RequestOutput):
    if req.prompt_logprobs is None or out.prompt_logprobs is None:
        return None
    return srv.logprobs.prompt(out.prompt_logprobs, req.prompt_logprobs)


def token_fields(req: P.SamplingRequest, ev: StreamEvent, logprobs: Callable[[list[dict]], Any]) -> dict:
    """A stream event's logprobs (in the route's shape: `logprobs` formats them) and token ids, as
    chunk fields. They go out even when the event's text is held back (split UTF-8, a pending stop
    string), so the streamed ones add up to the non-streamed."""
    fields = {}
    if ev.logprobs:
        fields["logprobs"] = logprobs(ev.logprobs)
    if req.return_token_ids and ev.token_ids:
        fields["token_ids"] = ev.token_ids
    return fields


def running_usage(req: P.SamplingRequest, job: Job, num_tokens: int) -> R.Usage | None:
    """A chunk's usage under vLLM's `stream_options.continuous_usage_stats`: the tokens so far (of
    the chunk's choice)."""
    if not req.continuous_usage:
        return None
    prompt = len(job.prompt_ids)
    return R.Usage(prompt_tokens=prompt, completion_tokens=num_tokens, total_tokens=prompt + num_tokens)


def usage_chunk(kind, srv: Server, rid: str, created: int, outs: list[RequestOutput]) -> str:
    """A stream's last chunk under `stream_options.include_usage`: no choices, the request's usage
    (every choice's tokens, the prompt once)."""
    return sse(
        kind(
            id=rid,
            created=created,
            model=srv.model_name,
            choices=[],
            usage=usage(outs, srv.model.num_speculative_tokens, outs[:1]),
        )
    )


async def chat_stream(
    srv: Server,
    req: P.ChatCompletionRequest,
    jobs: list[Job],
    parsers: list[ChatOutputParser],
    rid: str,
    created: int,
) -> AsyncIterator[str]:
    """The choices' chunks, interleaved as their tokens come, each choice's marked by its index."""
    num_tokens = [0] * len(jobs)  # generated so far, per choice
    outs: list[RequestOutput | None] = [None] * len(jobs)

    def chunk(i: int, delta: R.DeltaMessage, prompt_token_ids: list[int] | None = None, **fields) -> str:
        choice = R.ChatChunkChoice(index=i, delta=delta, **fields)
        usage = running_usage(req, jobs[i], num_tokens[i])
        return sse(
            R.ChatCompletionChunk(
                id=rid,
                created=created,
                model=srv.model_name,
                choices=[choice],
                usage=usage,
                prompt_token_ids=prompt_token_ids,
            )
        )

    def deltas(i: int, parts: Parts, **fields) -> list[str]:
        """The parts as chunks; the event's logprobs and token ids ride on the first (on an empty
        delta when the parser holds all of its text back)."""
        parser = parsers[i]
        out = parts.delta(parser.num_calls - len(parts.tool_calls)) or ([R.DeltaMessage()] if fields else [])
        return [chunk(i, d, **(fields if j == 0 else {})) for j, d in enumerate(out)]

    try:
        for i, parser in enumerate(parsers):
            ids = jobs[i].prompt_ids if req.return_token_ids and i == 0 else None  # once, on the first chunk
            yield chunk(i, R.DeltaMessage(role="assistant", content=""), ids)
            for c in deltas(i, parser.push(echo_prefix(req))):
                yield c
        async for i, ev in interleave(jobs):
            num_tokens[i] += len(ev.token_ids)
            fields = token_fields(req, ev, srv.logprobs.chat)
            for c in deltas(i, parsers[i].push(ev.text), **fields):
                yield c
            if ev.output is not None:
                outs[i] = ev.output
                for c in deltas(i, parsers[i].finish()):
                    yield c
                reason = finish_reason(req, ev.output, parsers[i].num_calls)
                yield chunk(i, R.DeltaMessage(), finish_reason=reason, stop_reason=ev.output.stop_reason)
        if req.include_usage:
            yield usage_chunk(R.ChatCompletionChunk, srv, rid, created, outs)
        yield SSE_DONE
    except Exception as e:  # the response has started: report in the stream
        yield stream_error(e)
    finally:
        for job in jobs:
            job.cancel()


async def completion(srv: Server, req: P.CompletionRequest, request: Request) -> Response:
    prepared = await run_in_threadpool(srv.prompts.completion, req)
    jobs = submit_all(srv, [(ids, params) for ids, _, params in prepared], "prompt")
    rid, created = R.new_id("cmpl"), R.now()
    if req.stream:  # one prompt (prepare.py): its n choices
        ids, text, _ = prepared[0]
        stream = completion_stream(srv, req, jobs, ids, text, rid, created)
        return StreamingResponse(stream, media_type="text/event-stream")
    outs = await run_all(jobs, request)
    n, best_of = req.n or 1, req.best_of or req.n or 1
    choices = []
    for p in range(len(prepared) // best_of):  # each prompt's n choices: its best_of candidates' best by
        # cumulative logprob (vLLM's best_of), in candidate order when best_of is n
        candidates = list(range(p * best_of, (p + 1) * best_of))
        if best_of > n:
            candidates = sorted(candidates, key=lambda c: -sum(e["logprob"] for e in outs[c].logprobs))[:n]
        for j, c in enumerate(candidates):
            ids, text, _ = prepared[c]
            choices.append(completion_choice(srv, req, p * n + j, ids, text, outs[c]))
    # every candidate's tokens, as vLLM counts them; each prompt once
    counted = usage(outs, srv.model.num_speculative_tokens, outs[::best_of])
    resp = R.CompletionResponse(
        id=rid,
        created=created,
        model=srv.model_name,
        choices=choices,
        usage=counted,
    )
    return Response(to_json(resp), media_type="application/json")


def completion_choice(
    srv: Server,
    req: P.CompletionRequest,
    index: int,
    prompt_ids: list[int],
    prompt_text: str | None,
    out: RequestOutput,
) -> R.CompletionChoice:
    prefix = ""
    if req.echo:
        prefix = prompt_text if prompt_text is not None else srv.model.tokenizer.decode(prompt_ids)
    logprobs = None
    if req.logprobs is not None:
        # offsets count each token's text (vLLM's), the echoed prompt's too: where the prompt has a
        # character split over tokens, its tokens' texts are longer than the prompt
        echoed = srv.logprobs.completion(out.prompt_logprobs, prompt_ids, 0, req.logprobs) if req.echo else None
        offset = sum(map(len, echoed.tokens)) if echoed is not None else 0
        logprobs = srv.logprobs.completion(out.logprobs or [], out.token_ids, offset)  # none at max_tokens 0
        if echoed is not None:
            logprobs = merge_completion_logprobs(echoed, logprobs)
    return R.CompletionChoice(
        index=index,
        text=prefix + out.text,
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        token_ids=out.token_ids if req.return_token_ids else None,
        prompt_token_ids=prompt_ids if req.return_token_ids else None,
        prompt_logprobs=_prompt_logprobs(srv, req, out),
    )


async def completion_stream(
    srv: Server,
    req: P.CompletionRequest,
    jobs: list[Job],
    prompt_ids: list[int],
    prompt_text: str | None,
    rid: str,
    created: int,
) -> AsyncIterator[str]:
    """The prompt's choices' chunks, interleaved as their tokens come, each marked by its index."""
    num_tokens = [0] * len(jobs)  # generated so far, per choice
    offsets = [0] * len(jobs)  # each choice's logprob text offset
    outs: list[RequestOutput | None] = [None] * len(jobs)

    def chunk(i: int, text: str, **fields) -> str:
        choice = R.CompletionChoice(index=i, text=text, **fields)
        usage = running_usage(req, jobs[i], num_tokens[i])
        return sse(R.CompletionResponse(id=rid, created=created, model=srv.model_name, choices=[choice], usage=usage))

    try:
        # prompt_token_ids on each choice's first chunk (vLLM's)
        first = [{"prompt_token_ids": prompt_ids} if req.return_token_ids else {} for _ in jobs]
        if req.echo:
            prefix = prompt_text if prompt_text is not None else srv.model.tokenizer.decode(prompt_ids)
            for i in range(len(jobs)):
                offsets[i] = len(prefix)
                yield chunk(i, prefix, **first[i])
                first[i] = {}
        async for i, ev in interleave(jobs):
            num_tokens[i] += len(ev.token_ids)
            logprobs = partial(srv.logprobs.completion, token_ids=ev.token_ids, offset=offsets[i])
            fields = token_fields(req, ev, logprobs)
            if ev.text or fields or first[i]:
                yield chunk(i, ev.text, **first[i], **fields)
                first[i] = {}
            if "logprobs" in fields:  # by each token's text, as the non-streamed offsets (not the text sent)
                offsets[i] += sum(map(len, fields["logprobs"].tokens))
            if ev.output is not None:
                outs[i] = ev.output
                yield chunk(i, "", finish_reason=ev.output.finish_reason, stop_reason=ev.output.stop_reason)
        if req.include_usage:
            yield usage_chunk(R.CompletionResponse, srv, rid, created, outs)
        yield SSE_DONE
    except Exception as e:
        yield stream_error(e)
    finally:
        for job in jobs:
            job.cancel()
