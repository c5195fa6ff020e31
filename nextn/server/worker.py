"""The bridge between the event loop and the engine thread, the only thread that touches the
engine. Jobs come in through a locked inbox (a full queue is refused at once); the engine thread
hands them to the engine (its scheduler decides who runs, in which slot, for how many rounds) and
calls `engine.step()` while there is work, feeding each event to its job.

A `Job` is the handle the HTTP side holds: it is fed from the engine thread (through the event
loop's call_soon_threadsafe) and cancelled from the HTTP side (a flag the engine thread reads
between steps; aborting between rounds keeps the session state). Does not know HTTP or JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

from nextn.config import ServeConfig
from nextn.core import SamplingParams
from nextn.engine.engine import StreamEvent
from nextn.engine.llm import LLM
from nextn.engine.scheduler import QueueFull, Request
from nextn.server.metrics import Metrics, SessionSnapshot

log = logging.getLogger("nextn.server")


class ClientGone(Exception):
    pass


class Job:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        checkpoint_at: int | None = None,
    ):
        self.prompt_ids = prompt_ids
        self.params = params
        self.checkpoint_at = checkpoint_at  # where the session's rewind checkpoint goes (None: prompt end)
        self.loop = loop
        self.arrived = time.perf_counter()
        self.cancelled = threading.Event()
        self.req: Request | None = None  # the engine's request, once the engine thread took the job
        self.last_token_at: float | None = None
        self.num_generated = 0
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


class EngineWorker:
    def __init__(self, llm: LLM, cfg: ServeConfig, metrics: Metrics):
        self.llm, self.engine, self.cfg, self.metrics = llm, llm.engine, cfg, metrics
        self._inbox: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._jobs: dict[int, Job] = {}  # request id -> job (engine thread only)
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
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.engine.scheduler.waiting)

    def submit(self, job: Job) -> None:
        """Queue a job or raise QueueFull at once (never block the caller): more jobs than slots
        the engine could give them may wait, up to max_queue."""
        sched = self.engine.scheduler
        with self._cond:
            takeable = len(sched.free) + len(sched.sessions)
            if self.num_waiting - takeable >= self.cfg.max_queue:
                raise QueueFull(f"{self.num_waiting} requests are already waiting")
            self._inbox.append(job)
            self._cond.notify()

    # --- the engine thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._inbox and not self.engine.has_work:
                        self._cond.wait()
                    if self._stopping:
                        break
                    jobs = list(self._inbox)
                    self._inbox.clear()
                for job in jobs:
                    self._add(job)
                self._cancel_dropped()
                for req, ev in self.engine.step():
                    self._deliver(self._jobs[req.request_id], ev)
        finally:
            with self._cond:
                leftover = list(self._jobs.values()) + list(self._inbox)
                self._inbox.clear()
            for job in leftover:
                job.put(RuntimeError("the server is shutting down"))

    def _add(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.metrics.ended_early(True, len(job.prompt_ids), 0)
            return
        try:
            job.req = self.engine.add(job.prompt_ids, job.params, use_sessions=True, checkpoint_at=job.checkpoint_at)
        except Exception as e:  # a request the HTTP side did not foresee: the job fails alone
            job.put(e)
            self.metrics.ended_early(False, len(job.prompt_ids), 0)
            return
        self._jobs[job.req.request_id] = job

    def _cancel_dropped(self) -> None:
        """Clients gone: stop their work between rounds (the session state is kept)."""
        for rid, job in list(self._jobs.items()):
            if job.cancelled.is_set():
                self.engine.abort(job.req)
                del self._jobs[rid]
                self.metrics.ended_early(True, len(job.prompt_ids), job.num_generated)
                self._after_request()

    def _deliver(self, job: Job, ev: StreamEvent | BaseException) -> None:
        if isinstance(ev, BaseException):
            log.error("engine failure: %r", ev)
            del self._jobs[job.req.request_id]
            job.put(ev)
            self.metrics.ended_early(False, len(job.prompt_ids), job.num_generated)
            self._after_request()
            return
        self._timing(job, ev)
        job.put(ev)
        if ev.output is not None:
            del self._jobs[job.req.request_id]
            self.metrics.finished(ev.output, time.perf_counter() - job.arrived)
            self._after_request()

    def _timing(self, job: Job, ev: StreamEvent) -> None:
        if not ev.token_ids:
            return
        t = time.perf_counter()
        if job.last_token_at is None:
            self.metrics.observe_first_token(t - job.arrived)
            if len(ev.token_ids) > 1:
                self.metrics.observe_tokens(0.0, len(ev.token_ids) - 1)
        else:
            self.metrics.observe_tokens(t - job.last_token_at, len(ev.token_ids))
        job.last_token_at = t
        job.num_generated += len(ev.token_ids)

    def _after_request(self) -> None:
        """Copy the scheduler's session numbers for /metrics (they are this thread's)."""
        sched = self.engine.scheduler
        self.metrics.set_sessions(
            SessionSnapshot(
                dataclasses.replace(sched.counters),
                len(sched.sessions),
                len(sched.sessions) * self.engine.pool.slot_nbytes,
            )
        )
