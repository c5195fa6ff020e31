"""The server's check of a request's grammar: it compiles in a worker process with a time limit and
a memory limit, so a compile that crashes, runs away or fills memory costs one worker (killed and
started again) and the request a 400 naming the limit, never the server or its engine.

Why a process and not the big-stack threads the engine compiles on (measured on this CPU, a shared
2-core machine; bench/hostile_probes.py): a thread can be neither stopped nor held to a memory
budget, and a crash inside llguidance (a C-stack overflow, an abort on a failed allocation) ends the
whole process. nextn.grammar.limits refuses the shapes known to be costly before any compile, but a
grammar can be costly within them: 20 counted repetitions `(?:q{100}){100}` in a row, 423 bytes,
take 1-2.5 s and +250 MB to compile, and each engine matcher of it 2.5 s and 130 MB more. A worker
adds about 0.3 ms to a check (a pipe round trip and JSON; the compile itself is the same), and
costs 0.15 s and ~30 MB to start (nextn.grammar.build imports llguidance alone).

The worker runs exactly the engine's llguidance work (nextn.grammar.build's `definition` and
`validate`, on a BIG_STACK thread), so a grammar that passed here costs the engine's compile no
more than it cost the worker: the limits bound the engine's stall on a new grammar too. They are
set above the largest legitimate grammars nextn.grammar.limits lets through (a 200 KB schema of
3,000 patterned properties, an anyOf of 2,000 objects, 10,000 choices: 0.3-1.2 s here, within
256 MB), and below the costly regex above (refused on memory). Verdicts are kept per (key, JSON
text), refusals included, so a repeated grammar is not compiled again. Knows nothing of HTTP: the
caller names the field.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict

from nextn.grammar import build
from nextn.grammar.compile import added_tokens, check, entry
from nextn.tokenizer import Tokenizer

log = logging.getLogger("nextn.grammar")

COMPILE_WORKERS = 2  # compiles checked at once (more wait for a free worker)
COMPILE_TIMEOUT_S = 2.0  # a compile's wall time, past which its worker is killed
COMPILE_MEMORY = 256 << 20  # bytes a worker may map beyond its size when ready (RLIMIT_AS)
START_TIMEOUT_S = 60.0  # a worker's start (llguidance's tokenizer: 0.05 s for the bundled one)
VERDICTS = 1024  # (key, text) -> refusal or pass, kept

_SANDBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def check_grammar(structured_outputs: dict, tokenizer: Tokenizer) -> None:
    """A ValueError naming the limit or the reason unless `structured_outputs` compiles for
    `tokenizer` within nextn.grammar.limits, COMPILE_TIMEOUT_S and COMPILE_MEMORY."""
    with _LOCK:
        if tokenizer not in _SANDBOXES:
            sandbox = _SANDBOXES[tokenizer] = CompileSandbox(tokenizer)
            weakref.finalize(tokenizer, sandbox.close)
        sandbox = _SANDBOXES[tokenizer]
    sandbox.check(structured_outputs)


class CompileSandbox:
    """COMPILE_WORKERS worker processes for one tokenizer, each started when first needed."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        workers: int = COMPILE_WORKERS,
        timeout: float = COMPILE_TIMEOUT_S,
        memory: int = COMPILE_MEMORY,
    ):
        self.hello = {"tokenizer": tokenizer.to_str(), "eos": tokenizer.eos_token_id, "memory": memory}
        self.added = added_tokens(tokenizer)
        self.timeout, self.memory = timeout, memory
        self.idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        self.workers: list[_Worker] = []  # every worker started (to close them)
        for _ in range(workers):
            self.idle.put(None)
        self.verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()
        self.lock = threading.Lock()

    def check(self, structured_outputs: dict) -> None:
        key, value = entry(structured_outputs)
        try:
            text = json.dumps(value)
        except (TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"structured_outputs {key!r} is not JSON ({e})") from None
        with self.lock:
            known = (key, text) in self.verdicts
            error = self.verdicts.get((key, text))
        if not known:
            error = self._verdict(key, value)
            with self.lock:
                self.verdicts[key, text] = error
                while len(self.verdicts) > VERDICTS:
                    self.verdicts.popitem(last=False)
        if error is not None:
            raise ValueError(error)

    def _verdict(self, key: str, value) -> str | None:
        """None when it compiles; else why not."""
        try:
            check(key, value, self.added)  # nextn.grammar.limits, here: linear and pure Python
        except ValueError as e:
            return str(e)
        worker = self.idle.get()  # waits while every worker compiles
        try:
            if worker is None:
                worker = _Worker(self.hello)
                self.workers.append(worker)
            reply = worker.ask({"key": key, "value": value}, self.timeout)
        except BaseException:
            self.idle.put(worker)
            raise
        if reply is not None and reply.get("error") != "memory":
            self.idle.put(worker)
            return reply.get("error")
        # timed out, out of memory or crashed: this worker is killed, a new one starts next time
        why = "ran out of memory" if reply is not None else worker.stop()
        worker.stop()
        self.workers.remove(worker)
        self.idle.put(None)
        log.warning("grammar compile worker %s (a %s constraint); another starts on the next check", why, key)
        if why == "timed out":
            return f"structured_outputs {key!r}: compiling it took longer than COMPILE_TIMEOUT_S={self.timeout:g} s"
        return (
            f"structured_outputs {key!r}: compiling it needed more than COMPILE_MEMORY={self.memory >> 20} MB "
            f"or crashed the compiler (its worker {why})"
        )

    def close(self) -> None:
        for worker in list(self.workers):
            worker.stop()


class _Worker:
    """One `python -P nextn/grammar/build.py` process: a message in, a message out (build.send)."""

    def __init__(self, hello: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-P", build.__file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # a crash is logged once, here, not as the compiler's dump
        )
        self.pending = b""
        ready = self.ask(hello, START_TIMEOUT_S)
        if ready is None or "ready" not in ready:
            raise RuntimeError(f"the grammar compile worker did not start ({self.stop()})")

    def ask(self, message: dict, timeout: float) -> dict | None:
        """The worker's reply to `message`; None when it dies or has not answered within `timeout`."""
        try:
            build.send(self.proc.stdin, message)
        except OSError:  # (a broken pipe: it has died)
            return self._died()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()  # read raw (select sees the pipe, not a Python buffer)
        while True:
            if len(self.pending) >= build.HEADER.size:
                (n,) = build.HEADER.unpack_from(self.pending)
                if len(self.pending) >= build.HEADER.size + n:
                    data = self.pending[build.HEADER.size : build.HEADER.size + n]
                    self.pending = self.pending[build.HEADER.size + n :]
                    return json.loads(data)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                if time.monotonic() >= deadline:
                    return None
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return self._died()
            self.pending += chunk

    def _died(self) -> None:
        """The pipe closed: the worker is dying; reap it (stop() then says of what)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(START_TIMEOUT_S)

    def stop(self) -> str:
        """Kill the worker if it is alive (then it "timed out"), else say how it died."""
        code = self.proc.poll()
        if code is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        if code is None:
            return "timed out"
        return f"died of {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
