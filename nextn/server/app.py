"""`nextn serve`: the OpenAI-compatible HTTP routes on FastAPI + uvicorn.

Owns the routes, error bodies, SSE streaming and the app's lifetime: the guard in front (API key
and body size, before any parsing), a periodic throughput log line, and a graceful shutdown (on
SIGTERM admission stops, open requests get `shutdown_timeout` seconds, then the rest are ended
with a final error event). Every error is an OpenAI-shaped body; a 500 never carries internal
exception text. Requests become prompts in prepare.py; generation happens on the engine thread
(worker.py); a chat reply is split into reasoning, content and tool calls by chat_output.py; this
module only submits jobs and formats what comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from nextn.config import ServeConfig
from nextn.core import RequestOutput, SamplingParams
from nextn.engine.llm import LLM, RequestError
from nextn.engine.scheduler import QueueFull
from nextn.server import protocol as P
from nextn.server.chat_output import ChatOutputParser, Parts, ReasoningStart
from nextn.server.guard import Guard
from nextn.server.metrics import Metrics, ThroughputLog
from nextn.server.options import ServerOptions
from nextn.server.prepare import APIError, Prompts, text_content
from nextn.server.responses import (
    SSE_DONE,
    LogprobFormatter,
    merge_completion_logprobs,
    sse,
    stop_string_tail,
    to_json,
    usage,
    validation_error,
)
from nextn.server.worker import ClientGone, EngineWorker, Job, Unavailable

log = logging.getLogger("nextn.server")

RETRY_AFTER_S = 1  # what a 503 for a full queue asks a client to wait
# documented on every route instead of FastAPI's 422 (the server answers 400 for a bad body)
ERROR_RESPONSES = {
    status: {"model": P.ErrorResponse, "description": what}
    for status, what in (
        (400, "Invalid request: the message and `param` name the field"),
        (401, "Missing or wrong API key"),
        (413, "Request body larger than the server's limit"),
        (503, "Engine full (with Retry-After), shutting down, or the engine stopped"),
    )
}


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


@dataclass
class Server:
    """What the routes share."""

    llm: LLM
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
    if isinstance(e, Unavailable):
        info = P.ErrorInfo(message=f"{e}.", type="server_error", code="service_unavailable")
    elif isinstance(e, RequestError):
        info = P.ErrorInfo(message=str(e), type="invalid_request_error")
    else:
        log.error("stream failed", exc_info=e)
        info = P.ErrorInfo(message="The server failed on this request.", type="server_error")
    return f"data: {to_json(P.ErrorResponse(error=info))}\n\n{SSE_DONE}"


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


async def run_all(jobs: list[Job], request: Request) -> list[RequestOutput]:
    if len(jobs) == 1:
        return [await run_to_end(jobs[0], request)]
    try:
        async with asyncio.TaskGroup() as tg:  # the first job polls for a disconnect for all of them
            tasks = [tg.create_task(run_to_end(job, request if i == 0 else None)) for i, job in enumerate(jobs)]
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


def output_parser(req: P.ChatCompletionRequest, reasoning: ReasoningStart | None) -> ChatOutputParser:
    """The reply's parser: tool calls are parsed when the request gives tools and allows calls."""
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    return ChatOutputParser(reasoning, tools)


def finish_reason(out: RequestOutput, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and out.finish_reason == "stop" else out.finish_reason


async def chat_completion(srv: Server, req: P.ChatCompletionRequest, request: Request) -> Response:
    prompt_ids, params, checkpoint_at, reasoning = await run_in_threadpool(srv.prompts.chat, req)
    job = srv.submit(prompt_ids, params, checkpoint_at)
    rid, created = P.new_id("chatcmpl"), P.now()
    parser = output_parser(req, reasoning)
    if req.stream:
        return StreamingResponse(chat_stream(srv, req, job, parser, rid, created), media_type="text/event-stream")
    out = await run_to_end(job, request)
    parts = parser.push(echo_prefix(req) + out.text + _stop_tail(srv, req, out))
    rest = parser.finish()
    calls = parts.tool_calls + rest.tool_calls
    message = P.AssistantMessage(
        content=(parts.content + rest.content) or (None if calls else ""),
        reasoning_content=(parts.reasoning + rest.reasoning) or None,
        tool_calls=calls or None,
    )
    choice = P.ChatChoice(
        message=message,
        finish_reason=finish_reason(out, len(calls)),
        logprobs=srv.logprobs.chat(out.logprobs) if out.logprobs is not None else None,
        token_ids=out.token_ids if req.return_token_ids else None,
    )
    resp = P.ChatCompletionResponse(
        id=rid,
        created=created,
        model=srv.model_name,
        choices=[choice],
        usage=usage([out], srv.llm.num_speculative_tokens),
        prompt_token_ids=prompt_ids if req.return_token_ids else None,
        prompt_logprobs=_prompt_logprobs(srv, req, out),
    )
    return Response(to_json(resp), media_type="application/json")


def _stop_tail(srv: Server, req: P.SamplingRequest, out: RequestOutput) -> str:
    return stop_string_tail(srv.llm.tokenizer, out, req.stop_list) if req.include_stop_str_in_output else ""


def _prompt_logprobs(srv: Server, req: P.SamplingRequest, out: RequestOutput):
    if req.prompt_logprobs is None or out.prompt_logprobs is None:
        return None
    return srv.logprobs.prompt(out.prompt_logprobs, req.prompt_logprobs)


async def chat_stream(
    srv: Server, req: P.ChatCompletionRequest, job: Job, parser: ChatOutputParser, rid: str, created: int
) -> AsyncIterator[str]:
    def chunk(delta: P.DeltaMessage, **fields) -> str:
        choice = P.ChatChunkChoice(delta=delta, **fields)
        return sse(P.ChatCompletionChunk(id=rid, created=created, model=srv.model_name, choices=[choice]))

    def deltas(parts: Parts, **fields) -> list[str]:
        """The parts as chunks; the event's logprobs and token ids ride on the first (on an empty
        delta when the parser holds all of its text back)."""
        out = parts.delta(parser.num_calls - len(parts.tool_calls)) or ([P.DeltaMessage()] if fields else [])
        return [chunk(d, **(fields if i == 0 else {})) for i, d in enumerate(out)]

    try:
        yield chunk(P.DeltaMessage(role="assistant", content=""))
        for c in deltas(parser.push(echo_prefix(req))):
            yield c
        async for ev in job.events():
            text = ev.text + (_stop_tail(srv, req, ev.output) if ev.output is not None else "")
            fields = {}
            if ev.logprobs:
                fields["logprobs"] = srv.logprobs.chat(ev.logprobs)
            if req.return_token_ids and ev.token_ids:
                fields["token_ids"] = ev.token_ids
            for c in deltas(parser.push(text), **fields):
                yield c
            if ev.output is not None:
                for c in deltas(parser.finish()):
                    yield c
                yield chunk(P.DeltaMessage(), finish_reason=finish_reason(ev.output, parser.num_calls))
                if req.include_usage:
                    yield sse(
                        P.ChatCompletionChunk(
                            id=rid,
                            created=created,
                            model=srv.model_name,
                            choices=[],
                            usage=usage([ev.output], srv.llm.num_speculative_tokens),
                        )
                    )
        yield SSE_DONE
    except Exception as e:  # the response has started: report in the stream
        yield stream_error(e)
    finally:
        job.cancel()


async def completion(srv: Server, req: P.CompletionRequest, request: Request) -> Response:
    prepared = await run_in_threadpool(srv.prompts.completion, req)
    jobs = []
    try:
        for ids, _, params in prepared:
            jobs.append(srv.submit(ids, params))
    except APIError:
        for job in jobs:
            job.cancel()
        raise
    rid, created = P.new_id("cmpl"), P.now()
    if req.stream:
        ids, text, _ = prepared[0]
        return StreamingResponse(
            completion_stream(srv, req, jobs[0], ids, text, rid, created), media_type="text/event-stream"
        )
    outs = await run_all(jobs, request)
    choices = [
        completion_choice(srv, req, i, ids, text, out)
        for i, ((ids, text, _), out) in enumerate(zip(prepared, outs, strict=True))
    ]
    resp = P.CompletionResponse(
        id=rid,
        created=created,
        model=srv.model_name,
        choices=choices,
        usage=usage(outs, srv.llm.num_speculative_tokens),
    )
    return Response(to_json(resp), media_type="application/json")


def completion_choice(
    srv: Server,
    req: P.CompletionRequest,
    index: int,
    prompt_ids: list[int],
    prompt_text: str | None,
    out: RequestOutput,
) -> P.CompletionChoice:
    prefix = ""
    if req.echo:
        prefix = prompt_text if prompt_text is not None else srv.llm.tokenizer.decode(prompt_ids)
    logprobs = None
    if req.logprobs is not None:
        logprobs = srv.logprobs.completion(out.logprobs, out.token_ids, len(prefix))
        if req.echo:
            echoed = srv.logprobs.completion(out.prompt_logprobs, prompt_ids, 0, req.logprobs)
            logprobs = merge_completion_logprobs(echoed, logprobs)
    return P.CompletionChoice(
        index=index,
        text=prefix + out.text + _stop_tail(srv, req, out),
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        token_ids=out.token_ids if req.return_token_ids else None,
        prompt_token_ids=prompt_ids if req.return_token_ids else None,
        prompt_logprobs=_prompt_logprobs(srv, req, out),
    )


async def completion_stream(
    srv: Server,
    req: P.CompletionRequest,
    job: Job,
    prompt_ids: list[int],
    prompt_text: str | None,
    rid: str,
    created: int,
) -> AsyncIterator[str]:
    def chunk(text: str, **fields) -> str:
        choice = P.CompletionChoice(text=text, **fields)
        return sse(P.CompletionResponse(id=rid, created=created, model=srv.model_name, choices=[choice]))

    try:
        offset = 0
        if req.echo:
            prefix = prompt_text if prompt_text is not None else srv.llm.tokenizer.decode(prompt_ids)
            offset = len(prefix)
            yield chunk(prefix, prompt_token_ids=prompt_ids if req.return_token_ids else None)
        async for ev in job.events():
            text = ev.text + (_stop_tail(srv, req, ev.output) if ev.output is not None else "")
            if text or ev.logprobs:
                lp = None
                if ev.logprobs is not None:
                    lp = srv.logprobs.completion(ev.logprobs, ev.token_ids, offset)
                offset += len(text)
                yield chunk(text, logprobs=lp, token_ids=ev.token_ids if req.return_token_ids else None)
            if ev.output is not None:
                yield chunk("", finish_reason=ev.output.finish_reason)
                if req.include_usage:
                    yield sse(
                        P.CompletionResponse(
                            id=rid,
                            created=created,
                            model=srv.model_name,
                            choices=[],
                            usage=usage([ev.output], srv.llm.num_speculative_tokens),
                        )
                    )
        yield SSE_DONE
    except Exception as e:
        yield stream_error(e)
    finally:
        job.cancel()


# ---------------------------------------------------------------------------------------------
# The app


def create_app(llm: LLM, cfg: ServeConfig, opts: ServerOptions | None = None) -> FastAPI:
    opts = opts or ServerOptions()
    metrics = Metrics(llm.num_speculative_tokens)
    worker = EngineWorker(llm, cfg, metrics)
    model_name = cfg.served_model_name or llm.model_name
    srv = Server(
        llm,
        opts,
        worker,
        metrics,
        Prompts(llm, model_name, opts.reasoning_parser),
        model_name,
        P.now(),
        LogprobFormatter(llm.tokenizer),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        ticker = asyncio.create_task(log_throughput(srv)) if opts.log_interval > 0 else None
        try:
            yield
        finally:
            if ticker is not None:
                ticker.cancel()
            await run_in_threadpool(worker.stop)

    app = FastAPI(title="nextn", lifespan=lifespan, version=nextn_version())
    app.state.server = srv
    open_paths = {"/health"} | ({"/metrics"} if opts.metrics_open else set())
    app.add_middleware(
        Guard,
        api_key=cfg.api_key,
        max_request_bytes=opts.max_request_bytes,
        open_paths=frozenset(open_paths),
        on_reject=metrics.rejected_request,
    )
    add_routes(app, srv)
    add_error_handlers(app, metrics)
    document_errors(app)
    return app


def add_routes(app: FastAPI, srv: Server) -> None:
    llm, worker, metrics = srv.llm, srv.worker, srv.metrics
    v1 = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)

    @v1.get("/models")
    async def models() -> P.ModelList:
        return P.ModelList(
            data=[P.ModelCard(id=srv.model_name, created=srv.created, max_model_len=llm.config.max_model_len)]
        )

    @v1.post("/chat/completions")
    async def chat(req: P.ChatCompletionRequest, request: Request) -> Response:
        return await chat_completion(srv, req, request)

    @v1.post("/completions")
    async def completions(req: P.CompletionRequest, request: Request) -> Response:
        return await completion(srv, req, request)

    app.include_router(v1)

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(req: P.TokenizeRequest) -> P.TokenizeResponse:
        ids = await run_in_threadpool(srv.prompts.tokenize, req)
        strs = [llm.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        return P.TokenizeResponse(count=len(ids), max_model_len=llm.config.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        srv.prompts.check_model(req.model)
        vocab = llm.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return P.DetokenizeResponse(prompt=llm.tokenizer.decode(req.tokens))

    @app.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": nextn_version()}

    @app.get("/health")
    async def health() -> Response:
        if not worker.alive or worker.draining:
            why = "The server is shutting down." if worker.draining else "The engine is not running."
            return error_response(503, why, "server_error", code="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.set_queue(worker.num_running, worker.num_waiting)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> Response:
        if e.status == 400:
            metrics.rejected_request("bad_request")
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> Response:
        metrics.rejected_request("bad_request")
        found = [validation_error(err) for err in e.errors()]
        message = "; ".join(dict.fromkeys(f"{p}: {m}" if p else m for p, m in found)) or "invalid request"
        param = max((p for p, _ in found), key=len, default="")  # the deepest: a union's matching member
        return error_response(400, message, "invalid_request_error", param or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        if e.status_code >= 500:
            log.error("HTTP %d: %s", e.status_code, e.detail)
            return error_response(e.status_code, "The server failed on this request.", "server_error")
        return error_response(e.status_code, str(e.detail), "invalid_request_error")

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone) -> Response:
        return error_response(499, "client disconnected", "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> Response:
        log.error("request failed", exc_info=e)
        return error_response(500, "The server failed on this request.", "server_error")


def document_errors(app: FastAPI) -> None:
    """The OpenAPI schema lists the 400 the server answers for a bad body, not FastAPI's 422."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for route in schema.get("paths", {}).values():
                for op in route.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def nextn_version() -> str:
    try:
        return version("nextn")
    except PackageNotFoundError:
        return "unknown"


async def log_throughput(srv: Server) -> None:
    """One log line per interval while there is traffic: throughput, queue, draft acceptance."""
    meter = ThroughputLog(srv.metrics)
    while True:
        await asyncio.sleep(srv.opts.log_interval)
        line = meter.line(srv.worker.num_running, srv.worker.num_waiting)
        if line is not None:
            log.info(line)


# ---------------------------------------------------------------------------------------------
# Serving


class GracefulServer(uvicorn.Server):
    """uvicorn, with the worker drained first when it shuts down (SIGTERM/SIGINT or should_exit):
    open requests get `shutdown_timeout` seconds, then end with an error (a stream: a final error
    event), so the connections close and uvicorn's own wait returns."""

    def __init__(self, app: FastAPI, **config):
        self.srv: Server = app.state.server
        timeout = self.srv.opts.shutdown_timeout
        # uvicorn's own limit is a backstop: the worker ends every open request at `timeout`
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=int(timeout) + 3, **config))

    async def shutdown(self, sockets=None) -> None:
        self.srv.worker.drain(self.srv.opts.shutdown_timeout)
        await super().shutdown(sockets)


def serve(llm: LLM, cfg: ServeConfig, opts: ServerOptions | None = None) -> int:
    """Serve until SIGTERM/SIGINT (`nextn serve`: nextn.cli builds the LLM and the configs)."""
    if not logging.getLogger().handlers:  # the caller set up no logging: INFO lines to stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info(
        "serving %s on http://%s:%d (spec K=%d, context %d)",
        cfg.served_model_name or llm.model_name,
        cfg.host,
        cfg.port,
        llm.num_speculative_tokens,
        llm.config.max_model_len,
    )
    server = GracefulServer(create_app(llm, cfg, opts), host=cfg.host, port=cfg.port, log_level="info")
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0
