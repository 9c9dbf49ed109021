"""Talking to a tsdev (or any seed-style) server over HTTP: control calls in the control protocol's types
(runtime/tsdev_runtime/control_protocol.py), and the one reader of server-sent events."""
import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from tsdev_runtime.control_protocol import (COMPILE_AHEAD_ROUTE, EVENTS_ROUTE, KERNEL_CHECK_ROUTE, RELOAD_ROUTE,
                                            CompileAheadReply, CompileAheadRequest, ErrorBody, Event, Hello,
                                            KernelCheckProgress, KernelCheckReply, KernelCheckRequest, ReloadReply,
                                            ReloadRequest, parse_event)

DEFAULT_URL = "http://127.0.0.1:8000"
Reply = TypeVar("Reply", bound=BaseModel)


def body(request: BaseModel) -> dict:
    """A request as JSON, without the options left unset (the shape clients have always sent)."""
    return request.model_dump(mode="json", exclude_none=True)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header that carries a server's API key (tsdev serve --api-key); none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(response: httpx.Response) -> str:
    """The message of an error reply (OpenAI's shape), else the start of its text."""
    try:
        return ErrorBody.model_validate_json(response.content).error.message
    except ValidationError:
        return response.text[:300]


class ErrorReply(RuntimeError):
    """A reply other than 200: str() is "status: the error's message"."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


def reply_or_raise(response: httpx.Response, model: type[Reply]) -> Reply:
    """The reply of a 200 as `model`; ErrorReply otherwise, and for a 200 that is not a `model` (not a tsdev
    server at that URL?)."""
    if response.status_code != 200:
        raise ErrorReply(response.status_code, error_message(response))
    try:
        return model.model_validate_json(response.content)
    except ValidationError as exc:
        raise ErrorReply(200, f"the reply is not a {model.__name__} (is a tsdev server at {response.url}?): "
                              f"{response.text[:200]}") from exc


def control_call(url: str, method: str, route: str, model: type[Reply], request: BaseModel | None = None,
                 api_key: str | None = None, timeout: float | None = 600) -> Reply:
    """One control call (sleep, wake_up, is_sleeping, reload_weights, ...) with the server's `api_key`: its reply as
    `model`; raises httpx errors when no server answers, RuntimeError("status: message") for a refusal."""
    response = httpx.request(method, url.rstrip("/") + route, json=None if request is None else body(request),
                             headers=auth_headers(api_key), timeout=timeout)
    return reply_or_raise(response, model)


def kernel_check(url: str, ops: list[str] | None = None,
                 on_progress: Callable[[KernelCheckProgress], None] | None = None,
                 api_key: str | None = None) -> KernelCheckReply:
    """POST kernel_check as a stream (`tsdev check`): `on_progress` gets each KernelCheckProgress as the server runs
    the cases, and the KernelCheckReply is returned; raises httpx errors when no server answers, ErrorReply for a
    refusal (400 unknown op, 403, 409 another check runs) or a check that could not go on (503 the server stops).
    Closing the connection (Ctrl-C: KeyboardInterrupt leaves this) stops the server's check between two cases."""
    request = KernelCheckRequest(ops=ops or None, stream=True)
    # a case may run for minutes under Triton's interpreter before its next event: no read timeout
    with httpx.stream("POST", url.rstrip("/") + KERNEL_CHECK_ROUTE, json=body(request), headers=auth_headers(api_key),
                      timeout=httpx.Timeout(30, read=None)) as response:
        if response.status_code != 200 or not response.headers.get("content-type", "").startswith("text/event-stream"):
            response.read()  # a refusal, or a server that answers in one reply
            return reply_or_raise(response, KernelCheckReply)
        for data in iter_sse_data(response):
            if "error" in data:
                error = ErrorBody.model_validate(data).error
                raise ErrorReply(error.code or 500, error.message)
            if data.get("type") == "kernel_check_progress":
                if on_progress is not None:
                    on_progress(KernelCheckProgress.model_validate(data))
                continue
            return KernelCheckReply.model_validate(data)
    raise ErrorReply(502, f"{url} ended the check's stream before its reply: did the server stop? Its log says why")


def compile_ahead(url: str, path: str, text: str, api_key: str | None = None,
                  timeout: float = 600) -> CompileAheadReply:
    """POST compile_ahead: an editor's unsaved buffer (`text`, of the file at `path`) built ahead, nothing reloaded.
    Raises httpx errors when no server answers, ErrorReply for a refusal (403 without --allow-reload-forward, 400 a
    file outside the reloadable packages)."""
    return control_call(url, "POST", COMPILE_AHEAD_ROUTE, CompileAheadReply, CompileAheadRequest(path=path, text=text),
                        api_key, timeout)


def reload_request(modules: list[str] | None = None, mode: str = "wait", timeout_s: float | None = None,
                   request_id: str | None = None, recapture: bool = False,
                   kernel_check: str | None = None) -> ReloadRequest:
    return ReloadRequest(id=request_id or f"reload-{uuid.uuid4().hex[:12]}", mode=mode, modules=modules or None,
                         timeout_s=timeout_s or None, recapture=recapture, kernel_check=kernel_check)


def reload_forward(url: str, modules: list[str] | None = None, mode: str = "wait", timeout_s: float | None = None,
                   on_event: Callable[[Event], None] | None = None, on_tick: Callable[[], None] | None = None,
                   tick_s: float = 0.25, api_key: str | None = None, recapture: bool = False,
                   kernel_check: str | None = None) -> ReloadReply:
    """POST reload_forward (with the server's `api_key`, if it has one) and return the reply; raises httpx errors
    and RuntimeError for refusals (401 without the right key, 403 without --allow-reload-forward).

    With `on_event`, this reload's events (ReloadStarted, ReloadStep, ReloadFinished) are passed to it while
    the POST is in flight, from the server's event stream, subscribed before the POST is sent (a server
    without the stream just replies); `on_tick()` runs every `tick_s` meanwhile (to show elapsed time)."""
    request = reload_request(modules, mode, timeout_s, recapture=recapture, kernel_check=kernel_check)
    timeout = None if timeout_s is None else timeout_s + 30
    headers = auth_headers(api_key)
    if on_event is None:
        response = httpx.post(url.rstrip("/") + RELOAD_ROUTE, json=body(request), timeout=timeout, headers=headers)
    else:
        response = asyncio.run(_post_following(url.rstrip("/"), request, timeout, on_event, on_tick, tick_s, headers))
    return reply_or_raise(response, ReloadReply)


async def _post_following(url: str, request: ReloadRequest, timeout: float | None, on_event, on_tick,
                          tick_s: float, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5), headers=headers) as client:
        subscribed = asyncio.Event()

        async def listen() -> None:
            try:
                async with client.stream("GET", url + EVENTS_ROUTE, timeout=httpx.Timeout(5, read=None)) as response:
                    if response.status_code == 200:
                        async for data in aiter_sse_data(response):
                            event = parse_event(data)
                            if isinstance(event, Hello):
                                subscribed.set()
                            elif getattr(event, "id", None) == request.id:
                                on_event(event)
            except (httpx.HTTPError, ValueError):  # no stream: the reply alone tells the outcome
                pass
            finally:
                subscribed.set()

        async def tick() -> None:
            while on_tick is not None:
                await asyncio.sleep(tick_s)
                on_tick()

        tasks = [asyncio.create_task(listen()), asyncio.create_task(tick())]
        try:
            try:
                await asyncio.wait_for(subscribed.wait(), 2)
            except TimeoutError:
                pass
            return await client.post(url + RELOAD_ROUTE, json=body(request))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


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
