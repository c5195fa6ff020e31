"""Settings of `nextn serve` beside the engine's (nextn.config.engine_args): ServeConfig, the address,
the key, the model names and the queue; ServerOptions, the HTTP layer's limits and lifetime and
vLLM's front-end settings (chat template, tool-call parser, CORS, TLS, root path, uvicorn's logging).
Each field is a flag of `nextn serve` (nextn.config.flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from nextn.config.flags import json_list, json_object, setting

# vLLM's --tool-call-parser names nextn parses -> the `<tool_call>` body it reads and a forced call's grammar writes
TOOL_CALL_PARSERS = {"hermes": "json", "qwen3_coder": "xml", "qwen3_xml": "xml"}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs


def chat_template_text(value: str) -> str:
    """--chat-template: a file's text, or the template itself (vLLM's); a path that names no file is an error."""
    if Path(value).is_file():
        return Path(value).read_text()
    if "{{" in value or "{%" in value:
        return value
    raise argparse.ArgumentTypeError(f"{value}: no such file (and not a Jinja template: no {{{{ or {{%)")


def readable_file(path: str) -> str:
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{path}: no such file")
    return path


@dataclass(frozen=True)
class ServeConfig:
    """Where and to whom `nextn serve` answers."""

    host: str = setting("127.0.0.1", "the address to listen on")
    port: int = setting(8000, "the port to listen on", type=int)
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY'", metavar="KEY")
    # a str is one name; None: the model as the user gave it (a path stays the path: clients load the tokenizer from it)
    served_model_name: str | tuple[str, ...] | None = setting(
        None,
        "the names requests may use (responses carry the first; default: MODEL as given)",
        nargs="+",
        metavar="NAME",
    )
    max_queue: int = setting(64, "waiting requests beyond this are answered 503 at once", type=int)

    def __post_init__(self):
        names = self.served_model_name
        if names is not None:
            names = (names,) if isinstance(names, str) else tuple(names)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"served_model_name must be one or more names, got {self.served_model_name!r}")
            object.__setattr__(self, "served_model_name", names)
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")


@dataclass(frozen=True)
class ServerOptions:
    """The HTTP layer's limits and lifetime, and vLLM's front-end settings."""

    max_request_bytes: int = setting(16 * 2**20, "a larger request body is answered 413 unread", type=int)
    shutdown_timeout: float = setting(10.0, "seconds open requests get after SIGTERM", type=float)
    metrics_open: bool = setting(False, "/metrics without the API key (for scrapers)")
    log_interval: float = setting(
        10.0,
        "seconds between throughput log lines (0: none; vLLM's --disable-log-stats: none)",
        type=float,
        consts={"--disable-log-stats": 0.0},
    )
    reasoning_parser: str | None = setting(
        None,
        "qwen3: a reply's <think>...</think> goes to reasoning_content; structured outputs apply after it",
        choices=("qwen3",),
    )
    timeout_keep_alive: int = setting(5, "seconds an idle kept-alive connection stays open (uvicorn's)", type=int)
    request_read_timeout: float = setting(
        30.0,
        "seconds a client gets to send a request's headers (from connecting or its last response), then as long "
        "for its body; a late one is closed (headers) or answered 408 (body)",
        type=float,
    )
    limit_concurrency: int | None = setting(
        None,
        "open connections at most; past it the oldest idle one is closed, or the new one answered 503 (default: "
        "half the open-file limit, raised at start towards the hard one; at most 4096)",
        type=int,
    )
    # the chat template's text instead of the checkpoint's, and kwargs every render gets (a request's win)
    chat_template: str | None = setting(
        None,
        "a Jinja chat template (a file, or the template itself) instead of the checkpoint's",
        type=chat_template_text,
        metavar="FILE|TEMPLATE",
    )
    default_chat_template_kwargs: dict | None = setting(
        None,
        "chat_template_kwargs every chat request gets (its own win): '{\"enable_thinking\": false}'",
        type=json_object,
        metavar="JSON",
    )
    # None: both forms parsed
    tool_call_parser: str | None = setting(
        None,
        "the <tool_call> body form read as a call: hermes JSON, qwen3_coder / qwen3_xml <function=...> XML "
        "(default: either); a call forced by tool_choice is written and read in the chat template's form",
        choices=tuple(TOOL_CALL_PARSERS),
    )
    max_logprobs: int = setting(DEFAULT_MAX_LOGPROBS, "logprobs a request may ask for, at most", type=int)
    # CORS (starlette's middleware); no origin: no CORS headers
    allowed_origins: tuple[str, ...] = setting(
        (),
        "CORS: origins a browser page may call from, as a JSON list ('[\"*\"]'; default: none, no CORS headers)",
        type=json_list,
        metavar="JSON",
    )
    allowed_methods: tuple[str, ...] = setting(("*",), "CORS: methods, a JSON list", type=json_list, metavar="JSON")
    allowed_headers: tuple[str, ...] = setting(("*",), "CORS: headers, a JSON list", type=json_list, metavar="JSON")
    allow_credentials: bool = setting(False, "CORS: credentials")
    root_path: str = setting("", "the path prefix a proxy serves this server under")
    ssl_keyfile: str | None = setting(None, "TLS: the key (with --ssl-certfile)", type=readable_file, metavar="FILE")
    ssl_certfile: str | None = setting(None, "TLS: the certificate", type=readable_file, metavar="FILE")
    ssl_ca_certs: str | None = setting(
        None, "TLS: CA certificates for client certificates", type=readable_file, metavar="FILE"
    )
    ssl_cert_reqs: int = setting(0, "TLS: 0 no client certificate, 1 optional, 2 required (ssl's)", type=int)
    uvicorn_log_level: str = setting("info", "uvicorn's log level", choices=UVICORN_LOG_LEVELS)
    access_log: bool = setting(
        True,
        "uvicorn's access log (vLLM's --disable-uvicorn-access-log: off)",
        negations=("--disable-uvicorn-access-log",),
    )
    docs: bool = setting(
        True,
        "/docs, /redoc and /openapi.json (vLLM's --disable-fastapi-docs: off)",
        negations=("--disable-fastapi-docs",),
    )

    def __post_init__(self):
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):  # a flag's JSON list
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.log_interval < 0:
            raise ValueError(f"log_interval must be >= 0, got {self.log_interval}")
        if self.timeout_keep_alive < 1:
            raise ValueError(f"timeout_keep_alive must be >= 1, got {self.timeout_keep_alive}")
        if self.request_read_timeout <= 0:
            raise ValueError(f"request_read_timeout must be > 0, got {self.request_read_timeout}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")
        if self.reasoning_parser not in (None, "qwen3"):
            raise ValueError(f"reasoning_parser must be 'qwen3' or None, got {self.reasoning_parser!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            names = ", ".join(TOOL_CALL_PARSERS)
            raise ValueError(f"tool_call_parser must be one of {names}, got {self.tool_call_parser!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {UVICORN_LOG_LEVELS}, got {self.uvicorn_log_level!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both ssl_keyfile and ssl_certfile")
        if self.default_chat_template_kwargs is not None and not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError(f"default_chat_template_kwargs must be a dict, got {self.default_chat_template_kwargs!r}")

    @property
    def tool_call_form(self) -> str | None:
        """ "json" or "xml": the `<tool_call>` body form the parser names (None: both read; a forced
        call: the chat template's, nextn.server.structured.tool_grammar)."""
        return None if self.tool_call_parser is None else TOOL_CALL_PARSERS[self.tool_call_parser]
