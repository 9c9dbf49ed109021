"""A reply of another server relayed as it comes: the data-parallel front's (a replica's) and the API process's (the
engine process's control routes)."""
import httpx
from fastapi.responses import StreamingResponse


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
