"""The engine core in its own process (`nextn serve`), seen from the API process.

`CoreProcess.launch(engine_args)` binds two ZeroMQ ipc:// sockets (PUSH to the core, PULL from it),
starts nextn.engine.core.run_core_process with `spawn` (CUDA-safe; the child imports the engine,
never FastAPI or uvicorn) and waits for its Ready (the model facts; the API process then reads the
tokenizer from the checkpoint directory) or Failed: a start-up error (a flag, a path, CUDA out of
memory) is raised here as the error LLM would have raised, so the CLI prints the same one line.
The server binds its port only after that. (`spawn` re-imports the parent's main module in the
child: a script that launches a core keeps its work under `if __name__ == "__main__":`.)

Serving, one thread of this process reads the core's messages and watches the process itself (its
sentinel, polled with the socket): StepOutputs go to the EngineWorker; the process's exit (killed,
crashed) is noticed at once and reported with its cause ("the engine core process was killed by
signal 9 (SIGKILL)"): every open and later request gets a 503 naming it, and `nextn serve` exits
non-zero shortly after (nextn.server.app), for its supervisor to restart it; the core is not
restarted in place (its sessions, graphs and warm caches would be gone anyway).
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading

import msgspec
import zmq

from nextn.config.engine_args import EngineArgs
from nextn.engine.core import CoreOutput, Failed, Ready, Shutdown, StepOutputs, run_core_process
from nextn.server.model import ServedModel

log = logging.getLogger("nextn.server")


class EngineCoreError(RuntimeError):
    """The engine core could not start for a reason that is not the user's (its log has the traceback)."""


class CoreProcess:
    exit_on_death = True  # a server whose engine is gone can only answer 503: it exits, to be restarted

    def __init__(self, proc, ctx: zmq.Context, push: zmq.Socket, pull: zmq.Socket, tmp: str, model: ServedModel):
        self.proc, self.model = proc, model
        self._ctx, self._push, self._pull, self._tmp = ctx, push, pull, tmp
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(CoreOutput).decode
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader: threading.Thread | None = None

    @classmethod
    def launch(cls, engine_args: EngineArgs, log_level: str | None = None) -> CoreProcess:
        """Start the core and wait until its model is loaded; raise what stopped it, if it failed."""
        log_level = log_level or logging.getLevelName(logging.getLogger("nextn").getEffectiveLevel()).lower()
        tmp = tempfile.mkdtemp(prefix="nextn-core-")
        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.setsockopt(zmq.SNDHWM, 0)  # submitting never blocks on a busy core
        pull.setsockopt(zmq.RCVHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        inputs, outputs = f"ipc://{tmp}/input", f"ipc://{tmp}/output"
        push.bind(inputs)
        pull.bind(outputs)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_core_process, args=(engine_args, inputs, outputs, log_level), name="nextn-engine-core"
        )
        try:
            proc.start()
            ready = _wait_ready(proc, pull, msgspec.msgpack.Decoder(CoreOutput).decode)
            log.info("engine core ready (pid %d)", ready.pid)
            return cls(proc, ctx, push, pull, tmp, ServedModel.load(ready.facts))
        except BaseException:
            if proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join(10)
            push.close()
            pull.close()
            ctx.term()
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def start(self, sink) -> None:
        """Feed the core's messages to `sink` (on_outputs, on_dead) from a thread of this process."""
        self._reader = threading.Thread(target=self._read, args=(sink,), name="nextn-core-reader", daemon=True)
        self._reader.start()

    def send(self, msg) -> None:
        with self._send_lock:
            if not self._stopping:
                self._push.send(self._encode(msg))

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the core down (it finishes its step), wait for it, then free the sockets. Idempotent."""
        with self._send_lock:
            if self._stopping:
                return
            if self.proc.is_alive():
                self._push.send(self._encode(Shutdown()))
            self._stopping = True  # (under the lock: the reader takes the exit that follows for a stop)
        # the reader thread reaps the process once it exits: wait for it rather than join here too (two
        # threads waiting on one child race: the loser's waitpid fails and the child reads as alive)
        if self._reader is not None and self._reader.is_alive():
            self._reader.join(timeout)
        else:
            self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("the engine core did not stop in %.0f s: killed", timeout)
            self.proc.kill()
            self.proc.join(5)
        if self._reader is not None:
            self._reader.join(5)  # it returns once it has seen the process exit
        shutil.rmtree(self._tmp, ignore_errors=True)
        with self._send_lock:
            self._push.close()
        if self._reader is None or not self._reader.is_alive():
            self._pull.close()
            self._ctx.term()

    def _read(self, sink) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        reason = None
        while True:
            ready = dict(poller.poll())
            exited = self.proc.sentinel in ready
            while True:  # every message it sent, the last ones of a core that has exited too
                try:
                    msg = self._decode(self._pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, StepOutputs):
                    sink.on_outputs(msg)
                elif isinstance(msg, Failed):
                    reason = msg.message
            if exited:
                break
        self.proc.join(5)
        if not self._stopping:
            sink.on_dead(reason or exit_cause(self.proc.exitcode))


def _wait_ready(proc, pull: zmq.Socket, decode) -> Ready:
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(proc.sentinel, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if pull in ready:
            msg = decode(pull.recv())
            if isinstance(msg, Ready):
                return msg
            if isinstance(msg, Failed):
                raise start_error(msg)
        elif proc.sentinel in ready:
            proc.join(5)
            raise EngineCoreError(f"{exit_cause(proc.exitcode)} while loading the model")


def start_error(failed: Failed) -> BaseException:
    """The error the core's LLM raised, as this process raises it (the CLI prints a user's error as one line)."""
    if failed.kind == "OutOfMemoryError":
        import torch

        return torch.OutOfMemoryError(failed.message)
    user = {"ValueError": ValueError, "OSError": OSError, "ImportError": ImportError}.get(failed.kind or "")
    if user is not None:
        return user(failed.message)
    return EngineCoreError(f"the engine core failed to start: {failed.message}")


def exit_cause(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown"
        return f"the engine core process was killed by signal {-exitcode} ({name})"
    return f"the engine core process exited with status {exitcode}"
