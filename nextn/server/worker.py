"""The bridge between the event loop and the engine thread, the only thread that touches the
engine. Jobs come in through a locked inbox; admission counts every open job (queued or running)
against the engine's slots plus max_queue, so a job is refused (at once) only when the engine is
really full. The engine thread hands jobs to the engine (its scheduler decides who runs, in which
slot, for how many rounds) and calls `engine.step()` while there is work, feeding each event to its
job. Draining (shutdown) refuses new jobs and ends the open ones at a deadline; if the engine
thread dies, every open job and every later one fails at once with `Unavailable`.

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


class Unavailable(Exception):
    """The server takes no more work: it is shutting down, or the engine thread died (a 503)."""


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
        self.capacity = llm.config.max_num_seqs + cfg.max_queue  # open jobs: running plus queued
        self._inbox: deque[Job] = deque()
        self._cond = threading.Condition()  # guards _inbox, _num_open, _closed, _deadline
        self._num_open = 0  # jobs submitted and not yet over
        self._closed: str | None = None  # why no job is taken any more (stopped, or the engine died)
        self._deadline: float | None = None  # draining: open jobs are ended at this time.monotonic()
        self._jobs: dict[int, Job] = {}  # request id -> job (engine thread only)
        self._thread = threading.Thread(target=self._run, name="nextn-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._closed is None

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def start(self) -> None:
        self._thread.start()

    def drain(self, timeout: float) -> None:
        """Take no new job; end the open ones that are not over in `timeout` seconds (shutdown)."""
        with self._cond:
            if self._deadline is None:
                self._deadline = time.monotonic() + timeout
                log.info("draining: %d open requests get %.0f s", self._num_open, timeout)
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = self._closed or "the server is shutting down"
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_open(self) -> int:
        """Jobs submitted and not yet over: what admission counts."""
        return self._num_open

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.engine.scheduler.waiting)

    def submit(self, job: Job) -> None:
        """Queue a job or refuse it at once (never block the caller): Unavailable while draining or
        once the engine is gone; QueueFull when every slot is taken and max_queue more wait."""
        with self._cond:
            if self._closed is not None or self._deadline is not None:
                raise Unavailable(self._closed or "the server is shutting down")
            if self._num_open >= self.capacity:
                raise QueueFull(f"{self._num_open} requests are running or waiting")
            self._num_open += 1
            self._inbox.append(job)
            self._cond.notify()

    # --- the engine thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._closed is None and not self._inbox and not self.engine.has_work:
                        self._cond.wait()
                    if self._closed is not None:
                        break
                    jobs = list(self._inbox)
                    self._inbox.clear()
                    past_deadline = self._deadline is not None and time.monotonic() >= self._deadline
                for job in jobs:
                    self._add(job)
                self._cancel_dropped()
                if past_deadline:
                    self._end_all(Unavailable("the server is shutting down"))
                    continue
                for req, ev in self.engine.step():
                    self._deliver(self._jobs[req.request_id], ev)
                self._snapshot_sessions()
        except Exception:
            log.critical("the engine thread died; the server answers 503 from now on", exc_info=True)
            with self._cond:
                self._closed = "the engine stopped after an internal error"
        finally:
            with self._cond:
                leftover = list(self._jobs.values()) + list(self._inbox)
                self._inbox.clear()
                self._jobs.clear()
                self._num_open = 0
            for job in leftover:
                job.put(Unavailable(self._closed))

    def _end_all(self, error: Exception) -> None:
        for job in list(self._jobs.values()):
            self.engine.abort(job.req)
            self._close(job, ended_early=True, aborted=True)
            job.put(error)

    def _close(self, job: Job, ended_early: bool = False, aborted: bool = False) -> None:
        """The job is over: it leaves the open count (and its metrics are recorded by the caller)."""
        if job.req is not None:
            self._jobs.pop(job.req.request_id, None)
        with self._cond:
            self._num_open -= 1
        if ended_early:
            self.metrics.ended_early(aborted, len(job.prompt_ids), job.num_generated)
            self._snapshot_sessions()

    def _add(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._close(job, ended_early=True, aborted=True)
            return
        try:
            job.req = self.engine.add(job.prompt_ids, job.params, use_sessions=True, checkpoint_at=job.checkpoint_at)
        except Exception as e:  # a request the HTTP side did not foresee: the job fails alone
            log.error("engine refused a request", exc_info=True)
            self._close(job, ended_early=True)
            job.put(e)
            return
        self._jobs[job.req.request_id] = job

    def _cancel_dropped(self) -> None:
        """Clients gone: stop their work between rounds (the session state is kept)."""
        for job in list(self._jobs.values()):
            if job.cancelled.is_set():
                self.engine.abort(job.req)
                self._close(job, ended_early=True, aborted=True)

    def _deliver(self, job: Job, ev: StreamEvent | BaseException) -> None:
        """Metrics first, then the event: a client that reads /metrics after its answer sees it counted."""
        if isinstance(ev, BaseException):
            log.error("engine failure: %r", ev)
            self._close(job, ended_early=True)
            job.put(ev)
            return
        self._timing(job, ev)
        if ev.output is not None:
            self.metrics.finished(ev.output, time.perf_counter() - job.arrived)
            self._close(job)
            self._snapshot_sessions()
        job.put(ev)

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

    def _snapshot_sessions(self) -> None:
        """Copy the scheduler's session numbers for /metrics (they are this thread's)."""
        sched = self.engine.scheduler
        self.metrics.set_batch_sizes(dict(self.engine.batch_sizes))
        self.metrics.set_sessions(
            SessionSnapshot(
                dataclasses.replace(sched.counters),
                len(sched.sessions),
                # a kept conversation holds its slot and the graphs captured for it
                len(sched.sessions) * self.engine.pool.slot_nbytes + self.engine.runner.graph_memory.of(sched.sessions),
            )
        )
