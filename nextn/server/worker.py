"""The engine thread: the only thread that touches the LLM. Admitted requests wait in a bounded
FIFO; up to `max_running` of them are interleaved round-robin, `burst_rounds` speculative rounds
per turn, so concurrent clients share the engine fairly and never see each other's state.

A `Job` is the handle the HTTP side holds: it is fed from this thread (through the event loop's
call_soon_threadsafe) and cancelled from the HTTP side (a flag this thread reads between rounds;
closing an engine generator between rounds keeps its session state). Does not know HTTP or JSON.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Generator

from nextn.config import ServeConfig
from nextn.core import SamplingParams
from nextn.engine.llm import LLM, StreamEvent
from nextn.server.metrics import Metrics, SessionSnapshot

log = logging.getLogger("nextn.server")


class QueueFull(Exception):
    pass


class ClientGone(Exception):
    pass


class Job:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
                 checkpoint_at: int | None = None):
        self.prompt_ids = prompt_ids
        self.params = params
        self.checkpoint_at = checkpoint_at  # where the session's rewind checkpoint goes (None: prompt end)
        self.loop = loop
        self.arrived = time.perf_counter()
        self.cancelled = threading.Event()
        self._items: deque[StreamEvent | BaseException] = deque()
        self._ready = asyncio.Event()  # belongs to `loop`; set only there

    # --- engine thread side
    def put(self, item: StreamEvent | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self.cancelled.set()

    def _put(self, item) -> None:
        self._items.append(item)
        self._ready.set()

    # --- HTTP side
    def cancel(self) -> None:
        self.cancelled.set()

    async def events(self, poll_s: float = 1.0, disconnected=None) -> AsyncIterator[StreamEvent]:
        """The job's events until the one carrying the output. `disconnected`: an async callable
        polled every `poll_s`; when it says so, raise ClientGone."""
        last_poll = time.monotonic()
        while True:
            if disconnected is not None and time.monotonic() - last_poll >= poll_s:
                last_poll = time.monotonic()
                if await disconnected():
                    raise ClientGone()
            if not self._items:
                try:
                    # waiting on the Event, not a Queue: a timeout here can never lose an item
                    await asyncio.wait_for(self._ready.wait(), poll_s)
                except TimeoutError:
                    continue
            self._ready.clear()
            while self._items:
                item = self._items.popleft()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.output is not None:
                    return


class _Running:
    """A job with its engine generator, and the timing of its tokens."""

    def __init__(self, job: Job, gen: Generator[StreamEvent, None, None]):
        self.job, self.gen = job, gen
        self.last_token_at: float | None = None
        self.num_generated = 0


class EngineWorker:
    def __init__(self, llm: LLM, cfg: ServeConfig, metrics: Metrics):
        self.llm, self.cfg, self.metrics = llm, cfg, metrics
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.num_running = 0  # written by the engine thread only
        self._thread = threading.Thread(target=self._run, name="nextn-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        """Queue a job or raise QueueFull at once (never block the caller)."""
        with self._cond:
            if len(self._waiting) >= self.cfg.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(job)
            self._cond.notify()

    # --- the engine thread

    def _run(self) -> None:
        running: list[_Running] = []
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._waiting and not running:
                        self._cond.wait()
                    if self._stopping:
                        break
                    admitted = []
                    while self._waiting and len(running) + len(admitted) < self.cfg.max_running:
                        admitted.append(self._waiting.popleft())
                running.extend(r for job in admitted if (r := self._admit(job)) is not None)
                self.num_running = len(running)
                running = [r for r in running if self._turn(r)]
                self.num_running = len(running)
        finally:
            for r in running:
                r.gen.close()
                r.job.put(RuntimeError("the server is shutting down"))
            with self._cond:
                for job in self._waiting:
                    job.put(RuntimeError("the server is shutting down"))
                self._waiting.clear()

    def _admit(self, job: Job) -> _Running | None:
        if job.cancelled.is_set():
            self.metrics.ended_early(True, len(job.prompt_ids), 0)
            return None
        try:
            gen = self.llm.stream(job.prompt_ids, job.params, use_sessions=True, checkpoint_at=job.checkpoint_at)
        except Exception as e:  # a RequestError the HTTP side did not foresee: the job fails alone
            job.put(e)
            self.metrics.ended_early(False, len(job.prompt_ids), 0)
            return None
        return _Running(job, gen)

    def _turn(self, r: _Running) -> bool:
        """Run up to burst_rounds rounds of one job; False once it is over."""
        for _ in range(self.cfg.burst_rounds):
            if r.job.cancelled.is_set():  # client gone: rounds are atomic, the session state is kept
                r.gen.close()
                self.metrics.ended_early(True, len(r.job.prompt_ids), r.num_generated)
                self._after_request()
                return False
            try:
                ev = next(r.gen)
            except Exception as e:
                log.exception("engine failure")
                r.job.put(e)
                self.metrics.ended_early(False, len(r.job.prompt_ids), r.num_generated)
                self._after_request()
                return False
            self._timing(r, ev)
            r.job.put(ev)
            if ev.output is not None:
                self.metrics.finished(ev.output, time.perf_counter() - r.job.arrived)
                self._after_request()
                return False
        return True

    def _timing(self, r: _Running, ev: StreamEvent) -> None:
        if not ev.token_ids:
            return
        t = time.perf_counter()
        if r.last_token_at is None:
            self.metrics.observe_first_token(t - r.job.arrived)
            if len(ev.token_ids) > 1:
                self.metrics.observe_tokens(0.0, len(ev.token_ids) - 1)
        else:
            self.metrics.observe_tokens(t - r.last_token_at, len(ev.token_ids))
        r.last_token_at = t
        r.num_generated += len(ev.token_ids)

    def _after_request(self) -> None:
        """Copy the session store's numbers for /metrics (the store is this thread's)."""
        store = self.llm.sessions
        self.metrics.set_sessions(SessionSnapshot(dataclasses.replace(store.counters), len(store), store.nbytes))
