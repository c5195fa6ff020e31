"""The gate in front of the routes (plain ASGI, outside FastAPI): the API key, then the body-size
limit, both decided before a byte of the body is parsed. A body announced larger than the limit is
answered 413 from its headers alone; a chunked one is read only up to the limit. The body read
here is handed on whole, and the client's later messages (a disconnect) pass through untouched.
Does not know the engine or the routes.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from nextn.server import protocol as P


class Guard:
    def __init__(
        self,
        app,
        api_key: str | None,
        max_request_bytes: int,
        open_paths: frozenset[str],
        on_reject: Callable[[str], None],
    ):
        self.app, self.max_bytes, self.open_paths, self.on_reject = app, max_request_bytes, open_paths, on_reject
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in self.open_paths:
            if not secrets.compare_digest(headers.get(b"authorization", b""), self.expected):
                self.on_reject("unauthorized")
                return await _error(send, 401, "Incorrect API key provided.", "authentication_error", "invalid_api_key")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return await self._too_large(send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._too_large(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        self.on_reject("too_large")
        message = f"The request body exceeds the server's limit of {self.max_bytes} bytes."
        await _error(send, 413, message, "invalid_request_error", "request_too_large", close=True)


async def _error(send, status: int, message: str, type_: str, code: str, close: bool = False) -> None:
    body = json.dumps(P.ErrorResponse(error=P.ErrorInfo(message=message, type=type_, code=code)).model_dump()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the unread rest of the body makes the connection unusable
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
