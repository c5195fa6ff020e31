"""`nextn serve`: the OpenAI-compatible HTTP app on FastAPI + uvicorn.

Owns the routes, error bodies and the app's lifetime: the guard in front (API key and body size,
before any parsing), a periodic throughput log line, and a graceful shutdown (on SIGTERM admission
stops, open requests get `shutdown_timeout` seconds, then the rest are ended with a final error
event). Every error is an OpenAI-shaped body; a 500 never carries internal exception text. The
generation routes hand their work to completions.py (jobs sent to the engine core, responses and
SSE streams) and responses_api.py (/v1/responses, over the chat path); this module only builds the
app around them and serves it.

The engine core runs in its own process under `nextn serve` (a CoreProcess: nextn.server.core_client)
or on a thread of this one for an `LLM` built here (tests, embedding: nextn.server.worker.ThreadCore).
When a core process dies, the server answers 503 naming the cause, then exits non-zero after
CORE_DEATH_EXIT_S, for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import resource
import threading
import warnings
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from nextn.config.serve import ServeConfig, ServerOptions
from nextn.engine.llm import LLM
from nextn.server import protocol as P
from nextn.server import response_models as R
from nextn.server import responses_protocol as Q
from nextn.server.completions import Server, chat_completion, completion
from nextn.server.connections import (
    GuardedH11Protocol,
    accept_backlog,
    default_limit_concurrency,
    limit_transport_logs,
    raise_fd_limit,
)
from nextn.server.core_client import CoreProcess
from nextn.server.guard import Guard
from nextn.server.metrics import Metrics, ThroughputLog
from nextn.server.prepare import APIError, Prompts
from nextn.server.responses import LogprobFormatter, validation_error
from nextn.server.responses_api import create_response
from nextn.server.worker import ClientGone, EngineWorker, ThreadCore

log = logging.getLogger("nextn.server")

CORE_DEATH_EXIT_S = 1.0  # a dead core's server answers 503 this long (clients and health probes see why), then exits

# the errors any route may answer, documented on each (instead of FastAPI's 422: a bad body is a
# 400): the Guard's (a bad Content-Length, a body too large or too slow, the API key: not on the
# open paths) and the connection cap's, besides each route's own
ERROR_RESPONSES = {
    400: "Invalid request: the message and `param` name the field",
    401: "Missing or wrong API key",
    408: "The request body did not arrive within the server's read timeout",
    413: "Request body larger than the server's limit",
    503: "Too many open connections, the engine full (with Retry-After), shutting down, or stopped",
}
# a generation route's 200: its JSON body, or with `"stream": true` server-sent events (`data: {chunk}`
# lines, then `data: [DONE]`). Before OpenAPI 3.2 (FastAPI writes 3.1) an event stream's `schema`
# describes one event, as its fields: what a client (and schemathesis) reads from each
SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event: `data` a JSON chunk of the stream (the last `[DONE]` on the "
    "completions routes); /v1/responses names each event's type in `event`",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
    "required": ["data"],
}
STREAM = {"text/event-stream": {"schema": SSE_EVENT}}


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = R.ErrorResponse(error=R.ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


# ---------------------------------------------------------------------------------------------
# The app


def create_app(engine: LLM | CoreProcess, cfg: ServeConfig, opts: ServerOptions | None = None) -> FastAPI:
    """engine: a started engine core process (`nextn serve`), or an LLM of this process (its engine
    then runs on a thread of the server: tests, embedding)."""
    opts = opts or ServerOptions()
    core = engine if isinstance(engine, CoreProcess) else ThreadCore(engine)
    model = core.model if opts.chat_template is None else core.model.with_chat_template(opts.chat_template)
    metrics = Metrics(model.num_speculative_tokens)
    worker = EngineWorker(core, model.max_num_seqs + cfg.max_queue, metrics)
    model_names = cfg.served_model_name or (model.model_name,)  # responses carry the first, as vLLM's
    srv = Server(
        model,
        opts,
        worker,
        metrics,
        Prompts(model, model_names, opts),
        model_names[0],
        R.now(),
        LogprobFormatter(model.tokenizer),
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

    docs = {} if opts.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="nextn", lifespan=lifespan, version=nextn_version(), root_path=opts.root_path, **docs)
    app.state.server = srv
    open_paths = {"/health"} | ({"/metrics"} if opts.metrics_open else set())
    app.add_middleware(
        Guard,
        api_key=cfg.api_key,
        max_request_bytes=opts.max_request_bytes,
        read_timeout=opts.request_read_timeout,
        open_paths=frozenset(open_paths),
        on_reject=metrics.rejected_request,
    )
    if opts.allowed_origins:  # outermost: a browser's preflight is answered before the key is asked for
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(opts.allowed_origins),
            allow_methods=list(opts.allowed_methods),
            allow_headers=list(opts.allowed_headers),
            allow_credentials=opts.allow_credentials,
        )
    add_routes(app, srv)
    add_error_handlers(app, metrics)
    document_errors(app, open_paths)
    return app


def add_routes(app: FastAPI, srv: Server) -> None:
    served, worker, metrics = srv.model, srv.worker, srv.metrics
    v1 = APIRouter(prefix="/v1")

    def card(name: str) -> R.ModelCard:
        return R.ModelCard(id=name, created=srv.created, max_model_len=served.max_model_len)

    @v1.get("/models")
    async def models() -> R.ModelList:
        return R.ModelList(data=[card(name) for name in srv.prompts.model_names])

    # OpenAI's retrieve; a model name may hold "/" (org/name)
    @v1.get("/models/{model:path}", responses={404: {"model": R.ErrorResponse, "description": "No such model"}})
    async def model(model: str) -> R.ModelCard:
        try:
            srv.prompts.check_model(model)
        except APIError as e:
            raise APIError(404, e.message, param=e.param, code=e.code) from None
        return card(model)

    @v1.post("/chat/completions", responses={200: {"model": R.ChatCompletionResponse, "content": STREAM}})
    async def chat(req: P.ChatCompletionRequest, request: Request) -> Response:
        return await chat_completion(srv, req, request)

    @v1.post("/completions", responses={200: {"model": R.CompletionResponse, "content": STREAM}})
    async def completions(req: P.CompletionRequest, request: Request) -> Response:
        return await completion(srv, req, request)

    # the Responses API: streamed, typed events (`event: TYPE` and `data: {event}` lines)
    @v1.post("/responses", responses={200: {"model": Q.ResponseObject, "content": STREAM}})
    async def responses(req: Q.ResponsesRequest, request: Request) -> Response:
        return await create_response(srv, req, request)

    app.include_router(v1)

    @app.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest) -> R.TokenizeResponse:
        ids = await run_in_threadpool(srv.prompts.tokenize, req)
        strs = [served.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        return R.TokenizeResponse(count=len(ids), max_model_len=served.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest) -> R.DetokenizeResponse:
        srv.prompts.check_model(req.model)
        vocab = served.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        # special tokens kept (as vLLM's): /tokenize of chat messages round-trips to the rendered prompt
        return R.DetokenizeResponse(prompt=served.tokenizer.decode(req.tokens, skip_special_tokens=False))

    @app.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": nextn_version()}

    ok = {"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}
    up = {200: {"content": {"application/json": {"schema": ok}}}}

    # HEAD: load balancers' and uptime probes' check (one route: a 405 names both in Allow)
    @app.api_route("/health", methods=["GET", "HEAD"], responses=up)
    async def health() -> Response:
        if not worker.alive or worker.draining:
            why = "The server is shutting down." if worker.draining else "The engine is not running."
            return error_response(503, why, "server_error", code="service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
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
        # e.headers: a 405's `Allow` (RFC 9110 requires it), for one
        return error_response(e.status_code, str(e.detail), "invalid_request_error", headers=e.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone) -> Response:
        return error_response(499, "client disconnected", "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> Response:
        log.error("request failed", exc_info=e)
        return error_response(500, "The server failed on this request.", "server_error")


def document_errors(app: FastAPI, open_paths: set[str]) -> None:
    """The OpenAPI schema lists on every operation the errors the server may answer there
    (ERROR_RESPONSES; a 401 only where a key is asked), and not FastAPI's 422 (a bad body is a 400)."""
    build = app.openapi
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}

    def openapi() -> dict:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # FastAPI names a route's methods alike (/health): renamed below
                warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
                schema = build()
            for path, route in schema.get("paths", {}).items():
                for method, op in route.items():
                    if len(route) > 1 and not op.get("operationId", method).endswith(method):
                        op["operationId"] += f"_{method}"
                    responses = op.setdefault("responses", {})
                    responses.pop("422", None)
                    for status, what in ERROR_RESPONSES.items():
                        if status != 401 or path not in open_paths:
                            responses.setdefault(str(status), {"description": what, "content": error})
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
    event), so the connections close and uvicorn's own wait returns. Over a core process, the
    core's death shuts the server down too (CORE_DEATH_EXIT_S after it). Connections are uvicorn's
    h11 ones with a header deadline and a cap that evicts idle ones (nextn.server.connections)."""

    def __init__(self, app: FastAPI, **config):
        self.srv: Server = app.state.server
        opts = self.srv.opts
        timeout = opts.shutdown_timeout
        fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = opts.limit_concurrency if opts.limit_concurrency is not None else default_limit_concurrency(fds)
        limit_transport_logs()
        backlog = accept_backlog(fds, limit)
        http = functools.partial(GuardedH11Protocol, read_timeout=opts.request_read_timeout, max_connections=limit)
        # uvicorn's own limit is a backstop: the worker ends every open request at `timeout`
        super().__init__(
            uvicorn.Config(
                app,
                http=http,
                timeout_keep_alive=opts.timeout_keep_alive,
                # its 503 check counts closing connections too: ours decides, this is a backstop
                limit_concurrency=2 * limit + backlog,
                backlog=backlog,
                timeout_graceful_shutdown=int(timeout) + 3,
                **config,
            )
        )
        if self.srv.worker.core.exit_on_death:
            self.srv.worker.on_death = self._core_died

    def _core_died(self, reason: str) -> None:
        log.critical("the server stops in %.0f s: %s", CORE_DEATH_EXIT_S, reason)
        timer = threading.Timer(CORE_DEATH_EXIT_S, setattr, (self, "should_exit", True))
        timer.daemon = True
        timer.start()

    async def shutdown(self, sockets=None) -> None:
        self.srv.worker.drain(self.srv.opts.shutdown_timeout)
        await super().shutdown(sockets)


def serve(engine: LLM | CoreProcess, cfg: ServeConfig, opts: ServerOptions | None = None) -> int:
    """Serve until SIGTERM/SIGINT, or until a core process dies (then the status is 1). `nextn
    serve` (nextn.commands) starts the core process and builds the configs; an LLM of this process
    is served from an engine thread."""
    if not logging.getLogger().handlers:  # the caller set up no logging: INFO lines to stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_fd_limit()  # before the connection cap is derived from it
    opts = opts or ServerOptions()
    app = create_app(engine, cfg, opts)
    srv: Server = app.state.server
    log.info(
        "serving %s on %s://%s:%d (spec K=%d, context %d)",
        ", ".join(srv.prompts.model_names),
        "https" if opts.ssl_certfile else "http",
        cfg.host,
        cfg.port,
        srv.model.num_speculative_tokens,
        srv.model.max_model_len,
    )
    tls = {"ssl_keyfile": opts.ssl_keyfile, "ssl_certfile": opts.ssl_certfile, "ssl_ca_certs": opts.ssl_ca_certs}
    server = GracefulServer(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=opts.uvicorn_log_level,
        access_log=opts.access_log,
        ssl_cert_reqs=opts.ssl_cert_reqs,
        **tls,
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if srv.worker.death is None else 1
