"""`nextn bench serve`: load an OpenAI-compatible server with streamed requests and report what its
clients see, in the shape of vLLM's `vllm bench serve` (its flags, its table, its JSON field names).

It drives a running server (`--base-url`), or starts `nextn serve` itself with the flags it does not
know as its own (`nextn bench serve --spec-k 3 --max-num-seqs 64 ...`) on a free loopback port,
waits for /health and stops it at the end, always. Prompts are random token ids (`--dataset random`,
sent as the `prompt` field's list of ints) or slices of a text file (`--prompt-file`), their input
and output lengths uniform in [len * (1 - ratio), len * (1 + ratio)] as vLLM's random dataset
(counted in tokens with a tokenizer, else as characters / 4). Requests leave at Poisson arrivals
(`--request-rate R`: exponential gaps, seeded; inf sends all at once) and at most
`--max-concurrency C` are in flight (a request that arrives while C run waits for one to end).

Per request, from its stream (`stream_options.include_usage`):
- TTFT: sent -> the first chunk that carries text (or token ids);
- ITL: the gaps between its successive chunks that carry text. Speculative decoding emits a
  round's accepted drafts and bonus token in one chunk, so ITL is a gap per chunk, not per token
  (as vLLM's), and exceeds TPOT when drafts are accepted;
- TPOT = (latency - TTFT) / (output tokens - 1), the output tokens from the final usage block
  (else the chunks' token ids, else one per chunk).
The mean acceptance length is the server's own, from its /metrics before and after the timed run:
1 + accepted draft tokens / drafts (rounds with a draft), vLLM's definition over vLLM's counter names
(`<prefix>:spec_decode_num_accepted_tokens_total`, `<prefix>:spec_decode_num_drafts_total`), which
nextn exports. A client cannot count it: a chunk is cut where the detokenizer can emit text and the
server's loop gets to it, not where a round ends.

Knows HTTP and the OpenAI wire format, not the engine: any OpenAI-compatible server works, and
nextn's extra fields (usage's spec_decode, /metrics) are read only where present. The prompts and
send times are nextn.bench.serve_workload's, the /metrics readings nextn.bench.serve_metrics'.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import aiohttp
import numpy as np
from tqdm import tqdm

from nextn.bench.serve_metrics import (
    engine_time,
    mean_acceptance_length,
    metrics_spec_k,
    parse_metrics,
    prefix_caching,
)
from nextn.bench.serve_workload import Prompt, arrival_times, sample_prompts, warmup_prompts
from nextn.config.engine_args import speculative_tokens

CHAT_ENDPOINT = "/v1/chat/completions"
ERRORS_SHOWN = 5


@dataclass
class RequestResult:
    input_len: int  # the prompt's sampled length
    prompt_tokens: int | None = None  # the server's count (its usage block)
    success: bool = False
    ttft: float | None = None  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # seconds between successive content chunks
    output_tokens: int = 0
    error: str = ""
    sent: float = 0.0  # perf_counter when sent (run_requests: seconds after the run's start)


@dataclass(frozen=True)
class Target:
    """Where requests go and the body every one shares."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None
    temperature: float
    ignore_eos: bool

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, p: Prompt) -> dict:
        body = {
            "model": self.model,
            "max_tokens": p.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:  # vLLM's extension: sent only when asked, so plain OpenAI servers work
            body["ignore_eos"] = True
        if self.endpoint == CHAT_ENDPOINT:
            body["messages"] = [{"role": "user", "content": p.prompt}]
        else:
            body["prompt"] = p.prompt
        return body


class Run(NamedTuple):
    model: str
    results: list[RequestResult]
    duration: float  # seconds
    before: dict[str, float] | None  # /metrics samples (None: the server has none, or refused)
    after: dict[str, float] | None


def check_args(args) -> None:
    """The flags checked before a tokenizer loads, a server starts or a request leaves."""
    a = args
    checks = (
        (a.num_prompts >= 1, f"--num-prompts must be >= 1, got {a.num_prompts}"),
        (a.num_warmups >= 0, f"--num-warmups must be >= 0, got {a.num_warmups}"),
        (
            a.max_concurrency is None or a.max_concurrency >= 1,
            f"--max-concurrency must be >= 1, got {a.max_concurrency}",
        ),
        (a.request_rate > 0, f"--request-rate must be > 0 (inf: all at once), got {a.request_rate}"),
        (a.random_input_len >= 1, f"--random-input-len must be >= 1, got {a.random_input_len}"),
        (a.prefix_len >= 0, f"--prefix-len must be >= 0, got {a.prefix_len}"),
        (a.random_output_len >= 1, f"--random-output-len must be >= 1, got {a.random_output_len}"),
        (0.0 <= a.random_range_ratio < 1.0, f"--random-range-ratio must be in [0, 1), got {a.random_range_ratio}"),
        (a.temperature >= 0.0, f"--temperature must be >= 0, got {a.temperature}"),
        (a.ready_timeout > 0, f"--ready-timeout must be > 0, got {a.ready_timeout}"),
        (a.prompt_file is None or a.dataset is None, "give --dataset random or --prompt-file, not both"),
        (a.prompt_file is None or Path(a.prompt_file).is_file(), f"--prompt-file {a.prompt_file}: not a file"),
        (
            a.prompt_file is not None or a.endpoint != CHAT_ENDPOINT,
            f"--dataset random sends token ids, which {CHAT_ENDPOINT} does not take; give --prompt-file",
        ),
        (
            a.base_url is None or a.base_url.startswith(("http://", "https://")),
            f"--base-url must start with http:// or https://, got {a.base_url!r}",
        ),
        (all("=" in m for m in a.metadata), f"--metadata takes KEY=VALUE pairs, got {' '.join(a.metadata)}"),
    )
    for ok, message in checks:  # a comparison with nan is False: refused too
        if not ok:
            raise ValueError(message)


async def send(session: aiohttp.ClientSession, target: Target, prompt: Prompt) -> RequestResult:
    """One streamed request, timed from the moment it is sent."""
    res = RequestResult(prompt.input_len)
    start = last = res.sent = time.perf_counter()
    counted = 0  # output tokens seen in chunks, for a server that sends no usage block
    try:
        async with session.post(
            target.base_url + target.endpoint, json=target.body(prompt), headers=target.headers
        ) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {_message(await r.text())}"
                return res
            async for line in r.content:
                if not line.startswith(b"data:") or (data := line[5:].strip()) == b"[DONE]":
                    continue
                chunk, now = json.loads(data), time.perf_counter()
                if "error" in chunk:
                    res.error = _message(data.decode())
                    return res
                choice = (chunk.get("choices") or [{}])[0]
                delta = choice.get("delta") or {}
                text = choice.get("text") or delta.get("content") or delta.get("reasoning_content")
                if text or choice.get("token_ids"):
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    counted += len(choice.get("token_ids") or ()) or 1
                if usage := chunk.get("usage"):
                    res.output_tokens = usage.get("completion_tokens") or 0
                    res.prompt_tokens = usage.get("prompt_tokens")
    except Exception as e:  # a failed request is a result, not the end of the run
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.ttft = res.latency if res.ttft is None else res.ttft  # no text at all: the end is the first sign
    res.output_tokens = res.output_tokens or counted
    res.success = True
    return res


def _message(body: str) -> str:
    """An error body's message (OpenAI's `{"error": {"message": ...}}`), else the body, cut short."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        error = json.loads(body)["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    return " ".join(body.split())[:200]


async def run_requests(
    session: aiohttp.ClientSession, target: Target, prompts: list[Prompt], times: list[float], args, bar=None
) -> tuple[list[RequestResult], float]:
    """Every prompt sent at its time (seconds after the start), at most --max-concurrency in flight:
    the results in prompt order and the seconds from the start to the last answer."""
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(prompt: Prompt, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with limit:
            res = await send(session, target, prompt)
        if bar is not None:
            bar.update(1)
        return res

    results = await asyncio.gather(*(one(p, t) for p, t in zip(prompts, times, strict=True)))
    for r in results:
        r.sent -= start
    return list(results), time.perf_counter() - start


async def benchmark(args, base_url: str, prompts: list[Prompt], warm: list[Prompt]) -> Run:
    timeout = aiohttp.ClientTimeout(total=6 * 3600)  # a long queue is a measurement, not an error
    connector = aiohttp.TCPConnector(limit=0)  # what is in flight is the semaphore's to bound, not the pool's
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        target = Target(base_url, args.endpoint, "", args.api_key, args.temperature, args.ignore_eos)
        # --model names the request's model for a running server, the checkpoint for a started one
        model = args.model if args.base_url is not None and args.model else await first_model(session, target)
        target = dataclasses.replace(target, model=model)
        if warm:
            results, _ = await run_requests(session, target, warm, [0.0] * len(warm), args)
            if failed := [r for r in results if not r.success]:
                raise ValueError(f"{len(failed)} of {len(warm)} warm-up requests failed: {failed[0].error}")
        before = await scrape_metrics(session, target)
        with tqdm(total=len(prompts), disable=args.disable_tqdm, desc="requests") as bar:
            times = arrival_times(len(prompts), args.request_rate, args.seed)
            results, duration = await run_requests(session, target, prompts, times, args, bar)
        after = await scrape_metrics(session, target)
    return Run(model, results, duration, before, after)


async def first_model(session: aiohttp.ClientSession, target: Target) -> str:
    url = f"{target.base_url}/v1/models"
    try:
        async with session.get(url, headers=target.headers) as r:
            body = await r.text()
            if r.status != 200:
                raise ValueError(f"{url}: HTTP {r.status}: {_message(body)}")
            return json.loads(body)["data"][0]["id"]
    except (aiohttp.ClientError, OSError) as e:
        raise ValueError(f"cannot reach {url}: {e}") from None
    except (KeyError, IndexError, TypeError, json.JSONDecodeError):
        raise ValueError(f"{url}: no model listed; give --model") from None


async def scrape_metrics(session: aiohttp.ClientSession, target: Target) -> dict[str, float] | None:
    with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
        async with session.get(f"{target.base_url}/metrics", headers=target.headers) as r:
            if r.status == 200:
                return parse_metrics(await r.text())
    return None


def _stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    values = np.asarray(seconds) * 1000
    if not len(values):
        return {f"{s}_{name}_ms": None for s in ("mean", "median", "p99", "std")}
    return {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(np.median(values)),
        f"p99_{name}_ms": float(np.percentile(values, 99)),
        f"std_{name}_ms": float(values.std()),
    }


def _spread(values: list[int]) -> dict[str, float | None]:
    return {"min": min(values), "mean": sum(values) / len(values), "max": max(values)} if values else {}


def summarize(results: list[RequestResult], duration: float, unit: str) -> dict:
    """vLLM's result fields over the successful requests (TPOT over those with 2+ output tokens); the
    input tokens as the server counted them where it did for every request, else the sampled lengths
    (in `unit`: "tokenizer" or "chars/4")."""
    ok = [r for r in results if r.success]
    by_server = bool(ok) and all(r.prompt_tokens is not None for r in ok)
    input_lens = [r.prompt_tokens if by_server else r.input_len for r in ok]
    output_lens = [r.output_tokens for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": sum(input_lens),
        "total_output_tokens": sum(output_lens),
        "duration": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(output_lens) / duration,
        "total_token_throughput": (sum(input_lens) + sum(output_lens)) / duration,
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", tpots),
        **_stats("itl", [gap for r in ok for gap in r.itl]),
        **_stats("e2el", [r.latency for r in ok]),
        "input_tokens_counted_by": "server" if by_server else unit,
        "input_lens": _spread(input_lens),
        "output_lens": _spread(output_lens),
        "errors": [r.error for r in results if not r.success][:ERRORS_SHOWN],
    }


def serve_command(flags: list[str]) -> tuple[list[str], str]:
    """`nextn serve` with `flags` on a free loopback port (the same nextn this process imported,
    first on its path), and the URL it will answer at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nextn.cli", "serve", *flags, "--host", "127.0.0.1", "--port", str(port)]
    return cmd, f"http://127.0.0.1:{port}"


class LaunchedServer:
    """A server as a child process, up once `url`/health answers 200, stopped on exit (SIGTERM, then
    SIGKILL after 30 s). Its output goes to a temporary file, whose last line says why it did not come up."""

    def __init__(self, cmd: list[str], url: str, ready_timeout: float):
        self.cmd, self.url, self.ready_timeout = cmd, url, ready_timeout

    def __enter__(self) -> LaunchedServer:
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env
        )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(
                    f"the server exited with code {self.proc.returncode} before it was ready: {self._last_line()}"
                )
            with contextlib.suppress(OSError):  # urllib's errors are OSErrors: not listening yet, or 503
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            time.sleep(0.25)
        raise ValueError(
            f"the server was not ready within --ready-timeout {self.ready_timeout:g} s: {self._last_line()}"
        )

    def _last_line(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the server drains (nothing is open by now) and exits
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def device_name() -> str:
    """The GPU this process sees (torch's name for it), else the machine's platform."""
    with contextlib.suppress(ImportError):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    return f"cpu ({platform.machine()}, {platform.platform(terse=True)})"


def tokenizer_path(args) -> str | None:
    """--tokenizer; else the checkpoint the bench starts the server with; else --model when it is a
    local directory with a tokenizer.json; else None (lengths in characters / 4). A server started
    with --random-weights has no checkpoint: --tokenizer is then needed (and goes to it too)."""
    from nextn.hub import resolve_model

    path = args.tokenizer
    if path is None and _random_weights(args) is not None:
        raise ValueError("--random-weights needs --tokenizer DIR (the server it starts and the bench both use it)")
    if path is None and args.base_url is None:
        path = str(resolve_model(args.model))
    elif path is None and args.model is not None and (Path(args.model) / "tokenizer.json").is_file():
        path = args.model
    if path is None and args.prompt_file is None:
        raise ValueError("--dataset random draws token ids from a vocabulary: give --tokenizer DIR")
    return path


def _serve_flags(args) -> list[str]:
    model = ["--model", args.model] if args.model is not None else []
    tokenizer = ["--tokenizer", args.tokenizer] if _random_weights(args) is not None else []
    return model + (["--api-key", args.api_key] if args.api_key else []) + tokenizer + args.serve_flags


def _random_weights(args) -> str | None:
    """The --random-weights preset of the server the bench starts (None: a checkpoint, or --base-url)."""
    return getattr(args.serve, "random_weights", None)


def _launched_spec_k(serve) -> int | None:
    """K as the flags the bench started `nextn serve` with set it (None: the checkpoint's default)."""
    if serve is None:
        return None
    return speculative_tokens(serve.num_speculative_tokens, serve.speculative_config)


def bench_serve_from_args(args) -> int:
    from nextn.tokenizer import Tokenizer

    check_args(args)
    tokenizer_id = tokenizer_path(args)
    tokenizer = None if tokenizer_id is None else Tokenizer(tokenizer_id)
    prompts = sample_prompts(args, tokenizer)
    launched = LaunchedServer(*serve_command(_serve_flags(args)), args.ready_timeout) if args.base_url is None else None
    with launched or contextlib.nullcontext():
        base_url = (args.base_url or launched.url).rstrip("/")
        run = asyncio.run(benchmark(args, base_url, prompts, warmup_prompts(args, tokenizer)))
        device = device_name()  # after the run: CUDA taken here must not shrink a starting server's cache
    spec_k = _launched_spec_k(args.serve)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if args.endpoint == CHAT_ENDPOINT else "openai",
        "model_id": run.model,
        "model": args.model if args.model is not None else run.model,
        "tokenizer_id": tokenizer_id,
        "dataset": args.prompt_file or "random",
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "seed": args.seed,
        "base_url": base_url,
        **summarize(run.results, run.duration, "chars/4" if tokenizer is None else "tokenizer"),
        "mean_acceptance_length": mean_acceptance_length(run.before, run.after),
        "prefix_len": args.prefix_len,
        **prefix_caching(run.before, run.after),
        "spec_k": spec_k if spec_k is not None else metrics_spec_k(run.after),
        "graph_metrics": {k: v for k, v in (run.after or {}).items() if "graph" in k},
        "engine_time": engine_time(run.before, run.after, run.duration),
        "device": device,
        "command": shlex.join(args.argv),
        **dict(m.split("=", 1) for m in args.metadata),
    }
    if args.save_detailed:  # vLLM's per-request lists (seconds), in prompt order, and when each left
        ok = [r for r in run.results if r.success]
        result.update(ttfts=[r.ttft for r in ok], e2els=[r.latency for r in ok], sent_at=[r.sent for r in ok])
    print_report(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["completed"] else 1


def print_report(r: dict) -> None:
    def row(label: str, value) -> None:
        shown = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else value
        print(f"{label:<40}{shown:<10}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", r["completed"])
    row("Failed requests:", r["failed"])
    row("Maximum request concurrency:", r["max_concurrency"])
    row("Benchmark duration (s):", r["duration"])
    row(f"Total input tokens ({r['input_tokens_counted_by']}):", r["total_input_tokens"])
    row("Total generated tokens:", r["total_output_tokens"])
    row("Request throughput (req/s):", r["request_throughput"])
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Total token throughput (tok/s):", r["total_token_throughput"])
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency (per chunk)"),
        ("e2el", "End-to-end Latency"),
    ):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):", r[f"{stat}_{key}_ms"])
    print("{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"))
    row("Draft tokens per round (K):", r["spec_k"])
    row("Mean acceptance length (server):", r["mean_acceptance_length"])
    print("{s:{c}^{n}}".format(s="Prefix Caching", n=50, c="-"))
    row("Prefix caching:", r["prefix_caching"])
    row("Prefix cache hit rate:", r["prefix_cache_hit_rate"])
    row("Prefill tokens computed:", r["prefill_tokens_computed"])
    if r["engine_time"] is not None:  # nextn's: where its engine spent the run
        t = r["engine_time"]
        print("{s:{c}^{n}}".format(s="Engine Time (server)", n=50, c="-"))
        row("Engine steps:", int(t["steps"]))
        row("Steps' wall time (s):", t["step_seconds"])
        row(f"Prefill passes ({int(t['prefill_passes'])}) (s):", t["prefill_seconds"])
        row("Batched rounds (s):", t["round_seconds"])
        row("Rounds with prompt pieces riding:", int(t.get("mixed_steps", 0)))
    print("=" * 50)
    for error in r["errors"]:
        print(f"nextn bench serve: a request failed: {error}", file=sys.stderr)
