"""Issue 46's must-shows, measured against `nextn serve` on the bundled model, a fresh server each:
the probes of a hostile client, at the issue's full sizes (tests/ runs them bounded), and what a
grammar check costs in a worker process against a thread.

python bench/hostile_probes.py [--out bench/results/hostile_cpu.json] [--only NAME ...]

Prints one line of figures a probe and writes them all as JSON (command, figures, machine). RSS is the
server's process tree (the API process, the engine core, the grammar compile workers), sampled
every 50 ms. The schemathesis run is separate (its command is in the JSON when --schemathesis gives
its summary file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nextn.config import DEFAULT_MODEL_DIR  # noqa: E402

USER = {"role": "user", "content": "Pick one."}
NORMAL = {"messages": [USER], "max_tokens": 8, "temperature": 0.0, "guided_choice": ["red", "green"]}


class Serve:
    """`nextn serve` on the bundled model in a child process (its descriptor limit `fds`), its log
    in a file, its process tree's RSS sampled while `sampling`."""

    def __init__(self, fds: int | None = None, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(suffix=".log")[1])

        def limit() -> None:
            if fds is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (fds, fds))

        cmd = [sys.executable, "-m", "nextn.cli", "serve", str(DEFAULT_MODEL_DIR), "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log.open("w"), cwd=ROOT,
                                     preexec_fn=limit)  # fmt: skip
        deadline = time.monotonic() + 300
        while not self._up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)
        self.peak, self.sampling = 0, False

    def _up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def rss_mb(self) -> float:
        """The RSS of the server and every process under it."""
        pids, total, todo = set(), 0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            pids.add(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (FileNotFoundError, ProcessLookupError):
                pass
        return total / 2**20

    def sample(self):
        self.sampling, self.peak = True, self.rss_mb()

        def run() -> None:
            while self.sampling:
                self.peak = max(self.peak, self.rss_mb())
                time.sleep(0.05)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def stop(self) -> dict:
        self.proc.terminate()
        self.proc.wait(60)
        return {"log_bytes": self.log.stat().st_size, "exit_code": self.proc.returncode}


def normal_ok(http: httpx.Client) -> bool:
    r = http.post("/v1/chat/completions", json=NORMAL)
    return r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("red", "green")


def ref_chain(hops: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(hops)}
    return {"type": "object", "$ref": "#/$defs/d0", "$defs": {**defs, f"d{hops}": {"type": "object"}}}


def probe_ref_chain() -> dict:
    chain = ref_chain(5000)
    bodies = {
        "guided_json": {"guided_json": chain},
        "response_format": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": chain}}},
        "forced_tool_call": {"tools": [{"type": "function", "function": {"name": "f", "parameters": chain}}],
                             "tool_choice": "required"},
    }  # fmt: skip
    out = {"hops": 5000, "schema_bytes": len(json.dumps(chain))}
    for name, body in bodies.items():
        srv = Serve()
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            t = time.perf_counter()
            r = http.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 8, **body})
            out[name] = {"status": r.status_code, "param": r.json().get("error", {}).get("param"),
                         "message": r.json().get("error", {}).get("message"),
                         "seconds": round(time.perf_counter() - t, 3), "next_request_ok": normal_ok(http)}  # fmt: skip
        out[name].update(srv.stop())
    return out


def nested_anyof(levels: int, width: int = 9) -> dict:
    defs = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"} for _ in range(width)]} for i in range(levels)}
    defs[f"a{levels}"] = {"type": "integer"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "$defs": defs}


def probe_anyof_echo() -> dict:
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    body = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": call}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": nested_anyof(8)}}],
            "echo": True, "max_tokens": 1, "temperature": 0.0}  # fmt: skip
    srv = Serve()
    worst, done = 0.0, threading.Event()

    def health() -> None:
        nonlocal worst
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                t = time.perf_counter()
                c.get(f"{srv.url}/health")
                worst = max(worst, time.perf_counter() - t)
                time.sleep(0.05)

    prober = threading.Thread(target=health)
    prober.start()
    t = time.perf_counter()
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300)
    took = time.perf_counter() - t
    time.sleep(0.5)
    done.set()
    prober.join()
    calls = r.json()["choices"][0]["message"].get("tool_calls") if r.status_code == 200 else None
    return {"request_bytes": len(json.dumps(body)), "status": r.status_code, "seconds": round(took, 3),
            "health_worst_seconds": round(worst, 3), "tool_calls": calls, **srv.stop()}  # fmt: skip


def probe_idle_connections(n: int = 2000, fds: int = 1024, hold_s: float = 15.0) -> dict:
    """n connections (half send nothing, half a request line a byte a second) against `fds`
    descriptors; a new client's normal request meanwhile."""
    srv = Serve(fds)
    conns, stop = [], threading.Event()
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", srv.port))
        conns.append(s)
    line = b"GET /health HTTP/1.1\r\nhost: x\r\n"

    def trickle() -> None:  # the odd ones: a byte a second each
        k = 0
        while not stop.is_set():
            for s in conns[1::2]:
                try:
                    s.send(line[k % len(line) : k % len(line) + 1])
                except OSError:
                    pass
            k += 1
            stop.wait(1.0)

    t = threading.Thread(target=trickle)
    t.start()
    time.sleep(2.0)
    answers = []
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            with httpx.Client(base_url=srv.url, timeout=30) as http:
                ok = normal_ok(http)
        except httpx.TransportError:
            ok = False
        answers.append((ok, time.perf_counter() - start))
        time.sleep(1.0)
    stop.set()
    t.join()
    for s in conns:
        s.close()
    return {"connections": n, "fd_limit": fds, "hold_seconds": hold_s, "new_client_requests": len(answers),
            "answered": sum(ok for ok, _ in answers), "worst_seconds": round(max(s for _, s in answers), 3),
            **srv.stop()}  # fmt: skip


def probe_literals() -> dict:
    srv = Serve()
    out = {}
    with httpx.Client(base_url=srv.url, timeout=60, limits=httpx.Limits(max_connections=1)) as http:
        lits = ["</think>", "\u2126", "a\u0301"]
        for name, extra in {"guided_choice": {"guided_choice": lits},
                            **{f"const {x!r}": {"guided_json": {"const": x}} for x in lits}}.items():  # fmt: skip
            r = http.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 8, **extra})
            error = r.json().get("error", {})
            closed = r.headers.get("connection") == "close"
            out[name] = {"status": r.status_code, "message": error.get("message"), "connection_closed": closed,
                         "next_request_ok": normal_ok(http)}  # fmt: skip
    return {**out, **srv.stop()}


def probe_regex_amplification(n: int = 32) -> dict:
    srv = Serve()
    base = srv.rss_mb()
    sampler = srv.sample()
    body = {"messages": [USER], "max_tokens": 8, "guided_regex": "(?:a{1000}){1000}"}
    t = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        rs = list(pool.map(lambda _: httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120), range(n)))
    took = time.perf_counter() - t
    time.sleep(1.0)
    srv.sampling = False
    sampler.join()
    after = srv.rss_mb()
    return {"requests": n, "statuses": sorted({r.status_code for r in rs}), "seconds": round(took, 3),
            "message": rs[0].json().get("error", {}).get("message"), "rss_base_mb": round(base),
            "rss_peak_over_base_mb": round(srv.peak - base), "rss_after_over_base_mb": round(after - base),
            **srv.stop()}  # fmt: skip


def probe_compile_cost(n: int = 40) -> dict:
    """The same checks on the engine's big-stack threads and in the worker process, per check."""
    from nextn.grammar import sandbox
    from nextn.grammar.compile import _compile
    from nextn.tokenizer import Tokenizer

    tok = Tokenizer(DEFAULT_MODEL_DIR)
    box = sandbox.CompileSandbox(tok, workers=1)
    t = time.perf_counter()
    box.check({"regex": "[a-z]+"})
    start_s = time.perf_counter() - t
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]},
              "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city"]}  # fmt: skip
    kinds = {"regex": lambda i: ("regex", f"x{i}[a-z]+ [0-9]{{2}}"),
             "json_schema": lambda i: ("json", {**schema, "title": f"t{i}"})}  # fmt: skip
    out = {"worker_start_seconds": round(start_s, 3)}
    for name, make in kinds.items():
        for where, fn in (("thread", lambda k, v: _compile(k, v, tok)), ("worker", lambda k, v: box.check({k: v}))):
            ts = []
            for i in range(n):  # distinct each time: no cache
                k, v = make(i if where == "thread" else i + n)
                t = time.perf_counter()
                fn(k, v)
                ts.append(time.perf_counter() - t)
            out[f"{name}_{where}_ms_median"] = round(sorted(ts)[n // 2] * 1e3, 3)
    costly = {"regex": "".join(f"(?:(?:q{i}){{100}}){{100}}" for i in range(20))}
    t = time.perf_counter()
    try:
        box.check(costly)
        verdict = "compiled"
    except ValueError as e:
        verdict = str(e)
    took = round(time.perf_counter() - t, 3)
    out["costly_regex"] = {"bytes": len(costly["regex"]), "seconds": took, "verdict": verdict}
    box.close()
    return out


PROBES = {
    "ref_chain": probe_ref_chain,
    "anyof_echo": probe_anyof_echo,
    "idle_connections": probe_idle_connections,
    "literals": probe_literals,
    "regex_amplification": probe_regex_amplification,
    "compile_cost": probe_compile_cost,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", nargs="*", choices=list(PROBES))
    ap.add_argument("--schemathesis", type=Path, help="a JSON summary of a schemathesis run to include")
    args = ap.parse_args()
    figures = {}
    for name in args.only or PROBES:
        figures[name] = PROBES[name]()
        print(name, json.dumps(figures[name]), flush=True)
    if args.schemathesis:
        figures["schemathesis"] = json.loads(args.schemathesis.read_text())
    if args.out:
        old = json.loads(args.out.read_text())["figures"] if args.out.exists() else {}
        result = {
            "command": "python bench/hostile_probes.py " + " ".join(sys.argv[1:]),
            "figures": {**old, **figures},
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "python": platform.python_version(),
                "note": "shared with other jobs, niced",
            },  # fmt: skip
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
