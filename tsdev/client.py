"""Talking to a tsdev (or any seed-style) server over HTTP: control calls in the control protocol's types
(runtime/control_protocol.py), and the one reader of server-sent events."""
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from runtime.control_protocol import RELOAD_ROUTE, ErrorBody, ReloadReply, ReloadRequest

DEFAULT_URL = "http://127.0.0.1:8000"
Reply = TypeVar("Reply", bound=BaseModel)


def body(request: BaseModel) -> dict:
    """A request as JSON, without the options left unset (the shape clients have always sent)."""
    return request.model_dump(mode="json", exclude_none=True)


def error_message(response: httpx.Response) -> str:
    """The message of an error reply (OpenAI's shape), else the start of its text."""
    try:
        return ErrorBody.model_validate_json(response.content).error.message
    except ValidationError:
        return response.text[:300]


def reply_or_raise(response: httpx.Response, model: type[Reply]) -> Reply:
    """The reply of a 200 as `model`; RuntimeError("status: the error's message") otherwise."""
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {error_message(response)}")
    return model.model_validate_json(response.content)


def reload_request(modules: list[str] | None = None, mode: str = "wait", timeout_s: float | None = None,
                   request_id: str | None = None) -> ReloadRequest:
    return ReloadRequest(id=request_id or f"reload-{uuid.uuid4().hex[:12]}", mode=mode, modules=modules or None,
                         timeout_s=timeout_s or None)


def reload_forward(url: str, modules: list[str] | None = None, mode: str = "wait",
                   timeout_s: float | None = None) -> ReloadReply:
    """POST reload_forward and return the reply; raises httpx errors and RuntimeError for refusals."""
    response = httpx.post(url.rstrip("/") + RELOAD_ROUTE, json=body(reload_request(modules, mode, timeout_s)),
                          timeout=None if timeout_s is None else timeout_s + 30)
    return reply_or_raise(response, ReloadReply)


_DONE = object()


def _sse_data(line: str):
    """The JSON payload of an SSE `data:` line, _DONE for OpenAI's `[DONE]`, None for any other line."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return _DONE if data == "[DONE]" else json.loads(data)


def iter_sse_data(response: httpx.Response) -> Iterator:
    """The decoded `data:` payloads of an event stream, until `[DONE]` or its end."""
    for line in response.iter_lines():
        if (data := _sse_data(line)) is _DONE:
            return
        if data is not None:
            yield data


async def aiter_sse_data(response: httpx.Response) -> AsyncIterator:
    """iter_sse_data for an async response."""
    async for line in response.aiter_lines():
        if (data := _sse_data(line)) is _DONE:
            return
        if data is not None:
            yield data
