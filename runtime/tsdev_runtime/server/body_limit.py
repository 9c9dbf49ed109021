"""The request-body limit (`tsdev serve --max-request-body-bytes`), checked before anything reads or parses a
body: a pure ASGI middleware, so a 10 MB body costs the event loop almost nothing.

A declared Content-Length over the limit is answered 413 at once; a chunked body is counted as it arrives
and answered 413 as soon as it passes the limit. The answer (headers and the whole error body) goes out first;
then what the client still sends is read and dropped for a while (up to DRAIN_FACTOR times the limit, DRAIN_S
seconds: an unterminated body is not waited for) before the response ends and the connection closes: closing
on unread bytes would reset the connection, and the client could lose the answer. A client that waits for
`100 Continue` never sends it.
"""
import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tsdev_runtime.control_protocol import ErrorBody, ErrorDetail

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DRAIN_FACTOR = 16
DRAIN_S = 2.0


class BodyLimit:
    def __init__(self, app: Callable, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:  # the server holds the client to it
            if length.isdigit() and int(length) > self.max_bytes:
                return await self._refuse(f"the request body is {int(length)} bytes", headers, receive, send)
            return await self.app(scope, receive, send)
        if b"transfer-encoding" not in headers:  # no body
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:  # chunked: read it whole (it is small) before the app sees it
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(f"the request body is more than {self.max_bytes} bytes", headers,
                                          receive, send, more=message.get("more_body", False))
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, what: str, headers: dict, receive: Receive, send: Send, more: bool = True) -> None:
        if headers.get(b"expect", b"").lower() == b"100-continue":
            more = False  # the client sends nothing until told to
        detail = ErrorDetail(message=f"{what}; this server accepts at most {self.max_bytes} bytes "
                                     "(tsdev serve --max-request-body-bytes): send a shorter prompt",
                             type="invalid_request_error", code=413)
        body = json.dumps(ErrorBody(error=detail).dump(), separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": more})
        if not more:
            return
        deadline, drained = asyncio.get_running_loop().time() + DRAIN_S, 0
        while more and drained <= DRAIN_FACTOR * self.max_bytes:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                break
            if message["type"] != "http.request":
                break
            drained += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.body", "body": b""})
