"""An app served by uvicorn on a thread of the test process, on a port the OS picks: the shared
start-up of tests that drive a real HTTP server (no subprocess, so the engine is the test's)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def serving(llm, config):
    """Serve create_app(llm, config) until the block ends; yields the base URL (http://127.0.0.1:PORT)."""
    from nextn.server.app import GracefulServer, create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = GracefulServer(create_app(llm, config), log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
