"""`nextn serve`: the OpenAI-compatible HTTP routes on FastAPI + uvicorn.

Owns request validation (every bad input is an OpenAI-shaped 400 before anything is queued),
prompt building (the checkpoint's chat template), auth, error bodies, SSE streaming and the
app's lifetime. Generation itself happens on the engine thread (worker.py); this module only
submits jobs and formats what comes back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from nextn.config import ServeConfig
from nextn.core import RequestOutput, SamplingParams
from nextn.engine.llm import LLM, RequestError
from nextn.engine.scheduler import QueueFull, common_prefix
from nextn.server import protocol as P
from nextn.server.metrics import Metrics
from nextn.server.responses import SSE_DONE, LogprobFormatter, merge_completion_logprobs, sse, to_json, usage
from nextn.server.worker import ClientGone, EngineWorker, Job
from nextn.tokenizer import TokenizerError

log = logging.getLogger("nextn.server")

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_BATCH = 64  # prompts in one (non-streamed) /v1/completions request


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


@dataclass
class Server:
    """What the routes share."""

    llm: LLM
    cfg: ServeConfig
    worker: EngineWorker
    metrics: Metrics
    model_name: str
    created: int
    logprobs: LogprobFormatter

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.llm.model_name):
            raise APIError(
                400,
                f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def prompt_checks(self, prompt_ids: list[int], params: SamplingParams, param: str) -> None:
        try:
            self.llm.check_prompt(prompt_ids, params)
        except RequestError as e:
            too_long = len(prompt_ids) >= self.llm.config.max_model_len
            raise APIError(400, str(e), param=param, code="context_length_exceeded" if too_long else None) from None

    def submit(self, prompt_ids: list[int], params: SamplingParams, checkpoint_at: int | None = None) -> Job:
        job = Job(prompt_ids, params, asyncio.get_running_loop(), checkpoint_at)
        try:
            self.worker.submit(job)
        except QueueFull as e:
            self.metrics.rejected_request("queue_full")
            raise APIError(
                503, f"The server is overloaded ({e}); retry later.", type_="server_error", code="server_overloaded"
            ) from None
        return job


# ---------------------------------------------------------------------------------------------
# Request -> prompt ids and sampling params


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


def sampling_params(
    req: P.SamplingRequest, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(req.temperature, 1.0),
            top_k=max(0, _or(req.top_k, 0)),
            top_p=_or(req.top_p, 1.0),
            min_p=_or(req.min_p, 0.0),
            repetition_penalty=_or(req.repetition_penalty, 1.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            presence_penalty=_or(req.presence_penalty, 0.0),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop=req.stop_list,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _or(value, default):
    return default if value is None else value


def template_messages(messages: list[P.ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise APIError(
                400,
                f"messages[{i}]: unknown role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}",
                param=f"messages[{i}].role",
            )
        d = m.model_dump(exclude_none=True)  # keeps name, tool_calls, tool_call_id, reasoning_content, ...
        d["role"] = "system" if m.role == "developer" else m.role
        d["content"] = _text_content(m.content, i)
        out.append(d)
    return out


def _text_content(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"messages[{i}].content[{j}]: content type {kind!r} is not supported "
                f"(this server takes text parts only)",
                param=f"messages[{i}].content",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def prepare_chat(srv: Server, req: P.ChatCompletionRequest) -> tuple[list[int], SamplingParams, int | None]:
    """(prompt ids, params, session checkpoint position). Blocking (template rendering,
    tokenizing): run it in a worker thread."""
    srv.check_model(req.model)
    if req.tool_choice not in (None, "auto", "none"):
        raise APIError(400, "only tool_choice 'auto' or 'none' is supported", param="tool_choice")
    if req.response_format and req.response_format.get("type") != "text":
        raise APIError(400, "response_format other than 'text' is not supported yet", param="response_format")
    kwargs = {
        k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in ("messages", "add_generation_prompt")
    }
    if req.tools:
        kwargs["tools"] = req.tools
    messages = template_messages(req.messages)
    tok = srv.llm.tokenizer
    try:
        prompt_ids = tok.encode(tok.apply_chat_template(messages, req.add_generation_prompt, **kwargs))
        # the session checkpoint goes where the conversation ends and the generation prompt starts:
        # the next turn re-renders this reply after that point, tokenized as the template pleases
        checkpoint_at = None
        if req.add_generation_prompt:
            history_ids = tok.encode(tok.apply_chat_template(messages, False, **kwargs))
            checkpoint_at = common_prefix(history_ids, prompt_ids)
    except (TokenizerError, jinja2.TemplateError) as e:
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
    srv.prompt_checks(prompt_ids, SamplingParams(), "messages")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), srv.llm.config.max_model_len, param)
    top = (req.top_logprobs or 0) if req.logprobs else None
    return prompt_ids, sampling_params(req, max_tokens, top), checkpoint_at


def prepare_completion(srv: Server, req: P.CompletionRequest) -> list[tuple[list[int], str | None, SamplingParams]]:
    """(prompt ids, prompt text if given as text, params) per prompt of the batch."""
    srv.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    p = req.prompt
    prompts = [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)
    if len(prompts) > 1 and req.stream:
        raise APIError(400, "a batch of prompts cannot be streamed", param="prompt")
    if len(prompts) > MAX_BATCH:
        raise APIError(400, f"at most {MAX_BATCH} prompts per request", param="prompt")
    if req.echo and req.stream and req.logprobs is not None:
        raise APIError(400, "echo with logprobs cannot be streamed", param="echo")
    out = []
    for prompt in prompts:
        ids = srv.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        srv.prompt_checks(ids, SamplingParams(), "prompt")
        max_tokens = resolve_max_tokens(
            req.max_tokens if req.max_tokens is not None else 16, len(ids), srv.llm.config.max_model_len, "max_tokens"
        )
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
        out.append(
            (
                ids,
                prompt if isinstance(prompt, str) else None,
                sampling_params(req, max_tokens, req.logprobs, prompt_lp),
            )
        )
    return out


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


async def chat_completion(srv: Server, req: P.ChatCompletionRequest, request: Request) -> Response:
    prompt_ids, params, checkpoint_at = await run_in_threadpool(prepare_chat, srv, req)
    job = srv.submit(prompt_ids, params, checkpoint_at)
    rid, created = P.new_id("chatcmpl"), P.now()
    if req.stream:
        return StreamingResponse(chat_stream(srv, req, job, rid, created), media_type="text/event-stream")
    out = await run_to_end(job, request)
    choice = P.ChatChoice(
        message=P.AssistantMessage(content=out.text),
        finish_reason=out.finish_reason,
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
    )
    return Response(to_json(resp), media_type="application/json")


async def chat_stream(
    srv: Server, req: P.ChatCompletionRequest, job: Job, rid: str, created: int
) -> AsyncIterator[str]:
    def chunk(delta: P.DeltaMessage, **fields) -> str:
        choice = P.ChatChunkChoice(delta=delta, **fields)
        return sse(P.ChatCompletionChunk(id=rid, created=created, model=srv.model_name, choices=[choice]))

    try:
        yield chunk(P.DeltaMessage(role="assistant", content=""))
        async for ev in job.events():
            if ev.text or ev.logprobs:
                yield chunk(
                    P.DeltaMessage(content=ev.text),
                    logprobs=srv.logprobs.chat(ev.logprobs) if ev.logprobs is not None else None,
                    token_ids=ev.token_ids if req.return_token_ids else None,
                )
            if ev.output is not None:
                yield chunk(P.DeltaMessage(), finish_reason=ev.output.finish_reason)
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
        log.exception("stream failed")
        yield f"data: {to_json(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type='server_error')))}\n\n"
    finally:
        job.cancel()


async def completion(srv: Server, req: P.CompletionRequest, request: Request) -> Response:
    prepared = await run_in_threadpool(prepare_completion, srv, req)
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
            logprobs = merge_completion_logprobs(srv.logprobs.completion(out.prompt_logprobs, prompt_ids, 0), logprobs)
    return P.CompletionChoice(
        index=index,
        text=prefix + out.text,
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        token_ids=out.token_ids if req.return_token_ids else None,
        prompt_token_ids=prompt_ids if req.return_token_ids else None,
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
            if ev.text or ev.logprobs:
                lp = None
                if ev.logprobs is not None:
                    lp = srv.logprobs.completion(ev.logprobs, ev.token_ids, offset)
                offset += len(ev.text)
                yield chunk(ev.text, logprobs=lp, token_ids=ev.token_ids if req.return_token_ids else None)
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
        log.exception("stream failed")
        yield f"data: {to_json(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type='server_error')))}\n\n"
    finally:
        job.cancel()


# ---------------------------------------------------------------------------------------------
# The app


def create_app(llm: LLM, cfg: ServeConfig) -> FastAPI:
    metrics = Metrics(llm.num_speculative_tokens)
    worker = EngineWorker(llm, cfg, metrics)
    srv = Server(
        llm, cfg, worker, metrics, cfg.served_model_name or llm.model_name, P.now(), LogprobFormatter(llm.tokenizer)
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(worker.stop)

    app = FastAPI(title="nextn", lifespan=lifespan)
    app.state.server = srv

    async def check_auth(request: Request) -> None:
        if cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header.encode(), f"Bearer {cfg.api_key}".encode()):
            metrics.rejected_request("unauthorized")
            raise APIError(401, "Incorrect API key provided.", type_="authentication_error", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_auth)])

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

    @app.get("/health")
    async def health() -> Response:
        if not worker.alive:
            return error_response(503, "the engine thread is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.set_queue(worker.num_running, worker.num_waiting)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> Response:
        if e.status == 400:
            metrics.rejected_request("bad_request")
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> Response:
        metrics.rejected_request("bad_request")
        errors = e.errors()

        def where(err) -> str:
            return ".".join(str(x) for x in err["loc"] if x != "body")

        parts = [f"{where(err)}: {err['msg']}" if where(err) else err["msg"] for err in errors]
        param = (where(errors[0]) if errors else "") or None
        return error_response(400, "; ".join(parts) or "invalid request", "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        return error_response(e.status_code, str(e.detail), "invalid_request_error")

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone) -> Response:
        return error_response(499, "client disconnected", "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> Response:
        log.exception("request failed")
        return error_response(500, f"{type(e).__name__}: {e}", "server_error")

    return app


def serve(llm: LLM, cfg: ServeConfig) -> int:
    """Serve until interrupted (`nextn serve`: nextn.cli builds the LLM and the config)."""
    import uvicorn

    print(
        f"nextn: serving {cfg.served_model_name or llm.model_name} on http://{cfg.host}:{cfg.port} "
        f"(spec K={llm.num_speculative_tokens}, context {llm.config.max_model_len})",
        file=sys.stderr,
    )
    uvicorn.run(create_app(llm, cfg), host=cfg.host, port=cfg.port, log_level="info")
    return 0
