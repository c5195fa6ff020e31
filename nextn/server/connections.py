"""Connections that cannot lock the server out: a cap on open connections below the descriptor
limit, a deadline for a request's headers, and transport errors logged once per interval.

uvicorn's own limits leave three holes that a probe used (issue 46): `limit_concurrency` only turns
a *request* into a 503, so idle connections that never send one pile up until accept() fails for
every client (EMFILE); `timeout_keep_alive` runs only after a response and stops at the first byte,
so a connection that sends nothing, or its headers a byte a second, is never closed; and asyncio
logs every failed send and accept, hundreds of thousands of lines a minute. Here:
- GuardedH11Protocol: uvicorn's h11 protocol that closes a connection whose request headers have
  not arrived `read_timeout` seconds after it opened (or after its last response), and, when the
  open connections pass `limit_concurrency`, closes the oldest one that is between requests (a new
  client is served; a request in progress is never cut), or, when none is, answers the new one 503.
- raise_fd_limit: the soft RLIMIT_NOFILE raised towards the hard one at start.
- RateLimitFilter: a repeated log message passes once per interval, with how many were dropped.
The body's own deadline is the Guard's (nextn.server.guard); this module knows no routes.
"""

from __future__ import annotations

import json
import logging
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("nextn.server")

FD_BASE = 64  # descriptors the API process holds besides connections: the core's channel, files, logs
MAX_DEFAULT_CONNECTIONS = 4096  # the default cap's ceiling (--limit-concurrency sets any other)
FD_TARGET = 65536  # the soft descriptor limit asked for at start, when the hard one allows it

# an OpenAI-shaped error, as every other answer of the server (nextn.server.app's OpenAPI says so)
_BUSY_ERROR = {"message": "Too many open connections.", "type": "server_error", "param": None, "code": "too_busy"}
_BUSY_BODY = json.dumps({"error": _BUSY_ERROR}).encode()
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
_BUSY += b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)


def default_limit_concurrency(soft_fd_limit: int) -> int:
    """Open connections allowed by default: half the descriptor limit (the rest: accept_backlog's)."""
    return max(16, min(MAX_DEFAULT_CONNECTIONS, soft_fd_limit // 2))


def accept_backlog(soft_fd_limit: int, limit_concurrency: int) -> int:
    """The listen backlog, which is also how many connections asyncio accepts in one go before
    any of them is seen (and the cap can close one, two loop turns later): an eighth of the
    descriptors left over the cap, so a burst cannot reach the descriptor limit. There asyncio's
    accept loop (3.11) goes on calling accept() `backlog` times, logging each EMFILE and queueing a
    retry for each: the probe's storm."""
    return max(16, min(2048, (soft_fd_limit - limit_concurrency - FD_BASE) // 8))


def raise_fd_limit(target: int = FD_TARGET) -> int:
    """Raise the soft RLIMIT_NOFILE towards the hard limit (at most `target`); one log line when it
    changed. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if want <= soft:
        log.info("open-file limit %d (hard limit %s)", soft, hard)
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:
        log.info("open-file limit stays %d (raising it to %d failed: %s)", soft, want, e)
        return soft
    log.info("open-file limit raised from %d to %d (hard limit %s)", soft, want, hard)
    return want


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap that evicts idle ones
    (both bound with functools.partial; uvicorn's own `limit_concurrency`, one above the cap, then
    answers 503 only while every connection has a request in progress)."""

    def __init__(self, *args, read_timeout: float = 30.0, max_connections: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout, self.max_connections = read_timeout, max_connections
        self.opened = time.monotonic()
        self._deadline = None  # the header deadline's timer
        self._armed_for = None  # the cycle in progress when it was armed (a new one: headers came)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()
        cap = self.max_connections
        # closing ones are gone within a loop turn (and one evicted for a connection made in this turn
        # must not be picked again for the next)
        if cap is not None and len(self.connections) > cap:
            open_ = [c for c in self.connections if c is not self and not c.transport.is_closing()]
            if len(open_) < cap:
                return
            idle = [c for c in open_ if _between_requests(c)]
            if idle:
                min(idle, key=lambda c: getattr(c, "opened", 0.0)).transport.close()
            else:  # every other connection has a request in progress: this one is refused
                transport.write(_BUSY)
                transport.close()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers get read_timeout too (keep-alive stops at a byte)

    def _arm(self) -> None:
        self._disarm()
        self._armed_for = self.cycle
        self._deadline = self.loop.call_later(self.read_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self.cycle is self._armed_for and not self.transport.is_closing():  # no request began since
            self.transport.close()


def _between_requests(conn) -> bool:
    cycle = getattr(conn, "cycle", None)
    return cycle is None or cycle.response_complete


class RateLimitFilter(logging.Filter):
    """Lets each message (by logger and format string) through once per `interval` seconds; the
    next one through says how many were dropped since. `only`: the messages it limits (prefixes of
    the format string); None limits every message of the logger it is on."""

    def __init__(self, interval: float = 10.0, only: tuple[str, ...] | None = None):
        super().__init__()
        self.interval, self.only = interval, only
        self.seen: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (last passed at, dropped since)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if self.only is not None and not msg.startswith(self.only):
            return True
        # the first line: asyncio's exception handler writes the handle and its timer into the rest
        key, now = (record.name, msg.split("\n", 1)[0][:80]), time.monotonic()
        last, dropped = self.seen.get(key, (-float("inf"), 0))
        if now - last < self.interval:
            self.seen[key] = (last, dropped + 1)
            return False
        self.seen[key] = (now, 0)
        if len(self.seen) > 1024:  # messages that differ every time: not kept forever
            self.seen = {key: (now, 0)}
        if dropped:
            record.msg = f"{msg} ({dropped} more in the last {now - last:.0f} s)"
        return True


def limit_transport_logs(interval: float = 10.0) -> None:
    """Repeated transport errors (asyncio's failed sends and accepts, uvicorn's refusals) logged at
    most once per `interval` each. Idempotent."""
    targets = {
        "asyncio": None,
        "uvicorn.error": ("Exceeded concurrency limit", "Invalid HTTP request received"),
    }
    for name, only in targets.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(RateLimitFilter(interval, only))
