"""The API process: `tsdev serve`'s HTTP front, beside the engine process (docs/architecture.md, "Two processes").

`tsdev serve` binds the public address and starts this process at once, so that its imports overlap the model's
load (it imports no torch). As soon as the checkpoint is open it says hello over the channel
(runtime/tsdev_runtime/engine/wire.py) with the server's settings and what the routes read of the model, and this
process builds its app while the model loads; it listens once the engine process says it is ready. From then on it
serves the OpenAI routes itself -- tokenizing, chat templates, detokenizing, stop strings,
logprobs, usage, JSON and SSE -- and sends the engine process only token ids and aborts: its loop schedules and
launches steps and does nothing per request. Every other route (control, reload, events, server info, health,
models) is relayed to the engine process's own app on a Unix socket; /metrics joins the requests' latencies kept
here with the engine's.

Either side's exit ends the other: the channel closes. The engine process then stops with FATAL_EXIT_STATUS; this one
leaves at once (`gone`), dropping its connections as the one process of `--no-api-process` would in a crash.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpcore
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tokenizers import Tokenizer

from tsdev_runtime.config import ServerConfig
from tsdev_runtime.engine.errors import ShuttingDown, Unavailable
from tsdev_runtime.engine.outputs import OutputProcessor, RequestOutput, StepOutputs
from tsdev_runtime.engine.sequence import InvalidRequest, SamplingParams
from tsdev_runtime.engine.wire import REFUSALS, frame, read_message
from tsdev_runtime.server.body_limit import BodyLimit
from tsdev_runtime.server.chat import ChatTemplate
from tsdev_runtime.server.deps import ServedModel, ServerDeps
from tsdev_runtime.server.errors import install_error_handlers
from tsdev_runtime.server.metrics import RequestMetrics
from tsdev_runtime.server.openai import openai_router
from tsdev_runtime.server.relay import Relayed, head_unless_gone
from tsdev_runtime.server.security import Guard, SecurityPolicy

RELAYED_HEADERS = ("authorization", "content-type", "accept", "last-event-id")


class EngineChannel:
    """What the routes generate through in the API process (a `deps.Generator`): requests go to the engine process
    as token ids; its steps come back and become each request's outputs here."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tokenizer: Tokenizer,
                 metrics: RequestMetrics, gone: Callable[[], None]):
        self.reader, self.writer, self.metrics, self.gone = reader, writer, metrics, gone
        self.outputs = OutputProcessor(tokenizer)
        self.streams: dict[str, asyncio.Queue] = {}
        self.why_unavailable: str | None = None  # the engine process's word (a sleep, weights not loaded)
        self.closed = False  # the engine process left, or this one is stopping

    def unavailable(self) -> str | None:
        return self.why_unavailable

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       after: str | None = None) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate: the request's outputs as they come; closing the iterator early aborts it."""
        if self.closed:
            raise ShuttingDown("the server is shutting down: the request was not started")
        if why := self.why_unavailable:
            raise Unavailable(why)
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        arrival = time.monotonic()
        self.outputs.add(request_id, len(prompt_token_ids), params, arrival)
        self.send(("add", request_id, prompt_token_ids, params, after, arrival))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            self.streams.pop(request_id, None)
            self.outputs.drop(request_id)
            if not finished:
                self.send(("abort", request_id, "abort"))

    async def ready(self) -> bool:
        """Once the engine process serves (True), or closed the channel first (False: its start failed)."""
        return await read_message(self.reader) == ("ready",)

    def send(self, message: tuple) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame(message))

    async def read(self) -> None:
        """Until the engine process closes the channel (it exited: `gone`): its steps, made into the requests'
        outputs."""
        while (message := await read_message(self.reader)) is not None:
            if message[0] == "step":
                self.hand_out(message[1])
            elif message[0] == "error":
                _, request_id, kind, text, field = message
                self.outputs.drop(request_id)
                if (queue := self.streams.get(request_id)) is not None:
                    queue.put_nowait(InvalidRequest(text, field) if kind == "invalid" else REFUSALS[kind](text))
            elif message[0] == "unavailable":
                self.why_unavailable = message[1]
        self.closed = True
        self.gone()

    def hand_out(self, step: StepOutputs) -> None:
        outputs, stopped = self.outputs.process(step)
        for request_id in stopped:
            self.send(("abort", request_id, "stop"))
        for out in outputs:
            if (queue := self.streams.get(out.request_id)) is not None:
                queue.put_nowait(out)
        self.metrics.observe(outputs)

    async def shutdown(self) -> None:
        """Stop serving (SIGINT/SIGTERM): refuse new requests; those in flight end with finish reason "abort"."""
        self.closed = True
        for request_id in self.streams:
            self.send(("abort", request_id, "abort"))
        outputs = self.outputs.end_all("abort")
        for out in outputs:
            if (queue := self.streams.get(out.request_id)) is not None:
                queue.put_nowait(out)
        self.metrics.observe(outputs)


class _AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self.reader.read(max_bytes)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.writer.write(buffer)
        await self.writer.drain()

    async def aclose(self) -> None:
        self.writer.close()

    def get_extra_info(self, info: str):
        return self.writer.get_extra_info(info)


class _AsyncioUnixBackend(httpcore.AsyncNetworkBackend):
    """httpcore's connections to a Unix socket on asyncio's own streams. httpx's default (anyio's socket stream) waits
    for bytes with a reader callback that can set the result of a waiter already cancelled -- a client that leaves
    mid-relay while the engine's next bytes arrive in the same loop pass, likely on a loaded CPU -- and asyncio then
    prints an InvalidStateError traceback into the server's log (harmless, but a user reads it as a failure)."""

    async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options=None):
        return _AsyncioStream(*await asyncio.open_unix_connection(path))

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def engine_transport(engine_socket: str) -> httpx.AsyncHTTPTransport:
    """httpx's transport to the engine's Unix socket, on `_AsyncioUnixBackend` (httpx takes no backend argument: its
    pool's is set; an httpx without that pool fails here, at startup)."""
    transport = httpx.AsyncHTTPTransport(uds=engine_socket)
    transport._pool._network_backend = _AsyncioUnixBackend()
    return transport


def relay_to(engine_socket: str, gone: Callable[[], None]):
    """A route relaying any request to the engine process's app (on its Unix socket), its reply streamed back; the
    socket failing means the engine process is gone (`gone`)."""
    client = httpx.AsyncClient(transport=engine_transport(engine_socket), base_url="http://localhost", timeout=None)

    async def relay(request: Request, path: str):
        headers = {k: v for k, v in request.headers.items() if k.lower() in RELAYED_HEADERS}
        content = await request.body()
        try:
            upstream = await head_unless_gone(request, client.send(client.build_request(
                request.method, "/" + path, content=content, headers=headers, params=request.query_params),
                stream=True))
        except httpx.TransportError:
            gone()
            raise
        return Relayed(upstream) if isinstance(upstream, httpx.Response) else upstream

    return client, relay


async def connect(channel_socket, gone: Callable[[], None]) -> tuple[EngineChannel, dict] | None:
    """The channel once the engine process said hello (what it serves, the server's settings), or None when it
    closed the channel first or named no usable tokenizer (its start fails, and it says why). `gone`: what to do
    when it exits later."""
    reader, writer = await asyncio.open_unix_connection(sock=channel_socket)
    if (hello := await read_message(reader)) is None:
        return None
    hello = hello[1]
    try:
        tokenizer = Tokenizer.from_file(str(Path(hello["tokenizer_dir"]) / "tokenizer.json"))
    except Exception:  # the engine process's load names the missing or broken tokenizer
        return None
    return EngineChannel(reader, writer, tokenizer, RequestMetrics(hello["served_model_name"]), gone), hello


def build_api_app(channel: EngineChannel, hello: dict) -> FastAPI:
    """The public app: the OpenAI routes here, /metrics joined, the rest relayed to the engine process."""
    server, metrics = ServerConfig(**hello["server"]), channel.metrics
    model = ServedModel(channel.outputs.tokenizer, Path(hello["tokenizer_dir"]), hello["max_model_len"],
                        hello["vocab_size"])
    deps = ServerDeps(channel, model, hello["served_model_name"],
                      ChatTemplate(Path(hello["tokenizer_dir"]), server.chat_template))
    client, relay = relay_to(hello["engine_socket"], channel.gone)
    app = FastAPI(title="tsdev runtime")  # (/docs: the routes served here; the rest are relayed)
    app.add_middleware(BodyLimit, max_bytes=server.max_request_body_bytes)
    disabled = hello["disabled_routes"]
    app.add_middleware(Guard, policy=SecurityPolicy.of(server), disabled=disabled)  # last: runs first
    install_error_handlers(app)
    app.include_router(openai_router(deps))

    @app.get("/metrics")
    async def prometheus():
        engine = await client.get("/metrics")
        return Response(generate_latest(metrics.registry) + engine.content, media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/{path:path}", relay, methods=["GET", "POST", "PUT", "DELETE"])  # last: it matches any path
    app.state.channel = channel
    return app
