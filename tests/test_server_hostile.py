"""Requests and connections an attacker would send (issue 46), at bounded sizes on the CPU: a tool
schema whose `anyOf` of `$ref`s was walked in exponential time, idle connections against a small
descriptor limit, and a wrong method's 405 (which must name the allowed ones in `Allow`).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_server import KEY, MODEL, LiveServer, wait_for  # noqa: E402

from nextn import LLM  # noqa: E402
from nextn.config import ServeConfig  # noqa: E402
from nextn.server import chat_output  # noqa: E402
from nextn.server.connections import RateLimitFilter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CALL = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"


def nested_anyof(levels: int, width: int = 9) -> dict:
    """The probe's tool schema: each level an `anyOf` of `width` `$ref`s to the next (about 560
    bytes at 8 levels); every path is walked once without memoising: width**levels of them."""
    defs = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"} for _ in range(width)]} for i in range(levels)}
    defs[f"a{levels}"] = {"type": "integer"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "$defs": defs}


def test_the_nested_anyof_schema_is_walked_once_per_node(monkeypatch):
    calls = 0
    branches = chat_output._branches

    def counted(schema):
        nonlocal calls
        calls += 1
        return branches(schema)

    monkeypatch.setattr(chat_output, "_branches", counted)
    # 6 levels: 9**6 = 531,441 paths walked one by one before (seconds); about 6 nodes x a few now
    body = CALL.removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert chat_output.parse_tool_call(body, {"f": nested_anyof(6)}) == ("f", {"x": 1})
    assert calls < 100
    # the depth limit still holds: past it a schema says nothing readable (the text as JSON)
    start = time.perf_counter()
    assert chat_output.parse_tool_call(body, {"f": nested_anyof(40)}) == ("f", {"x": 1})
    assert time.perf_counter() - start < 1.0
    assert chat_output.schema_types({"$ref": "#/$defs/a0"}, nested_anyof(3)) == {"integer"}
    assert chat_output.string_choices({"anyOf": [{"enum": ["a"]}, {"const": "b"}]}, {}) == ["a", "b"]


@pytest.fixture(scope="module")
def live(dense_ckpt):
    with LiveServer(LLM(model=dense_ckpt, max_model_len=512), ServeConfig(api_key=KEY, served_model_name=MODEL)) as srv:
        yield srv


def test_the_nested_anyof_tool_call_echoed_is_answered_and_health_stays_fast(live):
    """The probe's request (8 levels: 118 s of a frozen event loop before) answered within 5 s,
    and /health answered within 1 s throughout."""
    tool = {"type": "function", "function": {"name": "f", "parameters": nested_anyof(8)}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": CALL}],
        "tools": [tool],
        "echo": True,
        "max_tokens": 1,
        "temperature": 0.0,
    }
    worst, done = 0.0, threading.Event()

    def probe() -> None:
        nonlocal worst
        with httpx.Client(timeout=10) as c:
            while not done.is_set():
                start = time.perf_counter()
                assert c.get(f"{live.url}/health").status_code == 200
                worst = max(worst, time.perf_counter() - start)
                time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        start = time.perf_counter()
        r = live.post("/v1/chat/completions", body, timeout=30)
        took = time.perf_counter() - start
    finally:
        done.set()
        prober.join(15)
    assert r.status_code == 200, r.text
    assert took < 5.0
    assert worst < 1.0
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


def test_a_wrong_method_is_a_405_naming_the_allowed_ones(live):
    r = httpx.get(f"{live.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    r = httpx.post(f"{live.url}/health", timeout=10)
    assert r.status_code == 405
    assert set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}


def test_a_body_that_does_not_arrive_is_a_408(dense_ckpt):
    from nextn.server.options import ServerOptions

    llm = LLM(model=dense_ckpt, max_model_len=512)
    with LiveServer(llm, ServeConfig(), ServerOptions(request_read_timeout=0.5)) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
            reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # headers never finished
            s.sendall(b"GET /health HTTP/1.1\r\n")
            s.settimeout(5)
            assert s.recv(4096) == b""  # closed by the server within the deadline
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def test_repeated_transport_errors_are_logged_once_per_interval():
    f = RateLimitFilter(interval=10.0)
    record = lambda: __import__("logging").LogRecord("asyncio", 30, __file__, 1, "socket.send() raised", None, None)  # noqa: E731
    passed = [f.filter(record()) for _ in range(1000)]
    assert passed.count(True) == 1
    f.seen[("asyncio", "socket.send() raised")] = (time.monotonic() - 11, 999)
    last = record()
    assert f.filter(last) and "999 more" in last.getMessage()


def _start_serve(ckpt: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def small_fd_limit() -> None:  # soft = hard: the server cannot raise it
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    cmd = [sys.executable, "-m", "nextn.cli", "serve", str(ckpt), "--port", str(port), "--max-model-len", "512"]
    proc = subprocess.Popen(
        [*cmd, *flags],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=small_fd_limit,
    )

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return proc.poll() is not None

    assert wait_for(up, timeout=120) and proc.poll() is None, log.read_text()
    return proc, port


def test_idle_connections_past_the_descriptor_limit_lock_no_one_out(dense_ckpt, tmp_path):
    """400 connections that send nothing or half a request line, against 256 descriptors and the
    default cap (half of them): a new client is answered within 10 s and the log stays small."""
    log = tmp_path / "serve.log"
    proc, port = _start_serve(dense_ckpt, log)
    idle: list[socket.socket] = []
    try:
        for i in range(400):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            idle.append(s)
            if i % 2:
                with __import__("contextlib").suppress(OSError):
                    s.send(b"GET /he")  # a request line a byte at a time, never finished
        time.sleep(1.0)
        start = time.perf_counter()
        body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0.0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert time.perf_counter() - start < 10.0
        assert proc.poll() is None
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert len(text) < 100_000, text[-3000:]
