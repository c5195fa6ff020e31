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
from nextn.config.serve import ServeConfig  # noqa: E402
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


def _until_closed(s: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends on s until it closes the connection."""
    s.settimeout(timeout)
    chunks = []
    while chunk := s.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_body_that_does_not_arrive_is_a_408(dense_ckpt):
    from nextn.config.serve import ServerOptions

    llm = LLM(model=dense_ckpt, max_model_len=512)
    with LiveServer(llm, ServeConfig(), ServerOptions(request_read_timeout=0.5)) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
            reply = _until_closed(s)  # (the head and the body may come in separate packets)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        head, _, body = reply.partition(b"\r\n\r\n")  # as the OpenAPI document says
        r = httpx.Response(408, headers=[line.split(b": ", 1) for line in head.split(b"\r\n")[1:]], content=body)
        check_documented(httpx.get(f"{srv.url}/openapi.json", timeout=10).json(), "post", "/v1/completions", r)
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


# ---------------------------------------------------------------------------------------------
# The OpenAPI document against what the server answers


def check_documented(spec: dict, method: str, path: str, r: httpx.Response) -> None:
    """r's status is documented for the operation, with r's media type, and r's JSON body is valid
    by the documented schema (its $refs resolved in the document)."""
    import jsonschema

    op = spec["paths"][path][method]
    assert str(r.status_code) in op["responses"], (method, path, r.status_code, r.text[:200])
    content = op["responses"][str(r.status_code)].get("content", {})
    media = r.headers.get("content-type", "").split(";")[0].strip()
    assert media in content, (method, path, r.status_code, media, list(content))
    if method == "head" or media not in ("application/json", "text/event-stream"):
        return
    schema = {**content[media]["schema"], "components": spec["components"]}
    # an event stream's schema (OpenAPI 3.1) is one event's: each event's fields are checked against it
    for value in [r.json()] if media == "application/json" else sse_events(r.text):
        jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)


def sse_events(text: str) -> list[dict]:
    """A text/event-stream body as its events, each {field: value} (data lines joined by newlines)."""
    events = []
    for block in text.strip().split("\n\n"):
        event: dict[str, str] = {}
        for line in block.splitlines():
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            event[name] = event[name] + "\n" + value if name == "data" and name in event else value
        events.append(event)
    assert events and all("data" in e for e in events), text[:200]
    return events


def test_every_answer_is_documented_in_the_openapi_document(live):
    """Each route's answers (successes, streams, the Guard's errors, a 404), walked against
    /openapi.json: status, media type and body as documented; a wrong method is a 405 with Allow."""
    auth = {"Authorization": f"Bearer {KEY}"}
    spec = httpx.get(f"{live.url}/openapi.json", headers=auth, timeout=10).json()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.0}
    prompt = {"model": MODEL, "prompt": "The quick", "max_tokens": 3, "temperature": 0.0}
    responses = {"model": MODEL, "input": "hi", "max_output_tokens": 3, "temperature": 0.0}
    cases = [
        ("get", "/v1/models", "/v1/models", None, auth),
        ("get", "/v1/models/{model}", f"/v1/models/{MODEL}", None, auth),
        ("get", "/v1/models/{model}", "/v1/models/org/other", None, auth),  # 404
        ("post", "/v1/chat/completions", "/v1/chat/completions", chat, auth),
        ("post", "/v1/chat/completions", "/v1/chat/completions", {**chat, "stream": True}, auth),
        ("post", "/v1/chat/completions", "/v1/chat/completions", {**chat, "max_tokens": -1}, auth),  # 400
        ("post", "/v1/chat/completions", "/v1/chat/completions", chat, {}),  # 401
        ("post", "/v1/completions", "/v1/completions", prompt, auth),
        ("post", "/v1/completions", "/v1/completions", {**prompt, "stream": True}, auth),
        ("post", "/v1/completions", "/v1/completions", b"{not json", auth),  # 400
        ("post", "/v1/completions", "/v1/completions", b"x" * (65 << 20), auth),  # 413
        ("post", "/v1/responses", "/v1/responses", responses, auth),
        ("post", "/v1/responses", "/v1/responses", {**responses, "stream": True}, auth),
        ("post", "/v1/responses", "/v1/responses", {**responses, "input": [{"role": "robot"}]}, auth),  # 400
        ("post", "/tokenize", "/tokenize", {"model": MODEL, "prompt": "hi"}, auth),
        ("post", "/detokenize", "/detokenize", {"model": MODEL, "tokens": [1, 2]}, auth),
        ("post", "/detokenize", "/detokenize", {"model": MODEL, "tokens": [-1]}, auth),  # 400
        ("get", "/version", "/version", None, auth),
        ("get", "/health", "/health", None, {}),
        ("head", "/health", "/health", None, {}),
        ("get", "/metrics", "/metrics", None, auth),
        ("get", "/metrics", "/metrics", None, {}),  # 401
    ]
    seen = set()
    with httpx.Client(base_url=live.url, timeout=30) as http:
        for method, path, url, body, headers in cases:
            content = body if isinstance(body, bytes | None) else json.dumps(body).encode()
            r = http.request(method, url, content=content, headers={**headers, "content-type": "application/json"})
            check_documented(spec, method, path, r)
            seen.add((method, path, r.status_code, r.headers.get("content-type", "").split(";")[0]))
    statuses = {s for _, _, s, _ in seen}
    assert {200, 400, 401, 404, 413} <= statuses, seen
    assert ("post", "/v1/chat/completions", 200, "text/event-stream") in seen
    assert all(op != "422" for route in spec["paths"].values() for o in route.values() for op in o["responses"])
    for route in spec["paths"]:  # every documented operation has been walked
        assert any(path == route for _, path, *_ in cases), route
    r = httpx.put(f"{live.url}/v1/models", headers=auth, timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "GET"
