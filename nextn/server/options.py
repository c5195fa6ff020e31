"""Settings of the HTTP layer's limits and lifetime (`nextn serve` flags beside nextn.config.ServeConfig,
which holds the address, the key, the model name and the queue)."""

from __future__ import annotations

from dataclasses import dataclass


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
