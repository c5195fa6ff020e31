"""Soak `nextn serve`: a server in its own process (the bundled model by default) under `--clients`
concurrent clients for `--duration` seconds of mixed requests: chat and completions, streamed and
not, streams dropped mid-way, multi-turn sessions, long prompts, /tokenize, /metrics scrapes and
bad inputs (malformed JSON, lone surrogates, template type errors, unknown fields' values, a body
over the size limit, a wrong key). Everything stays on loopback; every request has a deadline.

Writes one JSON (default bench/results/soak_<date>.json): duration_s, requests, errors_5xx, hangs
(requests past --request-timeout, and clients still busy after the end), transport_errors
(connections the server broke), rss_mb_after_warmup
(the server's resident memory `--warmup` seconds in), rss_mb_end, p99_latency_s (of requests that
ran to their end), counts by kind and status, an RSS series, and the command that made it.
Exits 1 unless 0 5xx, 0 hangs, 0 transport errors and rss_mb_end <= 1.25 x rss_mb_after_warmup.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
KEY = "soak-key"
SOURCE_TEXT = "\n".join(p.read_text() for p in sorted((REPO / "nextn" / "engine").glob("*.py")))
BAD_BODIES = [
    b"{not json",
    b'{"prompt": "x\\ud800"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": 5}}',
    b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]}',
    b'{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
    b'{"prompt": "x", "max_tokens": 1000000000}',
    b'{"prompt": "x", "temperature": "hot"}',
    b'{"prompt": [1, 2, 99999999]}',
    b'{"prompt": "x", "min_tokens": 4}',
    b'{"prompt": "x", "model": "gpt-4o"}',
    b"[]",
    b'{"messages": []}',
    b'{"prompt": "x", "stop": [""]}',
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Soak:
    def __init__(self, url: str, args):
        self.url, self.args = url, args
        self.headers = {"Authorization": f"Bearer {KEY}"}
        self.kinds: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.latencies: list[float] = []
        self.errors_5xx: list[str] = []
        self.transport_errors: list[str] = []
        self.hangs = 0

    def record(self, kind: str, status: int, seconds: float | None, detail: str = "") -> None:
        self.kinds[kind] += 1
        self.statuses[status] += 1
        if status >= 500:
            self.errors_5xx.append(f"{kind} {status} {detail[:200]}")
        if seconds is not None:
            self.latencies.append(seconds)

    async def client(self, http: httpx.AsyncClient, rng: random.Random, deadline: float) -> None:
        scenarios = [
            (self.chat, 3),
            (self.completion, 3),
            (self.dropped_stream, 1),
            (self.session, 2),
            (self.long_prompt, 1),
            (self.bad_input, 2),
            (self.tokenize, 1),
            (self.scrape, 1),
        ]
        funcs, weights = zip(*scenarios, strict=True)
        while time.monotonic() < deadline:
            scenario = rng.choices(funcs, weights)[0]
            try:
                await asyncio.wait_for(scenario(http, rng), self.args.request_timeout)
            except TimeoutError:
                self.hangs += 1
                self.record(scenario.__name__, 0, None, "timed out")
            except httpx.TransportError as e:  # a connection the server broke (counted, never expected)
                self.transport_errors.append(f"{scenario.__name__}: {e!r}")

    async def post(self, http, kind: str, path: str, body, expect_ok: bool = True) -> httpx.Response:
        t0 = time.monotonic()
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await http.post(path, content=content, headers={**self.headers, "Content-Type": "application/json"})
        self.record(kind, r.status_code, time.monotonic() - t0 if expect_ok else None, r.text)
        return r

    async def stream(self, http, kind: str, path: str, body, max_events: int | None = None) -> str:
        """The streamed text; stops after `max_events` (a client that drops the stream)."""
        t0, text, n = time.monotonic(), [], 0
        async with http.stream("POST", path, json=body, headers=self.headers) as r:
            if r.status_code != 200:
                await r.aread()
                self.record(kind, r.status_code, None, r.text)
                return ""
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.record(kind, 500, None, line)
                    return ""
                for c in event.get("choices", []):
                    text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
                n += 1
                if max_events is not None and n >= max_events:
                    self.record(kind, 200, None)
                    return "".join(text)
        self.record(kind, 200, time.monotonic() - t0)
        return "".join(text)

    def sampling(self, rng: random.Random) -> dict:
        if rng.random() < 0.5:
            return {"temperature": 0.0}
        return {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1000)}

    def code_prompt(self, rng: random.Random, chars: int) -> str:
        start = rng.randrange(len(SOURCE_TEXT) - chars)
        return SOURCE_TEXT[start : start + chars]

    async def chat(self, http, rng):
        messages = [{"role": "user", "content": "Write a Python function. " + self.code_prompt(rng, 200)}]
        body = {"messages": messages, "max_tokens": rng.randrange(8, 48), **self.sampling(rng)}
        if rng.random() < 0.5:
            await self.stream(http, "chat_stream", "/v1/chat/completions", {**body, "stream": True})
        else:
            await self.post(http, "chat", "/v1/chat/completions", body)

    async def completion(self, http, rng):
        body = {"prompt": self.code_prompt(rng, 300), "max_tokens": rng.randrange(8, 64), **self.sampling(rng)}
        if rng.random() < 0.5:
            await self.stream(http, "completion_stream", "/v1/completions", {**body, "stream": True})
        else:
            await self.post(http, "completion", "/v1/completions", {**body, "logprobs": rng.choice([None, 2])})

    async def dropped_stream(self, http, rng):
        body = {"prompt": self.code_prompt(rng, 200), "max_tokens": 200, "stream": True, "ignore_eos": True}
        await self.stream(http, "dropped_stream", "/v1/completions", body, max_events=rng.randrange(1, 4))

    async def session(self, http, rng):
        """A conversation of 2-4 turns, each sending the previous replies back (a kept session)."""
        messages = [{"role": "system", "content": "You write Python."}]
        for turn in range(rng.randrange(2, 5)):
            messages.append({"role": "user", "content": f"Step {turn}: " + self.code_prompt(rng, 120)})
            body = {"messages": messages, "max_tokens": 24, "temperature": 0.0}
            r = await self.post(http, "session_turn", "/v1/chat/completions", body)
            if r.status_code != 200:
                return
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

    async def long_prompt(self, http, rng):
        body = {"prompt": self.code_prompt(rng, self.args.long_prompt_chars), "max_tokens": 8, "temperature": 0.0}
        await self.post(http, "long_prompt", "/v1/completions", body)

    async def bad_input(self, http, rng):
        pick = rng.randrange(len(BAD_BODIES) + 2)
        if pick == len(BAD_BODIES):  # a wrong key
            r = await http.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
            self.record("bad_input", r.status_code, None, r.text)
        elif pick == len(BAD_BODIES) + 1:  # a body over the 16 MiB limit (rarely: it costs the client memory)
            if rng.random() < 0.2:
                await self.post(http, "bad_input", "/v1/completions", b"x" * (17 * 2**20), expect_ok=False)
        else:
            path = "/v1/chat/completions" if b"messages" in BAD_BODIES[pick] else "/v1/completions"
            await self.post(http, "bad_input", path, BAD_BODIES[pick], expect_ok=False)

    async def tokenize(self, http, rng):
        await self.post(http, "tokenize", "/tokenize", {"prompt": self.code_prompt(rng, 500)})

    async def scrape(self, http, rng):
        t0 = time.monotonic()
        r = await http.get("/metrics", headers=self.headers)
        self.record("metrics", r.status_code, time.monotonic() - t0, r.text)


def server_env(args) -> dict[str, str]:
    """glibc gives threads that allocate at once malloc arenas of their own and keeps freed memory in
    each: with the batched engine on its thread, the request thread pool and torch's threads, this
    CPU server's RSS grew 738 -> 915 MB over its first 350 s (then held), against a 715 MB plateau
    with MALLOC_ARENA_MAX=2 (the usual setting for Python servers; 0 here leaves glibc's default)."""
    return {"MALLOC_ARENA_MAX": str(args.malloc_arena_max)} if args.malloc_arena_max else {}


def start_server(args, port: int, log_path: Path) -> tuple[subprocess.Popen, list[str]]:
    cmd = [sys.executable, "-m", "nextn.cli", "serve", "--port", str(port), "--api-key", KEY]
    cmd += ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, **server_env(args)}
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=REPO, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, cmd
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start in 300 s")


async def run(args, url: str, pid: int) -> tuple[Soak, dict]:
    soak = Soak(url, args)
    t0 = time.monotonic()
    deadline = t0 + args.duration
    limits = httpx.Limits(max_connections=args.clients * 2)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as http:
        tasks = [
            asyncio.create_task(soak.client(http, random.Random(args.seed + i), deadline)) for i in range(args.clients)
        ]
        series, warm = [], None
        while time.monotonic() < deadline:
            await asyncio.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
            elapsed = time.monotonic() - t0
            series.append([round(elapsed, 1), round(rss_mb(pid), 1)])
            if warm is None and elapsed >= args.warmup:
                warm = rss_mb(pid)
        done, pending = await asyncio.wait(tasks, timeout=args.request_timeout + 30)
        soak.hangs += len(pending)  # clients still inside a request long after the end
        for task in pending:
            task.cancel()
        end_rss = rss_mb(pid)
        health = (await http.get("/health")).status_code
    return soak, {
        "rss_mb_after_warmup": round(warm, 1),
        "rss_mb_end": round(end_rss, 1),
        "rss_mb_series": series,
        "duration_s": round(time.monotonic() - t0, 1),
        "health_after": health,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--warmup", type=float, default=60.0, help="seconds in when the baseline RSS is read")
    p.add_argument("--request-timeout", type=float, default=300.0, help="a request past this is a hang")
    p.add_argument("--long-prompt-chars", type=int, default=6000)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--malloc-arena-max", type=int, default=2, help="the server's MALLOC_ARENA_MAX; 0 = unset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default bench/results/soak_<date>.json")
    args = p.parse_args(argv)
    date = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"soak_{date}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, server_cmd = start_server(args, port, Path(tempfile.gettempdir()) / f"nextn_soak_{port}.log")
    try:
        soak, measured = asyncio.run(run(args, f"http://127.0.0.1:{port}", proc.pid))
    finally:
        proc.terminate()
        proc.wait(30)
    lat = sorted(soak.latencies)
    result = {
        "command": shlex.join(["python", "bench/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "server_command": shlex.join(["python", *server_cmd[1:]]),
        "server_env": server_env(args),
        "date": date,
        "clients": args.clients,
        "duration_s": measured["duration_s"],
        "requests": sum(soak.kinds.values()),
        "errors_5xx": len(soak.errors_5xx),
        "hangs": soak.hangs,
        "transport_errors": len(soak.transport_errors),
        "rss_mb_after_warmup": measured["rss_mb_after_warmup"],
        "rss_mb_end": measured["rss_mb_end"],
        "p99_latency_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
        "p50_latency_s": round(statistics.median(lat), 3) if lat else None,
        "health_after": measured["health_after"],
        "server_exit_code": proc.returncode,
        "requests_by_kind": dict(sorted(soak.kinds.items())),
        "requests_by_status": {str(k): v for k, v in sorted(soak.statuses.items())},
        "first_5xx": soak.errors_5xx[:5],
        "first_transport_errors": soak.transport_errors[:5],
        "rss_mb_series": measured["rss_mb_series"],
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    held = (
        result["errors_5xx"] == 0
        and result["hangs"] == 0
        and result["transport_errors"] == 0
        and result["rss_mb_end"] <= 1.25 * result["rss_mb_after_warmup"]
    )
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mb_series"}, indent=2))
    print(f"soak: {'held' if held else 'FAILED'}; wrote {out}")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
