"""`nextn serve`'s engine core in its own process (nextn.engine.core, nextn.server.core_client):
served requests equal `LLM` alone token for token (greedy and seeded sampled), streams, stop
strings, aborts on disconnect and /metrics through the process boundary; the core's death (SIGKILL)
answers every open and later request with a 503 naming it and stops the server; `nextn serve`
end to end (start-up errors, SIGTERM, SIGKILL of its core).

The API side runs in a uvicorn thread of the test process (tests/test_server.py's LiveServer over
a CoreProcess) or as `nextn serve` itself; the core is a spawned process over the tiny dense
checkpoint. Every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from test_server import KEY, MODEL, LiveServer, cold_ids, extra, user, wait_for  # noqa: E402

from nextn import LLM, SamplingParams  # noqa: E402
from nextn.config.engine_args import EngineArgs  # noqa: E402
from nextn.config.serve import ServeConfig  # noqa: E402
from nextn.server import app as server_app  # noqa: E402
from nextn.server.core_client import CoreProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CFG = ServeConfig(api_key=KEY, served_model_name=MODEL)
GREEDY = {"temperature": 0.0}


def launch(ckpt: Path, **llm_args) -> CoreProcess:
    """A core process over `ckpt` (one torch thread, as the suite's own: the test model is tiny)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned child reads it when it imports torch
    try:
        return CoreProcess.launch(EngineArgs.of(model=str(ckpt), max_model_len=512, **llm_args), "warning")
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old


@pytest.fixture(scope="module")
def cold(dense_ckpt) -> LLM:
    return LLM(model=dense_ckpt, max_model_len=512)


@pytest.fixture(scope="module")
def live(dense_ckpt):
    core = launch(dense_ckpt)
    try:
        with LiveServer(core, CFG) as srv:
            yield srv
    finally:
        core.stop()


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return live.client()


def test_the_core_is_another_process_and_the_api_holds_no_model(live):
    srv = live.app.state.server
    core = srv.worker.core
    assert isinstance(core, CoreProcess) and core.alive and core.pid != os.getpid()
    assert not hasattr(srv.model, "engine") and srv.model.max_model_len == 512 and srv.model.num_speculative_tokens == 3
    assert httpx.get(f"{live.url}/health", timeout=10).json() == {"status": "ok"}

    def cpu_seconds() -> float:  # the core's user + system time
        fields = Path(f"/proc/{core.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    assert wait_for(lambda: srv.worker.num_open == 0)
    before = cpu_seconds()
    time.sleep(1.0)
    assert cpu_seconds() - before < 0.2  # an idle core blocks on its socket: it does not spin


def test_the_core_imports_no_http_stack():
    """What the spawned child imports: nextn.engine.core (its target) and what that pulls in."""
    code = (
        "import sys, nextn.engine.core, nextn.cli; print(sorted({'fastapi', 'uvicorn', 'starlette'} & {*sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_greedy_and_seeded_requests_equal_llm_alone(client, cold):
    """Token for token, through the HTTP API and the process boundary: greedy completions and chat,
    and a seeded sampled completion."""
    body = {"ignore_eos": True, "return_token_ids": True}
    for prompt in ("The quick brown fox", "def fibonacci(n):", [5, 9, 11, 14]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, extra_body=body, **GREEDY)
        ids = cold.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert extra(r.choices[0], "token_ids") == cold_ids(cold, ids, 16, ignore_eos=True)
        assert r.choices[0].text == cold.tokenizer.decode(extra(r.choices[0], "token_ids"))
    chat = client.chat.completions.create(
        model=MODEL, messages=[user("Hello, how are you?")], max_tokens=12, extra_body=body, **GREEDY
    )
    assert extra(chat.choices[0], "token_ids") == cold_ids(cold, extra(chat, "prompt_token_ids"), 12, ignore_eos=True)

    sampled = dict(max_tokens=12, temperature=0.9, seed=1234, top_p=0.95, ignore_eos=True)
    for prompt in ("A model reads the prompt", "Hello, world!"):
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0.9,
            seed=1234,
            top_p=0.95,
            extra_body=body,
        )
        alone = cold.generate(cold.tokenizer.encode(prompt), SamplingParams(**sampled))
        assert extra(r.choices[0], "token_ids") == alone.token_ids and r.choices[0].text == alone.text


def test_streams_and_stop_strings_equal_the_non_streamed(client):
    kw = dict(model=MODEL, prompt="Hello, world! How are you today?", max_tokens=24, **GREEDY)
    kw["extra_body"] = {"ignore_eos": True}
    full = client.completions.create(**kw).choices[0].text
    streamed = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full
    assert streamed[-1].usage.completion_tokens == 24
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].strip())
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.find(stop)]
    cut_streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in cut_streamed) == cut.text
    assert cut_streamed[-1].choices[0].finish_reason == "stop"

    chat = dict(model=MODEL, messages=[user("Tell me about the fox.")], max_tokens=16, **GREEDY)
    chat["extra_body"] = {"ignore_eos": True}
    done = client.chat.completions.create(**chat).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **chat))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done


def test_disconnect_aborts_in_the_core(live, client):
    before = live.metrics().get("nextn:request_aborted_total", 0)
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", f"{live.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
    assert wait_for(lambda: live.metrics()["nextn:request_aborted_total"] == before + 1)
    assert wait_for(lambda: live.metrics()["nextn:num_requests_running"] == 0)
    assert live.app.state.server.worker.num_open == 0
    assert client.completions.create(model=MODEL, prompt="still there?", max_tokens=3, **GREEDY).choices


def test_metrics_come_through_the_process_boundary(live, client):
    before = live.metrics()
    prompt = [7, 8, 9, 10, 11, 12]
    first = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, extra_body={"return_token_ids": True, "ignore_eos": True}, **GREEDY
    )
    turn = prompt + extra(first.choices[0], "token_ids") + [13, 14]
    second = client.completions.create(model=MODEL, prompt=turn, max_tokens=4, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the session kept in the core
    m = live.metrics()
    assert (
        m['nextn:request_success_total{finished_reason="length"}']
        >= before.get('nextn:request_success_total{finished_reason="length"}', 0) + 2
    )
    assert m["nextn:generation_tokens_total"] >= before["nextn:generation_tokens_total"] + 10
    assert m["nextn:time_to_first_token_seconds_count"] >= before["nextn:time_to_first_token_seconds_count"] + 2
    assert m["nextn:session_hits_total"] > before["nextn:session_hits_total"]
    assert m["nextn:spec_decode_num_drafts_total"] > 0 and m["nextn:batch_size_count"] > 0
    assert m["nextn:num_requests_running"] == 0 and m["nextn:num_requests_waiting"] == 0


def test_graph_counts_reach_metrics_when_the_runner_keeps_them(cold, monkeypatch):
    """engine.runner.graph_counts, when there (the runner's CUDA graph counters), travels with
    each step's stats and shows as nextn:graph_*_total; without it no such line is written."""
    from nextn.engine.core import EngineCore
    from nextn.server.metrics import Metrics, SessionSnapshot

    core = EngineCore(cold.engine)
    if hasattr(cold.engine.runner, "graph_counts"):
        monkeypatch.delattr(cold.engine.runner, "graph_counts")
    assert core.stats().graph_counts is None
    metrics = Metrics(3)
    assert "nextn:graph_" not in metrics.render()
    monkeypatch.setattr(cold.engine.runner, "graph_counts", {"captures": 2, "replays": 40, "eager": 3}, raising=False)
    stats = core.stats()
    metrics.set_engine(SessionSnapshot(), {}, stats.graph_counts)
    text = metrics.render()
    for name, value in (("captures", 2), ("replays", 40), ("eager", 3)):
        assert f"nextn:graph_{name}_total {value}\n" in text
        assert f"# TYPE nextn:graph_{name}_total counter" in text


def test_sigkill_of_the_core_answers_503_and_stops_the_server(dense_ckpt, monkeypatch):
    """The core frozen (SIGSTOP) with a stream and a request open, then killed: both end with a 503
    naming the signal, a later request and /health are 503 too, and the server shuts itself down
    (CORE_DEATH_EXIT_S after the death) with the death recorded for `serve`'s exit status."""
    monkeypatch.setattr(server_app, "CORE_DEATH_EXIT_S", 3.0)
    core = launch(dense_ckpt)
    srv = LiveServer(core, CFG).__enter__()
    try:
        worker = srv.app.state.server.worker
        os.kill(core.pid, signal.SIGSTOP)
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            plain = pool.submit(srv.post, "/v1/completions", body)
            streamed = pool.submit(srv.post, "/v1/completions", {**body, "stream": True})
            assert wait_for(lambda: worker.num_open == 2)
            t0 = time.monotonic()
            os.kill(core.pid, signal.SIGKILL)
            r = plain.result(timeout=10)
            assert r.status_code == 503 and time.monotonic() - t0 < 2, r.text
            err = r.json()["error"]
            assert err["code"] == "service_unavailable"
            assert err["message"] == "the engine core process was killed by signal 9 (SIGKILL)."
            events = [line for line in streamed.result(timeout=10).text.splitlines() if line.startswith("data: ")]
            assert (
                events[-1] == "data: [DONE]" and "killed by signal 9" in json.loads(events[-2][6:])["error"]["message"]
            )
        later = srv.post("/v1/completions", body, timeout=5)
        assert later.status_code == 503 and "killed by signal 9" in later.json()["error"]["message"]
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 503
        assert worker.death == "the engine core process was killed by signal 9 (SIGKILL)"
        srv.thread.join(15)
        assert not srv.thread.is_alive() and srv.server.should_exit
    finally:
        srv.server.should_exit = True
        srv.thread.join(15)
        core.stop()


def test_a_core_that_fails_answers_503_naming_it(dense_ckpt, monkeypatch):
    """The core's loop raising (here on a message it cannot read): it reports why before it exits,
    and that is the 503's message."""
    monkeypatch.setattr(server_app, "CORE_DEATH_EXIT_S", 3.0)
    core = launch(dense_ckpt)
    with LiveServer(core, CFG) as srv:
        core._push.send(b"not msgpack")
        assert wait_for(lambda: not core.alive, timeout=10)
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"] == "the engine core stopped after an internal error."
        assert core.proc.exitcode == 1 and srv.app.state.server.worker.death is not None
    core.stop()


def test_a_core_that_cannot_start_raises_its_error(tmp_path):
    """A start-up failure in the child is raised here as LLM raises it (the CLI's one line); a
    setting is refused before any child starts."""
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        EngineArgs.of(model=None, device="tpu")
    with pytest.raises(ValueError, match="missing: no such directory"):
        CoreProcess.launch(EngineArgs.of(model=str(tmp_path / "missing")), "warning")


# ---------------------------------------------------------------------------------------------
# `nextn serve` end to end


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli(
    ckpt: Path | str, tmp_path: Path, name: str, flags: tuple[str, ...] = ("--max-model-len", "512")
) -> tuple[subprocess.Popen, str, Path]:
    """`nextn serve CKPT --port P *flags` (tests end it): the process, its URL, its log file."""
    port, log = _free_port(), tmp_path / f"{name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nextn.cli", "serve", str(ckpt), "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return proc.poll() is not None

    assert wait_for(up, timeout=120) and proc.poll() is None, log.read_text()
    return proc, url, log


def _core_pid(log: Path) -> int:
    found = re.search(r"engine core ready \(pid (\d+)\)", log.read_text())
    assert found, log.read_text()
    return int(found[1])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_nextn_serve_runs_its_core_in_a_process_and_stops_it_on_sigterm(dense_ckpt, tmp_path):
    proc, url, log = start_cli(dense_ckpt, tmp_path, "sigterm")
    try:
        core = _core_pid(log)
        assert core != proc.pid
        body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0.0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM), log.read_text()
        assert wait_for(lambda: _gone(core), timeout=10)  # the core went with it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_nextn_serve_exits_non_zero_when_its_core_is_killed(dense_ckpt, tmp_path):
    proc, url, log = start_cli(dense_ckpt, tmp_path, "sigkill")
    try:
        os.kill(_core_pid(log), signal.SIGKILL)
        assert proc.wait(30) == 1, log.read_text()
        assert "the engine core process was killed by signal 9 (SIGKILL)" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_hostile_grammar_is_refused_before_the_core(live):
    """A 5,000-hop `$ref` chain (a SIGSEGV inside llguidance's compiler) and a counted-repetition
    blow-up are refused by the API process, naming the limit; nothing reaches the core (same pid,
    alive), and the next request is answered."""
    core = live.app.state.server.worker.core
    pid = core.pid
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}
    chain = {"$ref": "#/$defs/d0", "$defs": {**defs, "d5000": {"type": "object"}}}
    for field, value, limit in [
        ("guided_json", chain, "MAX_REF_CHAIN"),
        ("guided_regex", "(?:a{1000}){1000}", "MAX_REPEAT"),
    ]:
        r = live.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and limit in r.text, r.text
    assert core.alive and core.pid == pid
    r = live.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text


def test_a_grammar_the_core_cannot_compile_fails_that_request_alone_as_a_400(cold):
    """Should a grammar past the API's checks fail to compile in the core (Engine.add's ValueError),
    that request ends as a bad request (a 400), and the core serves the next one."""
    from nextn.engine.core import AddRequest, EngineCore

    core = EngineCore(cold.engine)
    bad = SamplingParams(max_tokens=4, structured_outputs={"regex": "a(b"})
    (ev,) = core.apply([AddRequest(1, [5, 9, 11], bad)])
    assert ev.request_id == 1 and ev.bad_request and "regex" in ev.error
    core.apply([AddRequest(2, [5, 9, 11], SamplingParams(max_tokens=2, temperature=0.0))])
    done = []
    while core.has_work:
        done += [ev for ev in core.step() if ev.request_id == 2]
    assert done and not any(ev.error for ev in done)
