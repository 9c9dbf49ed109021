"""Server-sent events: the one writer for the OpenAI streams and the control events stream."""
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from fastapi.responses import StreamingResponse
from pydantic import BaseModel


def sse_response(items: AsyncGenerator[dict | BaseModel, None], done: bool = False) -> StreamingResponse:
    """One `data: <json>` event per item (a model is dumped with its None fields kept); `done` ends the
    stream with OpenAI's `data: [DONE]`."""
    async def lines() -> AsyncIterator[str]:
        async with aclosing(items):  # a client that goes away closes `items` too (aborting its requests)
            async for item in items:
                body = item.model_dump(mode="json") if isinstance(item, BaseModel) else item
                yield f"data: {json.dumps(body)}\n\n"
        if done:
            yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")
