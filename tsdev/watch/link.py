"""The daemon's calls to the server it watches, in the control protocol's types: the daemon decides, this
talks. Every call works against a seed-style server that lacks tsdev's extra routes (it falls back)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from tsdev_runtime.control_protocol import (COMPILE_AHEAD_ROUTE, EVENTS_ROUTE, MODULES_ROUTE, RELOAD_ROUTE,
                                      SERVER_INFO_ROUTE, START_PROFILE_ROUTE, UPDATE_WEIGHTS_ROUTE,
                                      CompileAheadReply, CompileAheadRequest, Event, ModulesReply,
                                      ProfileRequest, ReloadReply, ReloadWeightsReply, ServerInfo,
                                      UpdateWeightsRequest, parse_event)
from tsdev.client import aiter_sse_data, auth_headers, body, error_message, reload_request, reply_or_raise


@dataclass
class Described:
    model: str | None
    device: str | None
    vocab: int
    startup: dict[str, float] = field(default_factory=dict)  # where the server's start went (ServerInfo.startup)
    moments: dict[str, float] = field(default_factory=dict)  # when its parts began (ServerInfo.moments)


class ServerLink:
    def __init__(self, url: str, transport: httpx.AsyncBaseTransport | None = None, api_key: str | None = None):
        """`api_key`: the server's (tsdev serve --api-key), sent on every call, the checks' completions included."""
        self.url = url
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(60, read=None), transport=transport,
                                        headers=auth_headers(api_key))

    async def reachable(self) -> None:
        """Raises httpx.TransportError when nothing answers."""
        await self.client.get(self.url + "/health", timeout=5)

    async def describe(self) -> Described:
        """Model, device and vocabulary from GET /server_info; from /v1/models (no device) on a server
        without that route."""
        response = await self.client.get(self.url + SERVER_INFO_ROUTE)
        if response.status_code == 200:
            info = ServerInfo.model_validate_json(response.content)
            return Described(info.model, info.device, info.vocab_size, info.startup, info.moments)
        first = (await self.client.get(self.url + "/v1/models")).json()["data"][0]
        return Described(first.get("id"), None, int(first.get("vocab_size") or 256))

    async def server_info(self) -> ServerInfo | None:
        """GET /server_info; None when the server cannot say (it died, or lacks the route)."""
        try:
            response = await self.client.get(self.url + SERVER_INFO_ROUTE, timeout=5)
            return ServerInfo.model_validate_json(response.content) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def graphs_pending(self) -> int:
        """Graphs the server still captures after a (re)start or a reload (0 when it cannot say)."""
        info = await self.server_info()
        return info.graphs_pending if info is not None else 0

    async def capture_first(self) -> list[str]:
        """`tsdev serve` flags for a restart that captures before serving only the graphs this server has used
        since its last capture (the rest after); [] when it cannot say (it died, or lacks /server_info)."""
        info = await self.server_info()
        if info is None:
            return []
        flags = []
        for flag, sizes, used in (("--cudagraph-capture-first", info.decode_graph_sizes, info.decode_graphs_used),
                                  ("--prefill-graph-capture-first", info.prefill_graph_buckets,
                                   info.prefill_graphs_used)):
            if sizes:
                flags += [flag, ",".join(map(str, used or sizes[:1]))]
        return flags

    async def loaded(self, on_disk: list[str]) -> list[str]:
        """Of the modules on disk, those the server has imported (a reload can force only those)."""
        try:
            response = await self.client.get(self.url + MODULES_ROUTE)
        except httpx.HTTPError:
            return on_disk
        if response.status_code != 200:  # a server without the route: force them all and let it say
            return on_disk
        loaded = set(ModulesReply.model_validate_json(response.content).modules)
        return [m for m in on_disk if m in loaded]

    async def reload(self, request_id: str, modules: list[str] | None) -> ReloadReply:
        """Raises httpx errors, and RuntimeError for refusals."""
        request = reload_request(modules, request_id=request_id)
        return reply_or_raise(await self.client.post(self.url + RELOAD_ROUTE, json=body(request)), ReloadReply)

    async def compile_ahead(self, path: str, text: str, request_id: str) -> CompileAheadReply:
        """Build the kernels `text` of the file at `path` changes (nothing reloaded). Raises httpx errors, and
        RuntimeError for refusals."""
        request = CompileAheadRequest(path=path, text=text, id=request_id)
        return reply_or_raise(await self.client.post(self.url + COMPILE_AHEAD_ROUTE, json=body(request)),
                              CompileAheadReply)

    async def update_weights(self, path: str, update_id: str, mode: str = "direct") -> ReloadWeightsReply:
        """Raises httpx errors, and ErrorReply (a RuntimeError, with .status) for refusals."""
        request = UpdateWeightsRequest(path=path, mode=mode, id=update_id)
        return reply_or_raise(await self.client.post(self.url + UPDATE_WEIGHTS_ROUTE, json=body(request)),
                              ReloadWeightsReply)

    async def start_profile(self, name: str, num_steps: int) -> str | None:
        """Open a torch profiler range; None when it opened, else why not."""
        request = ProfileRequest(activities=["TORCH"], num_steps=num_steps, name=name)
        response = await self.client.post(self.url + START_PROFILE_ROUTE, json=body(request))
        if response.status_code == 404:
            return "this server has no /start_profile route: nothing profiled"
        if response.status_code != 200:
            return f"profiling refused: {error_message(response)}"
        return None

    async def events(self) -> AsyncIterator[Event]:
        """The server's events, forever: reconnects when the stream drops (a restart); skips unknown types."""
        while True:
            try:
                async with self.client.stream("GET", self.url + EVENTS_ROUTE) as response:
                    async for data in aiter_sse_data(response):
                        if (event := parse_event(data)) is not None:
                            yield event
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.5)

    async def aclose(self) -> None:
        await self.client.aclose()
