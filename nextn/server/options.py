"""Settings of the HTTP layer (`nextn serve` flags beside nextn.config.ServeConfig, which holds the
address, the key, the model names and the queue): limits and lifetime, and vLLM's front-end
settings (chat template, tool-call parser, CORS, TLS, root path, uvicorn's logging)."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's --tool-call-parser names nextn parses -> the `<tool_call>` body it reads and a forced call's grammar writes
TOOL_CALL_PARSERS = {"hermes": "json", "qwen3_coder": "xml", "qwen3_xml": "xml"}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs


@dataclass(frozen=True)
class ServerOptions:
    max_request_bytes: int = 16 * 2**20  # a larger body is answered 413 before it is read
    shutdown_timeout: float = 10.0  # seconds open requests get after SIGTERM before they are ended
    metrics_open: bool = False  # /metrics answers without the API key (for scrapers)
    log_interval: float = 10.0  # seconds between throughput/acceptance log lines while serving; 0 = none
    reasoning_parser: str | None = None  # "qwen3": <think>...</think> -> reasoning_content
    timeout_keep_alive: int = 5  # seconds an idle kept-alive connection stays open (uvicorn's flag)
    request_read_timeout: float = 30.0  # seconds a client gets to send a request's headers, then its body
    limit_concurrency: int | None = None  # open connections; None: half the descriptor limit (connections.py)
    # the chat template's text instead of the checkpoint's, and kwargs every render gets (a request's win)
    chat_template: str | None = None
    default_chat_template_kwargs: dict | None = None
    # a TOOL_CALL_PARSERS name: the one `<tool_call>` body form parsed and forced; None: both parsed,
    # the chat template's form forced
    tool_call_parser: str | None = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # logprobs / top_logprobs / prompt_logprobs at most
    # CORS (starlette's middleware); no origin: no CORS headers
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""  # the path prefix a proxy serves the app under (ASGI root_path)
    # TLS (uvicorn's): key and certificate files, CA certificates, whether client certificates are required
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    uvicorn_log_level: str = "info"
    access_log: bool = True  # uvicorn's access log
    docs: bool = True  # /docs, /redoc and /openapi.json

    def __post_init__(self):
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
        """ "json" or "xml": the `<tool_call>` body form the parser names (None: both read)."""
        return None if self.tool_call_parser is None else TOOL_CALL_PARSERS[self.tool_call_parser]
