"""A reply of another server relayed as it comes: the data-parallel front's (a replica's) and the API process's (the
engine process's control routes)."""
import asyncio
from collections.abc import Awaitable

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse


class Relayed(StreamingResponse):
    """A reply relayed as it comes (its status, type and Retry-After); `done` runs, and the upstream
    connection is closed, however the relay ends: finished, failed, or the client gone before it began."""

    def __init__(self, upstream: httpx.Response, done=None):
        headers = {k: v for k, v in upstream.headers.items() if k.lower() == "retry-after"}
        super().__init__(upstream.aiter_raw(), status_code=upstream.status_code, headers=headers,
                         media_type=upstream.headers.get("content-type"))
        self.upstream, self.done = upstream, done

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()
            if self.done is not None:
                self.done()


async def head_unless_gone(request: Request, sending: Awaitable[httpx.Response]) -> httpx.Response | Response:
    """The upstream reply's head, or (a 499 nobody reads) the client's going away first: the upstream request is then
    cancelled, which closes its connection, so the upstream route sees its client gone too. Why: a plain (not
    streamed) reply's head comes only at its end, and meanwhile nothing else would pass the going away on (a
    `tsdev check` answered in one reply runs minutes under Triton's interpreter; the engine process stops it when its
    client goes). Call it once the request's body was read: what `receive` says next is the client's going away."""
    sending = asyncio.ensure_future(sending)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not sending.done():
            sending.cancel()
    if not sending.done() or sending.cancelled():
        await asyncio.wait({sending})  # its cancellation closes the upstream connection
        return Response(status_code=499)  # nginx's "client closed request"
    return sending.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
