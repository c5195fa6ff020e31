"""`nextn bench serve` end to end: against a real nextn server on the bundled model (in-process on
loopback, and started by the bench itself as a child process), and against a tiny fake
OpenAI-compatible server that records how many requests it holds at once, counts vLLM-named spec
counters on /metrics and fails the requests it is told to. No timing assertions beyond ordering.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from argparse import Namespace

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("uvicorn")

from aiohttp import web  # noqa: E402
from live_server import serving  # noqa: E402

from nextn import LLM  # noqa: E402
from nextn.bench import serve as bench_serve  # noqa: E402
from nextn.bench.serve_metrics import engine_time, mean_acceptance_length, parse_metrics  # noqa: E402
from nextn.bench.serve_workload import arrival_times, sample_prompts, warmup_prompts  # noqa: E402
from nextn.cli import main  # noqa: E402
from nextn.config import DEFAULT_MODEL_DIR  # noqa: E402
from nextn.config.serve import ServeConfig  # noqa: E402
from nextn.tokenizer import Tokenizer  # noqa: E402

KEY = "bench-key"
PROMPT_FILE = DEFAULT_MODEL_DIR.parent / "engine" / "rounds.py"  # Python the bundled model reads well
VLLM_FIELDS = (
    "date backend model_id num_prompts max_concurrency request_rate completed failed total_input_tokens "
    "total_output_tokens duration request_throughput output_throughput total_token_throughput mean_ttft_ms "
    "median_ttft_ms p99_ttft_ms std_ttft_ms mean_tpot_ms median_tpot_ms p99_tpot_ms mean_itl_ms median_itl_ms "
    "p99_itl_ms mean_acceptance_length device model spec_k command input_lens output_lens"
).split()


def bench(capsys, tmp_path, *argv) -> tuple[int, dict, str]:
    """Run `nextn bench serve argv`: its exit code, its JSON and its stderr."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--disable-tqdm", "--json", str(out), *argv])
    err = capsys.readouterr().err
    return rc, json.loads(out.read_text()) if out.exists() else {}, err


# ---------------------------------------------------------------------------------------------
# A real server: the bundled model (K=3 by default: it drafts)


@pytest.fixture(scope="module")
def live():
    llm = LLM(max_model_len=256)
    with serving(llm, ServeConfig(api_key=KEY)) as url:
        yield url
    llm.close()


def test_random_token_ids_against_nextn(live, capsys, tmp_path):
    rc, res, _ = bench(
        capsys,
        tmp_path,
        *("--base-url", live, "--api-key", KEY, "--tokenizer", str(DEFAULT_MODEL_DIR), "--dataset", "random"),
        *("--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "10", "--ignore-eos"),
        *("--max-concurrency", "2", "--num-warmups", "1", "--metadata", "run=ci", "note=a=b"),
    )
    assert rc == 0 and not (missing := [f for f in VLLM_FIELDS if f not in res]), missing
    assert res["completed"] == 4 and res["failed"] == 0 and res["num_prompts"] == 4
    assert res["total_output_tokens"] == 4 * 10 and res["total_input_tokens"] == 4 * 12  # ignore_eos; exact ids
    assert res["input_lens"] == {"min": 12, "mean": 12.0, "max": 12} and res["input_tokens_counted_by"] == "server"
    assert res["model_id"] == "default_model" and res["max_concurrency"] == 2 and res["request_rate"] == "inf"
    for stat in ("mean", "median", "p99"):  # each request's TTFT <= its latency, so every order statistic too
        assert 0 < res[f"{stat}_ttft_ms"] <= res[f"{stat}_e2el_ms"]
    assert res["mean_tpot_ms"] > 0 and res["mean_itl_ms"] > 0
    assert res["spec_k"] == 3  # the per-position counters of /metrics
    assert 1.0 <= res["mean_acceptance_length"] <= 1 + 3
    assert res["run"] == "ci" and res["note"] == "a=b" and res["command"].startswith("nextn bench serve --disable")
    t = res["engine_time"]  # the server engine's steps over the run: prompts prefilled, rounds run, within the steps
    assert t["steps"] > 0 and t["prefill_passes"] >= 1 and t["prefill_seconds"] > 0 and t["round_seconds"] > 0
    assert t["prefill_seconds"] + t["round_seconds"] <= t["step_seconds"] and t["run_seconds"] == res["duration"]


def test_prompt_file_slices_at_random_lengths(live, capsys, tmp_path):
    rc, res, _ = bench(
        capsys,
        tmp_path,
        *("--base-url", live, "--api-key", KEY, "--tokenizer", str(DEFAULT_MODEL_DIR)),
        *("--prompt-file", str(PROMPT_FILE), "--num-prompts", "3", "--random-input-len", "20"),
        *("--random-range-ratio", "0.5", "--random-output-len", "6", "--ignore-eos", "--request-rate", "50"),
    )
    assert rc == 0 and res["completed"] == 3 and res["total_output_tokens"] == 3 * 6
    assert res["tokenizer_id"] == str(DEFAULT_MODEL_DIR) and res["dataset"] == str(PROMPT_FILE)
    assert res["request_rate"] == 50.0 and res["input_tokens_counted_by"] == "server"
    # the server's count of each decoded slice of 10..30 tokens (a token at a cut may re-encode differently)
    assert 10 - 2 <= res["input_lens"]["min"] <= res["input_lens"]["max"] <= 30 + 2


def test_chat_endpoint_without_a_tokenizer(live, capsys, tmp_path):
    rc, res, _ = bench(
        capsys,
        tmp_path,
        *("--base-url", live, "--api-key", KEY, "--endpoint", "/v1/chat/completions"),
        *("--prompt-file", str(PROMPT_FILE), "--num-prompts", "2", "--random-input-len", "8"),
        *("--random-output-len", "5", "--ignore-eos"),
    )
    assert rc == 0 and res["backend"] == "openai-chat" and res["completed"] == 2
    assert res["total_output_tokens"] == 2 * 5 and res["tokenizer_id"] is None
    assert res["input_lens"]["min"] > 8  # the server counts the chat template's tokens too


def test_the_bench_starts_nextn_serve_and_stops_it(capsys, tmp_path):
    rc, res, _ = bench(
        capsys,
        tmp_path,
        *("--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos"),
        *("--spec-k", "2", "--max-model-len", "128", "--device", "cpu", "--log-interval", "0"),
    )
    assert rc == 0 and res["completed"] == 2 and res["total_output_tokens"] == 8
    assert res["spec_k"] == 2 and res["model_id"] == "default_model" and res["mean_acceptance_length"] >= 1
    host, port = res["base_url"].removeprefix("http://").split(":")
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
        pass  # stopped: nothing listens there any more


def test_a_server_that_exits_early_is_one_line_and_gone(capsys, tmp_path, monkeypatch):
    script = "import sys; print('starting'); print('nextn: error: no such flag value', file=sys.stderr); sys.exit(2)"
    monkeypatch.setattr(bench_serve, "serve_command", lambda flags: ([sys.executable, "-c", script], "http://x"))
    rc, res, err = bench(capsys, tmp_path, "--num-prompts", "1")
    assert rc == 2 and not res
    assert err == "nextn: error: the server exited with code 2 before it was ready: nextn: error: no such flag value\n"


def test_a_server_that_never_comes_up_is_stopped():
    cmd = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    server = bench_serve.LaunchedServer(cmd, "http://127.0.0.1:9", ready_timeout=0.5)
    with pytest.raises(ValueError, match=r"not ready within --ready-timeout 0.5 s: loading$"):
        server.__enter__()
    assert server.proc.returncode is not None  # terminated, not left running


# ---------------------------------------------------------------------------------------------
# A fake OpenAI-compatible server

CHUNKS = 4  # per response, 2 tokens each (as a speculative round emits several)


class FakeServer:
    """/v1/models, streamed /v1/completions and vLLM-named counters on /metrics (each finished
    request adds 4 drafts and 6 accepted tokens: acceptance length 2.5 over any run, but not over the
    counters' totals, which start elsewhere). `fail(i)` picks how the i-th request fails: "http" (a
    500), "stream" (an error event after one chunk) or None. Requests from the `unheld`-th on wait
    (up to 2 s) until `hold` are in flight before they answer, so a bound is reached however slowly
    the client sends."""

    def __init__(self, fail=lambda i: None, metrics=True, usage=True, hold=0, unheld=0):
        self.fail, self.usage, self.hold, self.unheld = fail, usage, hold, unheld
        self.count, self.in_flight, self.max_in_flight = 0, 0, 0
        self.drafts, self.accepted = 100, 10
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        if metrics:
            app.router.add_get("/metrics", self.metrics)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        i, self.count = self.count, self.count + 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            body = await request.json()
            assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["model"] == "fake"
            if (how := self.fail(i)) == "http":
                return web.json_response({"error": {"message": f"request {i} refused"}}, status=500)
            deadline = time.monotonic() + 2
            while i >= self.unheld and self.in_flight < self.hold and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for j in range(CHUNKS):
                await asyncio.sleep(0.02)
                if how == "stream" and j == 1:
                    await resp.write(b'data: {"error": {"message": "engine fell over"}}\n\ndata: [DONE]\n\n')
                    return resp
                await resp.write(b'data: {"choices": [{"index": 0, "text": "ab"}]}\n\n')
            if self.usage:
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2 * CHUNKS}
                await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            self.drafts, self.accepted = self.drafts + 4, self.accepted + 6
            return resp
        finally:
            self.in_flight -= 1

    async def metrics(self, _: web.Request) -> web.Response:
        pos = "".join(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}} 1\n' for j in range(3))
        pos += "".join(f'vllm:spec_decode_num_draft_tokens_per_pos_total{{position="{j}"}} 1\n' for j in range(3))
        return web.Response(
            text=f'# TYPE x counter\nvllm:spec_decode_num_drafts_total{{model_name="fake"}} {self.drafts}\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="fake"}} {self.accepted}\n'
            f"{pos}vllm:cuda_graph_captures_total 7\n"
        )


def fake_bench(capsys, tmp_path, url: str, *argv) -> tuple[int, dict, str]:
    return bench(
        capsys, tmp_path, "--base-url", url, "--tokenizer", str(DEFAULT_MODEL_DIR), "--random-input-len", "5", *argv
    )


@pytest.mark.parametrize("limit", [1, 3, None])
def test_concurrency_is_bounded(limit, capsys, tmp_path):
    with FakeServer(hold=limit or 9, unheld=2) as srv:  # the two warm-ups answer at once
        cap = ["--max-concurrency", str(limit)] if limit else []
        rc, res, _ = fake_bench(capsys, tmp_path, srv.url, "--num-prompts", "9", "--num-warmups", "2", *cap)
    assert rc == 0 and res["completed"] == 9 and srv.count == 9 + 2  # the warm-ups sent, not counted
    assert srv.max_in_flight == (limit or 9)  # reached, never passed
    assert res["total_output_tokens"] == 9 * 2 * CHUNKS and res["total_input_tokens"] == 9 * 5
    assert res["input_tokens_counted_by"] == "server"
    assert res["mean_acceptance_length"] == 2.5  # the deltas over the run, not the totals (2.06)
    assert res["spec_k"] == 3 and res["graph_metrics"] == {"vllm:cuda_graph_captures_total": 7.0}
    assert res["engine_time"] is None  # (nextn's engine counters only)
    assert res["mean_itl_ms"] > 0 and res["median_ttft_ms"] <= res["median_e2el_ms"]
    assert "ttfts" not in res  # the per-request lists with --save-detailed only


def test_save_detailed_lists_each_request(capsys, tmp_path):
    with FakeServer(hold=3, unheld=0) as srv:
        rc, res, _ = fake_bench(
            capsys, tmp_path, srv.url, "--num-prompts", "6", "--max-concurrency", "3", "--save-detailed"
        )
    assert rc == 0 and len(res["ttfts"]) == len(res["e2els"]) == len(res["sent_at"]) == 6
    assert all(0 < t <= e for t, e in zip(res["ttfts"], res["e2els"], strict=True))
    # the fourth leaves when one of the first three has finished (at most three in flight)
    order = sorted(range(6), key=lambda i: res["sent_at"][i])
    first_end = min(res["sent_at"][i] + res["e2els"][i] for i in order[:3])
    assert first_end - 0.01 <= res["sent_at"][order[3]] <= res["duration"]


def test_without_usage_the_bench_counts_chunks_and_its_own_lengths(capsys, tmp_path):
    with FakeServer(usage=False) as srv:
        rc, res, _ = bench(
            capsys, tmp_path, *("--base-url", srv.url, "--prompt-file", str(PROMPT_FILE), "--num-prompts", "3")
        )
    assert rc == 0 and res["completed"] == 3 and res["total_output_tokens"] == 3 * CHUNKS  # a token a chunk
    assert res["input_tokens_counted_by"] == "chars/4" and res["total_input_tokens"] == 3 * 1024  # the default
    assert res["tokenizer_id"] is None and res["model_id"] == "fake"


def test_failed_requests_are_counted(capsys, tmp_path):
    with FakeServer(fail=lambda i: ("http", "stream", None)[i % 3], metrics=False) as srv:
        rc, res, err = fake_bench(capsys, tmp_path, srv.url, "--num-prompts", "6", "--max-concurrency", "1")
    assert rc == 0 and res["completed"] == 2 and res["failed"] == 4
    assert res["total_output_tokens"] == 2 * 2 * CHUNKS  # the successful ones only
    assert res["errors"][:2] == ["HTTP 500: request 0 refused", "engine fell over"]
    assert "a request failed: HTTP 500: request 3 refused" in err
    assert res["mean_acceptance_length"] is None and res["spec_k"] is None  # no /metrics: n/a


def test_every_request_failing_exits_1_with_its_report(capsys, tmp_path):
    with FakeServer(fail=lambda i: "http") as srv:
        rc, res, err = fake_bench(capsys, tmp_path, srv.url, "--num-prompts", "3")
    assert rc == 1 and res["completed"] == 0 and res["failed"] == 3 and res["mean_ttft_ms"] is None
    assert err.count("a request failed") == 3 and "Traceback" not in err


def test_a_failed_warm_up_stops_the_run(capsys, tmp_path):
    with FakeServer(fail=lambda i: "http" if i == 0 else None) as srv:
        rc, res, err = fake_bench(capsys, tmp_path, srv.url, "--num-prompts", "3", "--num-warmups", "1")
    assert rc == 2 and not res and srv.count == 1
    assert err == "nextn: error: 1 of 1 warm-up requests failed: HTTP 500: request 0 refused\n"


# ---------------------------------------------------------------------------------------------
# The pieces


def test_poisson_arrivals_are_reproducible():
    times = arrival_times(2000, 10.0, seed=1)
    assert times == arrival_times(2000, 10.0, seed=1) and times != arrival_times(2000, 10.0, seed=2)
    assert times[0] == 0.0 and all(a < b for a, b in zip(times, times[1:], strict=False))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert 0.09 < sum(gaps) / len(gaps) < 0.11  # exponential gaps of mean 1/rate (sd of this mean: 0.0022)
    assert arrival_times(5, float("inf"), seed=1) == [0.0] * 5


def test_prompts_are_reproducible_and_in_range():
    lengths = dict(random_input_len=20, random_output_len=8, random_range_ratio=0.5)
    args = Namespace(num_prompts=50, seed=7, prompt_file=None, prefix_len=0, **lengths)
    tok = Tokenizer(DEFAULT_MODEL_DIR)
    prompts = sample_prompts(args, tok)
    assert prompts == sample_prompts(args, tok) and prompts != sample_prompts(
        Namespace(**{**vars(args), "seed": 8}), tok
    )
    assert {len(p.prompt) for p in prompts} == {p.input_len for p in prompts} and len(
        {p.input_len for p in prompts}
    ) > 5
    assert all(10 <= p.input_len <= 30 and 4 <= p.output_len <= 12 for p in prompts)
    assert all(0 <= t < tok.vocab_size for p in prompts for t in p.prompt)
    text = sample_prompts(Namespace(**{**vars(args), "prompt_file": str(PROMPT_FILE)}), None)
    assert all(len(p.prompt) == 4 * p.input_len and p.prompt in PROMPT_FILE.read_text() * 2 for p in text)


def test_warmup_prompts_share_nothing_with_the_measured_ones():
    """Warm-ups at the run's lengths that leave none of its blocks in a prefix cache."""
    lengths = dict(random_input_len=20, random_output_len=8, random_range_ratio=0.0)
    args = Namespace(num_prompts=6, num_warmups=4, seed=7, prompt_file=None, prefix_len=40, **lengths)
    tok = Tokenizer(DEFAULT_MODEL_DIR)
    measured, warm = sample_prompts(args, tok), warmup_prompts(args, tok)
    assert len(warm) == 4 and {p.input_len for p in warm} == {p.input_len for p in measured} == {60}
    assert not {tuple(p.prompt[:8]) for p in warm} & {tuple(p.prompt[:8]) for p in measured}
    assert warmup_prompts(Namespace(**{**vars(args), "num_warmups": 0}), tok) == []


def test_acceptance_length_from_metric_deltas():
    before = parse_metrics("nextn:spec_decode_num_drafts_total 10\nnextn:spec_decode_num_accepted_tokens_total 5\n")
    after = parse_metrics(
        "# HELP x\nnextn:spec_decode_num_drafts_total 30\nnextn:spec_decode_num_accepted_tokens_total 35 1700000000\n"
    )
    assert mean_acceptance_length(before, after) == 1 + 30 / 20
    assert mean_acceptance_length(before, before) is None and mean_acceptance_length(None, after) is None


def test_engine_time_from_metric_deltas():
    names = ("steps", "step_seconds", "prefill_passes", "prefill_seconds", "round_seconds")
    before = parse_metrics("".join(f"nextn:engine_{n}_total {i}\n" for i, n in enumerate(names)))
    after = parse_metrics("".join(f"nextn:engine_{n}_total {3 * i + 1}\n" for i, n in enumerate(names)))
    assert engine_time(before, after, 9.5) == {n: 2 * i + 1 for i, n in enumerate(names)} | {"run_seconds": 9.5}
    assert engine_time(None, after, 1.0) is None and engine_time(before, parse_metrics("x 1\n"), 1.0) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
        (["--request-rate", "-1"], "--request-rate must be > 0"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1)"),
        (["--prompt-file", "/nonexistent/f.txt"], "--prompt-file /nonexistent/f.txt: not a file"),
        (["--prompt-file", str(PROMPT_FILE), "--dataset", "random"], "give --dataset random or --prompt-file"),
        (["--endpoint", "/v1/chat/completions"], "--dataset random sends token ids"),
        (["--base-url", "http://127.0.0.1:9", "--spec-k", "3"], "unrecognized arguments: --spec-k 3"),
        (["--port", "8001"], "--port: the bench picks the address"),
        (["--metadata", "novalue"], "--metadata takes KEY=VALUE"),
        (["--base-url", "http://127.0.0.1:9"], "--dataset random draws token ids from a vocabulary"),
        (["--base-url", "127.0.0.1:9"], "--base-url must start with http://"),
        (["--json", "/nonexistent/r.json"], "--json /nonexistent/r.json: its folder does not exist"),
    ],
)
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(["bench", "serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nextn: error: {message}"), err


def test_an_unknown_flag_is_refused_by_serve_before_it_starts(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--num-promts", "3"])
    assert e.value.code == 2 and "unrecognized arguments: --num-promts" in capsys.readouterr().err


def test_plain_bench_is_still_the_offline_bench():
    from nextn.cli import parse_args

    args = parse_args(["bench", "--spec-k", "1", "--gen-len", "4"])
    assert args.command == "bench" and args.spec_k == [1] and args.gen_len == 4
