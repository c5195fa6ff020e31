"""The API side of the engine core: jobs, admission, deliveries, metrics, drain and the core's death.

The engine core (nextn.engine.core: the loop that owns the engine) runs in its own process under
`nextn serve` (nextn.server.core_client.CoreProcess) or on a thread of this process (`ThreadCore`,
for an `LLM` built here: tests, embedding). Either way the `EngineWorker` talks to it the same
way: it sends AddRequest / AbortRequest messages, and the core calls `on_outputs` (one StepOutputs
per loop turn: each request's events and a stats snapshot) and `on_dead` from its own thread.

The core sends token ids; each job's text, stop strings and final output are made here, on the
thread that receives the core's messages (nextn.server.outputs.JobOutput); a stop string found
ends the job's request in the core (an AbortRequest with the tokens kept).

Admission counts every open job (sent and not yet over, queued or running) against the engine's
slots plus max_queue, so a job is refused (at once) only when the engine is really full. A job is
over when its last event, its error or the acknowledgement of its abort arrives. Draining
(shutdown) refuses new jobs and ends the open ones at a deadline; once the core is gone, every open
job and every later one fails at once with `Unavailable` naming the cause.

A `Job` is the handle the HTTP side holds: fed on its event loop (a step's events reach each loop
in one call_soon_threadsafe), cancelled from the HTTP side (an abort sent to the core; aborting
between rounds keeps the session state). Does not know HTTP or JSON.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from nextn.core import RequestError, SamplingParams
from nextn.engine.core import (
    AbortRequest,
    AddRequest,
    CoreStats,
    EngineCore,
    Shutdown,
    StepOutputs,
    run_loop,
)
from nextn.engine.engine import StreamEvent
from nextn.engine.llm import LLM
from nextn.engine.scheduler import QueueFull
from nextn.server.metrics import Metrics, SessionSnapshot
from nextn.server.model import ServedModel
from nextn.server.outputs import JobOutput

log = logging.getLogger("nextn.server")


class ClientGone(Exception):
    pass


class Unavailable(Exception):
    """The server takes no more work: it is shutting down, or the engine core is gone (a 503)."""


class EngineError(RuntimeError):
    """The engine failed on a request (its text is logged, never sent: a 500)."""


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
        self.request_id: int | None = None  # the worker's, once submitted
        self.worker: EngineWorker | None = None
        self.cancelled = False
        self.last_token_at: float | None = None
        self.num_generated = 0
        self.output: JobOutput | None = None  # its text and stop strings, once submitted
        self._items: deque[StreamEvent | BaseException] = deque()
        self._ready = asyncio.Event()  # belongs to `loop`; set only there

    def put(self, item: StreamEvent | BaseException) -> None:
        """On the job's event loop (the worker posts here)."""
        self._items.append(item)
        self._ready.set()

    def cancel(self) -> None:
        """Stop the job's work (a no-op once it is over)."""
        if not self.cancelled:
            self.cancelled = True
            if self.worker is not None:
                self.worker.abort(self)

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
    """The jobs of one engine core; `core` is a ThreadCore or a CoreProcess (both: `model`,
    `start(sink)`, `send(msg)`, `alive`, `stop()`, `exit_on_death`)."""

    def __init__(self, core, capacity: int, metrics: Metrics):
        self.core, self.capacity, self.metrics = core, capacity, metrics
        self._lock = threading.Lock()  # guards _jobs, _closed, _timer; sends to the core happen under it (ordered)
        self._jobs: dict[int, Job] = {}  # open jobs by request id
        self._ids = itertools.count()
        self._closed: str | None = None  # why no job is taken any more (stopped, or the core died)
        self._timer: threading.Timer | None = None  # draining: ends the open jobs at the deadline
        self._stats = CoreStats()
        self.death: str | None = None  # why the core died, if it did
        self.on_death: Callable[[str], None] | None = None  # called (on the core's thread) when it dies

    @property
    def alive(self) -> bool:
        return self._closed is None and self.core.alive

    @property
    def draining(self) -> bool:
        return self._timer is not None

    @property
    def num_open(self) -> int:
        """Jobs submitted and not yet over: what admission counts."""
        return len(self._jobs)

    @property
    def num_running(self) -> int:
        return self._stats.num_running

    @property
    def num_waiting(self) -> int:
        """Open jobs not running: queued in the engine or on their way to it."""
        return max(0, len(self._jobs) - self._stats.num_running)

    def start(self) -> None:
        self.core.start(self)

    def drain(self, timeout: float) -> None:
        """Take no new job; end the open ones that are not over in `timeout` seconds (shutdown)."""
        with self._lock:
            if self._timer is not None:
                return
            log.info("draining: %d open requests get %.0f s", len(self._jobs), timeout)
            self._timer = threading.Timer(timeout, self._end_all, (Unavailable("the server is shutting down"),))
            self._timer.daemon = True
            self._timer.start()

    def stop(self) -> None:
        with self._lock:
            self._closed = self._closed or "the server is shutting down"
            if self._timer is not None:
                self._timer.cancel()
        self._end_all(Unavailable(self._closed))
        self.core.stop()

    def submit(self, job: Job) -> None:
        """Send a job to the core or refuse it at once (never block the caller): Unavailable while
        draining or once the core is gone; QueueFull when every slot is taken and max_queue more wait."""
        with self._lock:
            if self._closed is not None or self._timer is not None:
                raise Unavailable(self._closed or "the server is shutting down")
            if len(self._jobs) >= self.capacity:
                raise QueueFull(f"{len(self._jobs)} requests are running or waiting")
            job.request_id, job.worker = next(self._ids), self
            job.output = JobOutput(self.core.model.tokenizer, job.params)
            self._jobs[job.request_id] = job
            self.core.send(AddRequest(job.request_id, job.prompt_ids, job.params, job.checkpoint_at, True))

    def abort(self, job: Job) -> None:
        """The client is gone: the core stops the job between rounds (the job is over when it says so)."""
        self._send_if_open(job, AbortRequest(job.request_id))

    def _send_if_open(self, job: Job, msg) -> None:
        with self._lock:
            if job.request_id in self._jobs and self._closed is None:
                self.core.send(msg)

    # --- called by the core, on its thread

    def on_outputs(self, out: StepOutputs) -> None:
        """A loop turn's events. Metrics first, then the events: a client that reads /metrics after
        its answer sees it counted."""
        self._stats = out.stats
        s = out.stats
        self.metrics.set_engine(
            SessionSnapshot(s.sessions, s.num_session_states, s.session_memory_bytes),
            s.batch_sizes,
            s.graph_counts,
            s.time,
        )
        self.metrics.set_prefix(s.prefix, s.prefix_cache_bytes, s.prefill_tokens)
        items: list[tuple[Job, StreamEvent | BaseException]] = []
        for ev in out.events:
            job = self._jobs.get(ev.request_id)
            if job is None:  # ended here already (a drain's deadline, a stop)
                continue
            if ev.aborted:
                self._close(job, ended_early=True, aborted=True)
            elif ev.error is not None:
                self._close(job, ended_early=True)
                items.append((job, RequestError(ev.error) if ev.bad_request else EngineError(ev.error)))
            else:
                try:
                    event, stop_at = job.output.push(ev)
                except Exception as e:  # noqa: BLE001 (its text failed: the job fails alone, as in the engine)
                    log.error("making a request's text failed", exc_info=True)
                    self.abort(job)
                    self._close(job, ended_early=True)
                    items.append((job, EngineError(str(e) or type(e).__name__)))
                    continue
                if stop_at is not None:  # a stop string: the core ends the request there
                    self._send_if_open(job, AbortRequest(job.request_id, stop_at))
                if event is None:
                    continue
                self._timing(job, event)
                if event.output is not None:
                    self.metrics.finished(event.output, time.perf_counter() - job.arrived)
                    self._close(job)
                if not job.cancelled:
                    items.append((job, event))
        _post(items)

    def on_dead(self, reason: str) -> None:
        """The core is gone: every open job and every later one fails with Unavailable(reason)."""
        with self._lock:
            if self._closed is not None:  # stopped on purpose
                return
            self._closed = self.death = reason
        log.critical("%s; the server answers 503 from now on", reason)
        self._end_all(Unavailable(reason), count=False)
        if self.on_death is not None:
            self.on_death(reason)

    # ---

    def _end_all(self, error: Exception, count: bool = True) -> None:
        """End every open job with `error` (the core is told to stop the ones it still runs)."""
        with self._lock:
            jobs = list(self._jobs.values())
            self._jobs.clear()
            if self.core.alive and self._closed is None:
                for job in jobs:
                    self.core.send(AbortRequest(job.request_id))
        if count:
            for job in jobs:
                self.metrics.ended_early(True, len(job.prompt_ids), job.num_generated)
        _post([(job, error) for job in jobs])

    def _close(self, job: Job, ended_early: bool = False, aborted: bool = False) -> None:
        """The job is over: it leaves the open count (its metrics recorded by the caller)."""
        with self._lock:
            self._jobs.pop(job.request_id, None)
        if ended_early:
            self.metrics.ended_early(aborted, len(job.prompt_ids), job.num_generated)

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


def _post(items: list[tuple[Job, StreamEvent | BaseException]]) -> None:
    """Hand items to their jobs on the jobs' event loops: one wake-up per loop, not per job."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for job, item in items:
        by_loop.setdefault(job.loop, []).append((job, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass


def _put_all(batch: list[tuple[Job, StreamEvent | BaseException]]) -> None:
    for job, item in batch:
        job.put(item)


class ThreadCore:
    """The engine core on a thread of this process, over an LLM built here (tests, embedding): the
    loop of nextn.engine.core with an in-memory inbox. If the loop dies the server stays up and
    answers 503 (the LLM is its caller's)."""

    exit_on_death = False

    def __init__(self, llm: LLM):
        self.model = ServedModel.of_llm(llm)
        self.core = EngineCore(llm.engine)
        self._inbox: deque = deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="nextn-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self, sink: EngineWorker) -> None:
        self._sink = sink
        self._thread.start()

    def send(self, msg) -> None:
        with self._cond:
            self._inbox.append(msg)
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self.send(Shutdown())
            self._thread.join(timeout)

    def _receive(self, block: bool) -> list:
        with self._cond:
            while block and not self._inbox:
                self._cond.wait()
            inputs = list(self._inbox)
            self._inbox.clear()
        return inputs

    def _run(self) -> None:
        try:
            run_loop(self.core, self._receive, self._sink.on_outputs)
        except Exception:
            log.critical("the engine thread died", exc_info=True)
            self._sink.on_dead("the engine stopped after an internal error")
