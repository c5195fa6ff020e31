"""Reliability of `nextn serve` (issue 19), each defect of the probe as a regression test: no input
gives a 5xx (lone surrogates, template type errors, internal text never echoed), request size
limits (413 before parsing, long prompts refused on characters before tokenizing), admission
against free slots, the API key on every route but /health and checked before the body, engine
thread death, metrics that do not lag, the OpenAPI error codes, and a bounded fuzz run.

Real uvicorn servers on loopback over the tiny dense checkpoint; an engine held at a gate (its
step waits on an Event) makes the admission and failure tests deterministic. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import unicodedata

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_server import KEY, MODEL, LiveServer, user, wait_for  # noqa: E402

from nextn import LLM, SamplingParams  # noqa: E402
from nextn.config import DEFAULT_MODEL_DIR  # noqa: E402
from nextn.config.serve import ServeConfig, ServerOptions  # noqa: E402
from nextn.server.completions import stream_error  # noqa: E402
from nextn.server.guard import Guard  # noqa: E402
from nextn.server.metrics import Metrics, ThroughputLog  # noqa: E402
from nextn.server.prepare import max_chars_per_token  # noqa: E402
from nextn.server.worker import Job, Unavailable  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
CFG = ServeConfig(api_key=KEY, served_model_name=MODEL)


@pytest.fixture(scope="module")
def llm(dense_ckpt) -> LLM:
    return LLM(model=dense_ckpt, max_model_len=512)


@pytest.fixture(scope="module")
def live(llm):
    with LiveServer(llm, CFG) as srv:
        yield srv


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


def gated(llm: LLM) -> threading.Event:
    """Hold the engine thread at its next step until the returned Event is set."""
    gate, step = threading.Event(), llm.engine.step
    llm.engine.step = lambda: (gate.wait(60), step())[1]
    return gate


# ---------------------------------------------------------------------------------------------
# No 5xx from any input


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x\ud800"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udfff"}]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
            "messages[0].content[0].text",
        ),
        ("/v1/completions", {"prompt": "x", "stop": ["ok", "\ud800"]}, "stop[1]"),
        ("/v1/completions", {"prompt": "x", "model": "m\ud800"}, "model"),
        ("/v1/chat/completions", {"messages": [user("x")], "chat_template_kwargs": {"\udc00": 1}}, None),
        ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(live, path, body, param):
    err = error_of(live.post(path, body), 400)
    assert "surrogate" in err["message"]
    if param is not None:
        assert err["param"] == param
    else:  # a key: named with its escape, so the error body itself stays valid UTF-8
        assert err["param"] == "chat_template_kwargs.\\udc00"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [user("x")], "chat_template_kwargs": {"tools": 5}}, "chat_template_kwargs.tools"),
        ({"messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]}, "messages[0].tool_calls"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 5, "arguments": "{}"}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
        (
            {"messages": [user("x")], "tools": [{"type": "function", "function": {"name": ["f"]}}]},
            "tools[0].function.name",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [user("x")], "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"messages": [user("x")], "chat_template_kwargs": []}, "chat_template_kwargs"),
    ],
)
def test_template_type_errors_are_a_400_naming_the_field(live, llm, monkeypatch, body, param):
    """The probe's 500s, rendered with the bundled model's template (it iterates `tools` and reads
    `tool_calls[].function.name`): each is refused by type before the template runs."""
    bundled = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    monkeypatch.setattr(llm.tokenizer, "chat_template", bundled)
    err = error_of(live.post("/v1/chat/completions", {"model": MODEL, **body}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_a_template_failure_is_a_400_without_its_internal_text(live, llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", "{{ messages[0].content + 5 }}")
    err = error_of(live.post("/v1/chat/completions", {"messages": [user("x")]}), 400)
    assert err["param"] == "messages" and "operand" not in err["message"] and "str" not in err["message"]


def test_internal_errors_do_not_echo_their_text(live, monkeypatch):
    def broken(req):
        raise RuntimeError("secret-internal-detail")

    monkeypatch.setattr(live.app.state.server.prompts, "completion", broken)
    err = error_of(live.post("/v1/completions", {"prompt": "x"}), 500)
    assert "secret" not in json.dumps(err) and err["type"] == "server_error"
    event = stream_error(RuntimeError("secret-internal-detail"))
    assert "secret" not in event and event.endswith("data: [DONE]\n\n")


# ---------------------------------------------------------------------------------------------
# Request size


def test_a_30_mb_body_is_a_413_within_2_s(live):
    t0 = time.monotonic()
    err = error_of(live.post("/v1/completions", b"x" * (30 * 2**20)), 413)
    assert time.monotonic() - t0 < 2 and err["code"] == "request_too_large"

    async def async_client() -> list[int]:
        """httpx's async client reads no response while it sends: it sees the 413 only because the
        server drops the rest of the body before answering (closing on it resets the connection)."""
        async with httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=30) as client:
            r = await client.post("/v1/completions", content=b"x" * (30 * 2**20))
            return [
                r.status_code,
                (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code,
            ]

    t0 = time.monotonic()
    assert asyncio.run(async_client()) == [413, 200] and time.monotonic() - t0 < 2


def test_a_chunked_body_over_the_limit_is_a_413(live):
    def chunks():  # no Content-Length: the guard counts what it reads
        for _ in range(20):
            yield b" " * 2**20

    r = httpx.post(f"{live.url}/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert error_of(r, 413)["code"] == "request_too_large"


def test_a_content_length_not_a_number_is_a_400():
    """The guard is plain ASGI (uvicorn's h11 refuses such a header first; a server or proxy in
    front may pass it on): a Content-Length that is no number is a 400 that closes the connection,
    not a 413 that says the body is too large."""
    answered, rejected = [], []

    async def app(scope, receive, send):
        answered.append(scope["path"])

    async def call(length: bytes) -> list[dict]:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            sent.append(message)

        guard = Guard(app, KEY, 1024, frozenset(), rejected.append)
        headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-length", length)]
        await guard({"type": "http", "path": "/v1/completions", "headers": headers}, receive, send)
        return sent

    for length in (b"abc", b"-1", b"1e3", b""):
        start, body = asyncio.run(call(length))
        assert start["status"] == 400 and (b"connection", b"close") in start["headers"]
        assert "Content-Length" in json.loads(body["body"])["error"]["message"]
    assert rejected == ["bad_request"] * 4 and answered == []
    assert asyncio.run(call(b"2")) == [] and answered == ["/v1/completions"]


def test_a_long_prompt_is_refused_on_its_characters_before_tokenizing(live, llm, monkeypatch):
    encoded = []
    encode = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text: encoded.append(len(text)) or encode(text))
    for path, body, param in (
        ("/v1/completions", {"prompt": "fox " * 250_000}, "prompt"),
        ("/v1/chat/completions", {"messages": [user("fox " * 250_000)]}, "messages"),
    ):
        err = error_of(live.post(path, body), 400)
        assert err["param"] == param and err["code"] == "context_length_exceeded"
    assert encoded == []  # refused without tokenizing
    prompts = live.app.state.server.prompts
    near = "fox " * (prompts.max_chars // 4)  # within the character bound: tokenized, refused on tokens
    err = error_of(live.post("/v1/completions", {"prompt": near}), 400)
    assert err["code"] == "context_length_exceeded" and encoded == [len(near)]


def test_the_character_bound_holds(llm):
    """No text tokenizes to fewer than len(NFC(text)) / max_chars_per_token tokens, including
    texts made of the vocabulary's longest token and of sequences NFC composes."""
    tok = llm.tokenizer
    bound = max_chars_per_token(tok)
    longest = max(range(tok.vocab_size), key=lambda i: len(tok.decode([i])))
    texts = [
        tok.decode([longest]) * 50,
        "The quick brown fox jumps over the lazy dog. " * 20,
        "e\u0301" * 300 + "\u1100\u1161\u11a8" * 100,
        "def fibonacci(n):\n    a, b = 0, 1\n" * 20,
        "🚨" * 200 + "汉字" * 100,
    ]
    for text in texts:
        assert len(tok.encode(text)) * bound >= len(unicodedata.normalize("NFC", text))


# ---------------------------------------------------------------------------------------------
# Admission


@pytest.mark.parametrize("num_slots, num_requests, admitted", [(4, 10, 6), (8, 6, 6)])
def test_admission_counts_queued_plus_running_against_the_slots(dense_ckpt, num_slots, num_requests, admitted):
    """--max-queue 2: with the engine held, the first slots + 2 simultaneous requests are admitted
    and the rest get 503 with Retry-After at once."""
    llm = LLM(model=dense_ckpt, max_model_len=512, max_num_seqs=num_slots)
    gate = gated(llm)
    cfg = ServeConfig(api_key=KEY, served_model_name=MODEL, max_queue=2)
    with LiveServer(llm, cfg) as srv, concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        body = {"prompt": "The quick brown fox", "max_tokens": 4}
        futures = [pool.submit(srv.post, "/v1/completions", body) for _ in range(num_requests)]
        assert wait_for(lambda: srv.app.state.server.worker.num_open == admitted)
        assert wait_for(lambda: sum(f.done() for f in futures) == num_requests - admitted)
        refused = [f.result() for f in futures if f.done()]
        assert all(r.status_code == 503 and r.headers["retry-after"] == "1" for r in refused)
        assert all(error_of(r, 503)["code"] == "server_overloaded" for r in refused)
        gate.set()
        codes = [f.result().status_code for f in futures]
        assert codes.count(200) == admitted and codes.count(503) == num_requests - admitted


# ---------------------------------------------------------------------------------------------
# Auth


def test_the_api_key_covers_every_route_but_health(live):
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/version", "/v1/models"):
        assert error_of(httpx.get(f"{live.url}{path}", timeout=10), 401)["code"] == "invalid_api_key"
        assert httpx.get(f"{live.url}{path}", headers=AUTH, timeout=10).status_code == 200
    error_of(live.post("/tokenize", {"prompt": "x"}, key="wrong"), 401)
    assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200


def test_auth_is_checked_before_the_body_is_read(live):
    assert error_of(live.post("/v1/completions", b"{not json", key="wrong"), 401)["type"] == "authentication_error"
    t0 = time.monotonic()
    error_of(live.post("/v1/completions", b"x" * (30 * 2**20), key="wrong"), 401)
    assert time.monotonic() - t0 < 2


def test_the_bearer_scheme_is_case_insensitive(live):
    """RFC 7235: an auth scheme is case-insensitive (`bearer <key>` was a 401); the key is not."""
    for value in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"):
        assert httpx.get(f"{live.url}/v1/models", headers={"Authorization": value}, timeout=10).status_code == 200
    for value in (f"Bearer {KEY.upper()}", f"Basic {KEY}", KEY, f"Bearer{KEY}", "Bearer"):
        error_of(httpx.get(f"{live.url}/v1/models", headers={"Authorization": value}, timeout=10), 401)


def test_metrics_open_leaves_only_metrics_open(llm):
    with LiveServer(llm, CFG, ServerOptions(metrics_open=True)) as srv:
        assert httpx.get(f"{srv.url}/metrics", timeout=10).status_code == 200
        error_of(httpx.get(f"{srv.url}/docs", timeout=10), 401)


# ---------------------------------------------------------------------------------------------
# Engine thread death and shutdown


def test_engine_thread_death_fails_open_and_new_requests_with_503(dense_ckpt, caplog):
    llm = LLM(model=dense_ckpt, max_model_len=512)
    gate = threading.Event()

    def broken_step():
        gate.wait(60)
        raise RuntimeError("the engine broke")

    llm.engine.step = broken_step
    with LiveServer(llm, CFG) as srv, concurrent.futures.ThreadPoolExecutor(3) as pool:
        body = {"prompt": "The quick brown fox", "max_tokens": 4}
        waiting = [pool.submit(srv.post, "/v1/completions", body) for _ in range(2)]
        streamed = pool.submit(srv.post, "/v1/completions", {**body, "stream": True})
        assert wait_for(lambda: srv.app.state.server.worker.num_open == 3)
        with caplog.at_level(logging.CRITICAL, logger="nextn.server"):
            gate.set()
            for f in waiting:
                assert error_of(f.result(timeout=10), 503)["code"] == "service_unavailable"
        events = [line for line in streamed.result(timeout=10).text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["code"] == "service_unavailable" and events[-1] == "data: [DONE]"
        assert any(r.levelno == logging.CRITICAL and "engine thread died" in r.message for r in caplog.records)
        assert error_of(httpx.get(f"{srv.url}/health", timeout=10), 503)["code"] == "service_unavailable"
        t0 = time.monotonic()
        error_of(srv.post("/v1/completions", body), 503)
        assert time.monotonic() - t0 < 2


def slowed(llm: LLM, seconds: float) -> None:
    """Make every engine step take `seconds` longer (a slow model)."""
    step = llm.engine.step
    llm.engine.step = lambda: (time.sleep(seconds), step())[1]


def test_shutdown_ends_open_streams_with_an_error_event(dense_ckpt):
    """should_exit (what SIGTERM sets) with streams open on a slow engine: after shutdown_timeout
    each stream ends with a final error event, and the server exits."""
    llm = LLM(model=dense_ckpt, max_model_len=512)
    slowed(llm, 0.05)
    srv = LiveServer(llm, CFG, ServerOptions(shutdown_timeout=1.0)).__enter__()
    body = {"prompt": "The quick brown fox", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(srv.post, "/v1/completions", body) for _ in range(3)]
        assert wait_for(lambda: srv.metrics()["nextn:num_requests_running"] == 3)
        t0 = time.monotonic()
        srv.server.should_exit = True
        worker = srv.app.state.server.worker
        assert wait_for(lambda: worker.draining)  # new connections are refused by now; a late job too
        with pytest.raises(Unavailable):
            worker.submit(Job([1, 2], SamplingParams(max_tokens=2), asyncio.new_event_loop()))
        for f in streams:
            events = [line for line in f.result(timeout=10).text.splitlines() if line.startswith("data: ")]
            assert len(events) > 3 and events[-1] == "data: [DONE]"
            assert "shutting down" in json.loads(events[-2][6:])["error"]["message"]
        srv.thread.join(10)
        assert not srv.thread.is_alive() and 1.0 <= time.monotonic() - t0 < 6


SERVE_SCRIPT = """
import sys, time
from nextn import LLM
from nextn.config.serve import ServeConfig
from nextn.server.app import serve
from nextn.config.serve import ServerOptions
llm = LLM(model=sys.argv[1], max_model_len=512)
step = llm.engine.step
llm.engine.step = lambda: (time.sleep(0.05), step())[1]  # a slow model: streams stay open
serve(llm, ServeConfig(port=int(sys.argv[2])), ServerOptions(shutdown_timeout=float(sys.argv[3])))
"""


def test_sigterm_with_open_streams_exits_within_the_timeout(dense_ckpt, tmp_path):
    """`serve` in its own process: SIGTERM with 8 open streams ends each with an error event and
    the process exits within shutdown_timeout + 5 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout = 2.0
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, str(dense_ckpt), str(port), str(timeout)],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "serve.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(up, timeout=60), (tmp_path / "serve.log").read_text()
        body = {"prompt": "The quick brown fox", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60) for _ in range(8)]

            def admitted() -> float:  # every stream in the engine before the signal (a slow CI machine lags)
                lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
                queues = ("nextn:num_requests_running ", "nextn:num_requests_waiting ")
                return sum(float(v.rsplit(" ", 1)[1]) for v in lines if v.startswith(queues))

            assert wait_for(lambda: admitted() == 8, timeout=60), (tmp_path / "serve.log").read_text()
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout + 5) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
            exit_s = time.monotonic() - t0
            for f in streams:
                events = [line for line in f.result(timeout=5).text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]" and "shutting down" in events[-2]
        assert timeout <= exit_s < timeout + 5
        print(f"SIGTERM with 8 open streams: exited after {exit_s:.2f} s (shutdown_timeout {timeout} s)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_an_address_in_use_before_loading(dense_ckpt, monkeypatch, capsys):
    """A taken port was uvicorn's exit status 3 and its log lines, after the model loaded; now one
    line before it loads. A free port still serves."""
    from nextn.cli import main

    monkeypatch.setattr("nextn.engine.llm.load_model", lambda *a, **kw: pytest.fail("the weights loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(dense_ckpt), "--port", str(port), "--log-level", "warning"]) == 2
        err = capsys.readouterr().err
        assert err == f"nextn: error: cannot serve on 127.0.0.1:{port}: Address already in use\n", err
    monkeypatch.undo()
    served = []
    monkeypatch.setattr("nextn.server.app.serve", lambda llm, cfg, opts: served.append(cfg.port) or 0)
    assert main(["serve", str(dense_ckpt), "--port", str(port), "--max-model-len", "64", "--log-level", "warning"]) == 0
    assert served == [port]


# ---------------------------------------------------------------------------------------------
# Metrics, logging, schema


def test_metrics_count_a_request_before_its_answer_is_sent(live, monkeypatch):
    """The session and success counters are updated before a request's last event is handed over,
    so a client reading /metrics right after its answer sees that request."""
    metrics, seen = live.app.state.server.metrics, []
    put = Job.put

    def spy(job, item):
        if getattr(item, "output", None) is not None:
            seen.append((sum(metrics.success.values()), metrics.sessions.counters.lookups))
        put(job, item)

    monkeypatch.setattr(Job, "put", spy)
    before = (sum(metrics.success.values()), metrics.sessions.counters.lookups)
    for i in range(3):
        live.post("/v1/chat/completions", {"messages": [user(f"turn {i}")], "max_tokens": 2}).raise_for_status()
    assert seen == [(before[0] + i, before[1] + i) for i in (1, 2, 3)]


def test_throughput_log_line(live, caplog):
    meter = ThroughputLog(live.app.state.server.metrics)
    assert meter.line(0, 0) is None  # idle: nothing to log
    live.post("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 8, "ignore_eos": True})
    line = meter.line(0, 0)
    assert "generation" in line and float(line.split("generation ")[1].split(" ")[0]) > 0
    assert "mean acceptance length" in line
    assert ThroughputLog(Metrics(0)).line(1, 0).startswith("running 1, waiting 0")


def test_the_server_logs_throughput_while_serving(llm, caplog):
    with caplog.at_level(logging.INFO, logger="nextn.server"):
        with LiveServer(llm, CFG, ServerOptions(log_interval=0.2)) as srv:
            srv.post("/v1/completions", {"prompt": "The quick", "max_tokens": 4}).raise_for_status()
            assert wait_for(lambda: any("tok/s" in r.message for r in caplog.records), timeout=5)


def test_openapi_documents_400_not_422(live):
    schema = httpx.get(f"{live.url}/openapi.json", headers=AUTH, timeout=10).json()
    ops = [op for route in schema["paths"].values() for op in route.values()]
    assert ops and all("422" not in op["responses"] for op in ops)
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "413", "503"} <= set(chat)


# ---------------------------------------------------------------------------------------------
# Fuzz: mutated and random request bodies, bounded


def fuzz_strategies():
    from hypothesis import strategies as st

    text = st.one_of(
        st.text(max_size=12),
        st.sampled_from(["\ud800", "x\udfff", "<|im_start|>", "\x00", "🚨" * 3, "e\u0301", "{{ x }}", "{%"]),
    )
    scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.sampled_from([0, 1, -1, 2, 20, 21, 511, 512, 10**9]),
        st.floats(allow_nan=True, allow_infinity=True),
        text,
    )
    value = st.recursive(
        scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4), max_leaves=12
    )
    base = {
        "/v1/chat/completions": {
            "model": MODEL,
            "messages": [{"role": "system", "content": "Be terse."}, user("Hi")],
            "max_tokens": 3,
        },
        "/v1/completions": {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 3},
        "/tokenize": {"model": MODEL, "prompt": "Hello"},
        "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
    }
    fields = sorted(
        {
            "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
            "seed", "stop", "stop_token_ids", "n", "stream", "stream_options", "logprobs", "top_logprobs", "echo",
            "tools", "tool_choice", "chat_template_kwargs", "response_format", "logit_bias", "prompt_logprobs",
            "include_stop_str_in_output", "skip_special_tokens", "min_tokens", "return_token_ids", "ignore_eos",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "add_generation_prompt", "suffix",
            "best_of", "tokens", "model", "use_beam_search", "guided_json",
        }
    )  # fmt: skip
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "x"]) | value},
        optional={
            "content": value | st.lists(st.fixed_dictionaries({"type": st.just("text") | value, "text": value})),
            "tool_calls": value
            | st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": value, "arguments": value})})),
            "name": value,
        },
    )
    mutation = st.one_of(
        st.tuples(st.just("set"), st.sampled_from(fields), value),
        st.tuples(st.just("set"), st.just("messages"), st.lists(message, max_size=3)),
        st.tuples(st.just("drop"), st.sampled_from(fields), st.none()),
    )

    @st.composite
    def request(draw):
        path = draw(st.sampled_from(sorted(base)))
        if draw(st.integers(0, 19)) == 0:  # now and then not JSON, or not an object
            return path, draw(st.binary(max_size=64) | value.map(lambda v: json.dumps(v).encode()))
        body = dict(base[path])
        for op, field, v in draw(st.lists(mutation, min_size=1, max_size=4)):
            if op == "set":
                body[field] = v
            else:
                body.pop(field, None)
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
            body["max_tokens"] = 64  # keep each generation short: the run is bounded in time
        return path, json.dumps(body).encode()

    return request()


def test_fuzzed_requests_never_get_a_5xx(live):
    """About a minute of generated bodies (valid ones mutated by type, value and shape; surrogates,
    template syntax, special tokens; non-JSON): no 5xx, and the engine serves afterwards."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings

    client = httpx.Client(base_url=live.url, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    seen: dict[int, int] = {}

    @settings(
        max_examples=700,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(fuzz_strategies())
    def check(case):
        path, content = case
        r = client.post(path, content=content)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, content[:300], r.text[:300])
        if r.status_code >= 400:
            assert set(r.json()["error"]) >= {"message", "type", "param", "code"}

    check()
    client.close()
    assert seen.get(200, 0) > 20 and seen.get(400, 0) > 100, seen  # both accepted and refused bodies were tried
    assert hypothesis is not None and httpx.get(f"{live.url}/health", timeout=10).status_code == 200
    out = live.post("/v1/completions", {"prompt": "still there?", "max_tokens": 3, "temperature": 0.0})
    assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] in ("stop", "length")
