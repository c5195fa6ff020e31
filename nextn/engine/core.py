"""The engine core: the loop that owns the `Engine` while a server runs, and the messages between it
and the API process (vLLM v1's EngineCore, its busy loop and its msgpack channel).

`nextn serve` runs the core in a process of its own (`run_core_process`, started with `spawn` by
nextn.server.core_client), so tokenizing, templates, JSON and SSE in the API process never hold
the interpreter lock the engine loop needs. The loop (`run_loop`): take what arrived (blocking on
the socket only while the engine has no work: an idle core sleeps), apply it (new requests,
aborts), `engine.step()`, and send every request's events of that step with a small stats snapshot
in one message. Tests and embedders run the same loop on a thread of their own process
(nextn.server.worker.ThreadCore): one loop body, two transports.

Messages, msgpack through msgspec (ZeroMQ PUSH/PULL over ipc:// sockets, one each way):
- API -> core: `AddRequest` (request id, prompt ids, SamplingParams, checkpoint_at, use_sessions),
  `AbortRequest` (request id; with `num_tokens`: a stop string ended it there), `Shutdown`.
- core -> API: `Ready` (the model facts the HTTP layer reads, the core's pid) or `Failed` (why it
  could not start, or why it stopped) once; then a `StepOutputs` per loop turn that did something:
  the step's `RequestEvent`s (new token ids, their round's draft counts, logprob entries when
  asked, the RequestOutput on the last; an error; or the acknowledgement of an abort) and `CoreStats`.
Request ids are the API's (it numbers its jobs); the core maps them to the engine's requests.

Token ids cross, never text: the API process detokenizes and looks for stop strings
(nextn.server.outputs, with nextn.engine.detokenizer: the implementation `LLM` uses in one
process), so that host work stays out of this loop. A stop string it finds comes back as an
`AbortRequest` with the count of tokens kept: the core ends the request there (Engine.stop, which
keeps the slot's record exact for sessions) and answers with its output; the tokens of rounds that
ran meanwhile are dropped by the API. The core never imports nextn.server (nor FastAPI or uvicorn).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Callable

import msgspec

from nextn.cache.prefix import PrefixCounters
from nextn.config.engine_args import EngineArgs
from nextn.core import RequestError, RequestOutput, SamplingParams
from nextn.engine.engine import Engine, EngineTime
from nextn.engine.scheduler import Request, SessionCounters
from nextn.ops.triton_utils import compile_count

log = logging.getLogger("nextn.engine.core")

# ---------------------------------------------------------------------------------------------
# Messages


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    checkpoint_at: int | None = None  # where the session's rewind checkpoint goes (None: the prompt end)
    use_sessions: bool = True


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    request_id: int
    num_tokens: int | None = None  # a stop string ended the output after this many tokens (None: the client left)


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = AddRequest | AbortRequest | Shutdown


class RequestEvent(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news of one step: its new tokens, or how it ended (no text: the API makes it)."""

    request_id: int
    token_ids: list[int] = []  # new tokens of this step
    output: RequestOutput | None = None  # set on the last event (its text "")
    logprobs: list[dict] | None = None  # this step's tokens' entries, when params.logprobs is set
    round_counts: tuple[int, int, bool] | None = None  # their round's (drafted, accepted, zero_draft)
    error: str | None = None  # the request failed: why (it is over)
    bad_request: bool = False  # ... through its own fault (a RequestError: the server's 400)
    aborted: bool = False  # an abort took effect: the request is over, its slot free


class CoreStats(msgspec.Struct, array_like=True):
    """What /metrics shows of the engine, as of the end of a loop turn."""

    num_running: int = 0  # requests in slots (prefilling or generating); the API counts the waiting ones
    sessions: SessionCounters = msgspec.field(default_factory=SessionCounters)
    num_session_states: int = 0
    session_memory_bytes: int = 0  # kept sessions' slots and the CUDA graphs captured for them
    batch_sizes: dict[int, int] = {}  # requests per batched round -> rounds launched
    graph_counts: dict[str, int] | None = None  # the runner's {"captures", "replays", "eager"}, if it counts
    prefix: PrefixCounters | None = None  # the prefix cache's counters (None: it is off)
    prefix_cache_bytes: int = 0  # what its blocks hold
    prefill_tokens: int = 0  # prompt tokens computed (not served from a cache)
    time: EngineTime = msgspec.field(default_factory=EngineTime)  # the engine steps' wall time


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    events: list[RequestEvent]
    stats: CoreStats


class ModelFacts(msgspec.Struct):
    """What the HTTP side reads of the loaded model (it never loads the weights itself)."""

    model_dir: str  # the checkpoint directory: the API process reads the tokenizer from it
    model_name: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int  # the model's (the tokenizer's may differ)
    num_speculative_tokens: int
    sampling_defaults: dict  # from generation_config.json


class Ready(msgspec.Struct, tag="ready", array_like=True):
    facts: ModelFacts
    pid: int


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """The core could not start, or stopped: `message` says why (a user's error, a flag or a path:
    `kind` names its class; otherwise the core logged the traceback)."""

    message: str
    kind: str | None = None  # ValueError, OSError, ImportError or OutOfMemoryError: the user can fix it


CoreOutput = Ready | Failed | StepOutputs


def model_facts(llm) -> ModelFacts:
    """The facts of an LLM (nextn.engine.llm.LLM) built in this process."""
    cfg = llm.config
    return ModelFacts(
        cfg.model,
        llm.model_name,
        cfg.max_model_len,
        cfg.max_num_seqs,
        llm.model.cfg.vocab_size,
        llm.num_speculative_tokens,
        dict(llm.sampling_defaults),
    )


# ---------------------------------------------------------------------------------------------
# The loop body


class EngineCore:
    """The engine as the API sees it: requests by the API's ids, events by step, a stats snapshot.
    Called from one thread (the core process's main thread, or the server's engine thread)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._requests: dict[int, Request] = {}  # API id -> the engine's request
        self._api_ids: dict[int, int] = {}  # the engine's request id -> API id

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def apply(self, inputs: list) -> list[RequestEvent]:
        """New requests and aborts, in arrival order (an abort answered at once: it frees the slot
        between rounds, and the session state is kept; a stop string's, with the request's output)."""
        events = []
        for msg in inputs:
            if isinstance(msg, AddRequest):
                try:
                    req = self.engine.add(
                        msg.prompt_ids, msg.params, msg.use_sessions, msg.checkpoint_at, detokenize=False
                    )
                except Exception as e:  # a request the HTTP side did not foresee: it fails alone
                    log.error("engine refused a request", exc_info=True)
                    if isinstance(e, ValueError):  # add's refusals (a grammar that does not compile): a 400
                        e = RequestError(str(e))
                    events.append(_failure(msg.request_id, e))
                    continue
                self._requests[msg.request_id] = req
                self._api_ids[req.request_id] = msg.request_id
            elif isinstance(msg, AbortRequest):
                req = self._requests.pop(msg.request_id, None)
                if req is not None:
                    del self._api_ids[req.request_id]
                    if msg.num_tokens is not None:
                        events.append(self._stop(msg.request_id, req, msg.num_tokens))
                        continue
                    self.engine.abort(req)
                events.append(RequestEvent(msg.request_id, aborted=True))
        return events

    def step(self) -> list[RequestEvent]:
        events = []
        for req, ev in self.engine.step():
            api_id = self._api_ids.get(req.request_id)
            if api_id is None:  # another caller's request (two servers over one engine, in tests)
                continue
            if isinstance(ev, BaseException):
                log.error("engine failure: %r", ev)
                events.append(_failure(api_id, ev))
            else:
                events.append(RequestEvent(api_id, ev.token_ids, ev.output, ev.logprobs, ev.round_counts))
            if isinstance(ev, BaseException) or ev.output is not None:
                del self._api_ids[req.request_id]
                del self._requests[api_id]
        return events

    def _stop(self, api_id: int, req: Request, num_tokens: int) -> RequestEvent:
        """A stop string ended the request after num_tokens tokens: its last event, with its output."""
        try:
            return RequestEvent(api_id, output=self.engine.stop(req, num_tokens))
        except Exception as e:
            log.error("engine failure stopping a request", exc_info=True)
            return _failure(api_id, e)

    def stats(self) -> CoreStats:
        engine = self.engine
        sched = engine.scheduler
        counts = getattr(engine.runner, "graph_counts", None)
        prefix = engine.runner.prefix
        return CoreStats(
            len(sched.running),
            dataclasses.replace(sched.counters),
            len(sched.sessions),
            # a kept conversation holds its slot and the graphs captured for it
            len(sched.sessions) * engine.pool.slot_nbytes + engine.runner.graph_memory.of(sched.sessions),
            dict(engine.batch_sizes),
            None if counts is None else {**{k: int(v) for k, v in counts.items()}, "kernel_compiles": compile_count()},
            None if prefix is None else dataclasses.replace(prefix.counters),
            0 if prefix is None else prefix.nbytes,
            engine.prefilled_tokens,
            dataclasses.replace(engine.time),
        )


def _failure(request_id: int, e: BaseException) -> RequestEvent:
    return RequestEvent(request_id, error=str(e) or type(e).__name__, bad_request=isinstance(e, RequestError))


def run_loop(
    core: EngineCore,
    receive: Callable[[bool], list],
    send: Callable[[StepOutputs], None],
) -> None:
    """Until a Shutdown arrives: take the inputs that arrived (`receive(block)` blocks only while
    the engine has no work), apply them, step the engine, send the turn's events and stats in one
    message. Raises what the engine raises outside a request (the caller reports the death)."""
    while True:
        inputs = receive(not core.has_work)
        if any(isinstance(msg, Shutdown) for msg in inputs):
            return
        events = core.apply(inputs)
        stepped = core.has_work
        if stepped:
            events += core.step()
        if inputs or stepped:
            send(StepOutputs(events, core.stats()))


# ---------------------------------------------------------------------------------------------
# The core process


def run_core_process(args: EngineArgs, input_address: str, output_address: str, log_level: str) -> None:
    """The core process's main (multiprocessing, `spawn`): build the LLM from the settings the
    server checked, say Ready (or Failed), then run the loop until Shutdown or the API process is
    gone. SIGINT and SIGTERM are ignored: a terminal's Ctrl-C and a service manager's SIGTERM reach
    the whole process group, and the API process drains its open requests first, then stops the core."""
    import zmq

    from nextn.console import setup_logging, user_errors
    from nextn.engine.llm import LLM

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(log_level)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (inbox, outbox):
        sock.setsockopt(zmq.LINGER, 2000)  # a last message still goes out; a gone reader does not hold the exit
        sock.setsockopt(zmq.SNDHWM if sock is outbox else zmq.RCVHWM, 0)
    inbox.connect(input_address)
    outbox.connect(output_address)
    encode = msgspec.msgpack.Encoder().encode
    llm = None
    try:
        try:
            llm = LLM.from_args(args)
        except Exception as e:
            kind = next((cls.__name__ for cls in user_errors() if isinstance(e, cls)), None)
            if kind is None:
                log.error("the engine core failed to start", exc_info=True)
            outbox.send(encode(Failed(f"{type(e).__name__}: {e}" if kind is None else str(e), kind)))
            raise SystemExit(1) from None
        outbox.send(encode(Ready(model_facts(llm), os.getpid())))
        try:
            run_loop(EngineCore(llm.engine), _socket_receiver(inbox), lambda out: outbox.send(encode(out)))
        except Exception:
            log.critical("the engine core died", exc_info=True)
            outbox.send(encode(Failed("the engine core stopped after an internal error")))
            raise SystemExit(1) from None
    finally:
        if llm is not None:
            llm.close()
        inbox.close()
        outbox.close()
        ctx.term()


def _socket_receiver(inbox) -> Callable[[bool], list]:
    """`receive(block)` over the core's input socket; the API process's death reads as a Shutdown."""
    import multiprocessing

    import zmq

    decode = msgspec.msgpack.Decoder(CoreInput).decode
    parent = multiprocessing.parent_process()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    if parent is not None:
        poller.register(parent.sentinel, zmq.POLLIN)  # readable once the API process is gone

    def receive(block: bool) -> list:
        ready = dict(poller.poll(None if block else 0))
        if parent is not None and parent.sentinel in ready:
            log.warning("the API process is gone: the engine core stops")
            return [Shutdown()]
        inputs = []
        while True:
            try:
                inputs.append(decode(inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return inputs

    return receive
