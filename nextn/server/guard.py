"""The gate in front of the routes (plain ASGI, outside FastAPI): the API key, then the body-size
limit, both decided before a byte of the body is parsed. A body announced larger than the limit is
refused from its headers alone (a Content-Length that is no number: a 400); a chunked one is read
only up to the limit. Before a 401 or 413 goes out, what the client is still sending is read and
dropped for up to DRAIN_S seconds: a server that closes on unread data makes the client's kernel
see a reset, and most clients then report a broken connection instead of the 413 (a client that
asked `Expect: 100-continue` sends nothing, so nothing is drained). The body read here is handed on
whole, and the client's later messages (a disconnect) pass through untouched. A body that has not
arrived whole `read_timeout` seconds after its headers is answered 408 and the connection closed
(the headers' own deadline is nextn.server.connections'). Does not know the engine or the routes.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable

from nextn.server import response_models as R

DRAIN_S = 2.0  # at most this long spent dropping a refused body before answering


class Guard:
    def __init__(
        self,
        app,
        api_key: str | None,
        max_request_bytes: int,
        open_paths: frozenset[str],
        on_reject: Callable[[str], None],
        read_timeout: float = 30.0,
    ):
        self.app, self.max_bytes, self.open_paths, self.on_reject = app, max_request_bytes, open_paths, on_reject
        self.read_timeout = read_timeout  # seconds the whole body gets to arrive; later: a 408
        self.key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        # a client that asked `Expect: 100-continue` sends no body unless the server reads it
        unsent = headers.get(b"expect", b"").lower() != b"100-continue"

        async def too_large(pending: bool) -> None:
            message = f"The request body exceeds the server's limit of {self.max_bytes} bytes."
            await self._refuse(receive, send, pending, 413, message, "invalid_request_error", "request_too_large")

        if self.key is not None and scope["path"] not in self.open_paths:
            if not self._authorized(headers.get(b"authorization", b"")):
                message = "Incorrect API key provided."
                return await self._refuse(
                    receive, send, unsent, 401, message, "authentication_error", "invalid_api_key"
                )
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():  # its body's end is unknown: nothing is drained, the connection closes
            message = "The Content-Length header is not a number of bytes."
            return await self._refuse(receive, send, False, 400, message, "invalid_request_error", None)
        if int(length) > self.max_bytes:
            return await too_large(unsent)
        body, more = bytearray(), True
        try:
            async with asyncio.timeout(self.read_timeout):  # a body sent a byte a second ties up no slot
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > self.max_bytes:
                        break
        except TimeoutError:
            message = f"The request body did not arrive within {self.read_timeout:g} s."
            return await self._refuse(receive, send, False, 408, message, "invalid_request_error", "request_timeout")
        if len(body) > self.max_bytes:
            return await too_large(more)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    def _authorized(self, header: bytes) -> bool:
        """`Bearer <key>`, the scheme in any case (RFC 7235: auth schemes are case-insensitive)."""
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.lstrip(b" "), self.key)

    async def _refuse(
        self, receive, send, pending: bool, status: int, message: str, type_: str, code: str | None
    ) -> None:
        """Answer an error before the app sees the request; first drop what the client still sends."""
        self.on_reject({401: "unauthorized", 413: "too_large"}.get(status, "bad_request"))
        if pending:
            await _drain(receive)
        body = R.ErrorResponse(error=R.ErrorInfo(message=message, type=type_, code=code)).model_dump()
        content = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
        if status != 401:  # a body past the drain's bound (or of unknown length) may still be arriving
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})


async def _drain(receive) -> None:
    """Read and drop the rest of a request body, for at most DRAIN_S seconds."""
    deadline = time.monotonic() + DRAIN_S
    try:
        while (left := deadline - time.monotonic()) > 0:
            message = await asyncio.wait_for(receive(), left)
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
    except TimeoutError:
        return
