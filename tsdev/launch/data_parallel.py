"""`tsdev serve --dp N`: N engine replicas behind one HTTP front.

Each replica is a `tsdev serve` of its own (with `--tp M`, M ranks of its own) on a free loopback port, given
GPUs [i*M, (i+1)*M) of the visible ones, its output in a log file of its own (`replica_log`). The front binds the
public address, applies the same security policy as a single server, and:

* sends each completion (and chat completion) to the replica with the fewest requests outstanding from the
  front (ties: the lowest index), relaying the reply (a stream chunk by chunk) as it comes;
* sends each control call (reload, pause/continue, flush, sleep/wake, weight loads, profiling) to every replica
  at once. While a reload, a weight load or a sleep runs, new completions wait at the front: none reaches a
  replica before every replica has the new code or weights. A reload's reply lists every replica's workers,
  their `rank` numbered across replicas (replica * M + rank); another call answers with the first failure,
  else replica 0's reply. `continue_generation` reaches every replica, so a reload that has not started yet is
  cancelled everywhere;
* answers /metrics with every replica's metrics, labelled `replica`, and /health with 200 only when every
  replica is healthy; other GET routes (models, server info, events, checksums) are replica 0's.
"""
from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from tsdev_runtime.control_protocol import (CONTINUE_ROUTE, FLUSH_ROUTE, PAUSE_ROUTE, RELOAD_ROUTE,
                                      RELOAD_WEIGHTS_ROUTE, SLEEP_ROUTE, START_PROFILE_ROUTE, STOP_PROFILE_ROUTE,
                                      UPDATE_WEIGHTS_FROM_DISK_ROUTE, UPDATE_WEIGHTS_ROUTE, WAKE_UP_ROUTE, ErrorBody,
                                      ErrorDetail, ReloadReply)
from tsdev_runtime.config import ServerConfig
from tsdev_runtime.server.relay import Relayed
from tsdev.launch.child import PortInUse, ServerProcess, StartFailed
from tsdev.launch.serve import BACKLOG, GRACEFUL_SHUTDOWN_S, claim_address, quiet_server_class

COMPLETION_ROUTES = ("/v1/completions", "/v1/chat/completions")
HOLDING_ROUTES = (RELOAD_ROUTE, RELOAD_WEIGHTS_ROUTE, UPDATE_WEIGHTS_ROUTE, UPDATE_WEIGHTS_FROM_DISK_ROUTE, SLEEP_ROUTE)
FAN_OUT_ROUTES = (*HOLDING_ROUTES, PAUSE_ROUTE, CONTINUE_ROUTE, FLUSH_ROUTE, WAKE_UP_ROUTE, START_PROFILE_ROUTE,
                  STOP_PROFILE_ROUTE)
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
FLAGS_WITH_VALUES = ("--dp", "--data-parallel-size", "--host", "--port")


def replica_args(serve_args: Sequence[str]) -> list[str]:
    """`tsdev serve`'s arguments for a replica: the front's, without the data parallelism and the address."""
    out, skip = [], False
    for arg in serve_args:
        if skip:
            skip = False
        elif arg in FLAGS_WITH_VALUES:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in FLAGS_WITH_VALUES)):
            out.append(arg)
    return out


def replica_gpus(replica: int, tp: int) -> dict[str, str]:
    """The environment that gives replica `replica` its `tp` GPUs of those visible to the front."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(_device_count())]
    mine = ids[replica * tp : (replica + 1) * tp]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)} if mine else {}


def _device_count() -> int:
    import torch

    return torch.cuda.device_count()


def merge_metrics(texts: Sequence[str]) -> bytes:
    """Every replica's Prometheus exposition as one, each sample labelled with its replica."""
    families: dict[str, Metric] = {}
    for replica, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "replica": str(replica)}, s.value, s.timestamp, s.exemplar)

    class Merged:
        def collect(self):
            return families.values()

    return generate_latest(Merged())


def merge_reloads(replies: Sequence[ReloadReply], tp: int) -> ReloadReply:
    """One reply: every replica's workers, ranks numbered across the replicas."""
    workers = [w.model_copy(update={"rank": replica * tp + w.rank})
               for replica, reply in enumerate(replies) for w in reply.workers]
    return ReloadReply.of(replies[0].id, workers)


class Front:
    """The data-parallel front's state: the replicas, how many requests each runs, and whether requests may go
    out (not while a reload, a weight load or a sleep runs on the replicas)."""

    def __init__(self, urls: Sequence[str], tp: int, client: httpx.AsyncClient | None = None):
        self.urls, self.tp = list(urls), tp
        self.client = client or httpx.AsyncClient(timeout=None)
        self.outstanding = [0] * len(urls)
        self.accepting = asyncio.Event()
        self.accepting.set()
        self.holders = 0

    async def complete(self, request: Request):
        """A generating request, relayed to the replica with the fewest outstanding."""
        body = await request.body()  # before waiting: a slow upload holds no replica's slot
        await self.accepting.wait()
        replica = min(range(len(self.urls)), key=lambda i: (self.outstanding[i], i))
        self.outstanding[replica] += 1

        def done() -> None:
            self.outstanding[replica] -= 1

        try:
            upstream = await self.client.send(self.client.build_request(
                "POST", self.urls[replica] + request.url.path, content=body, headers=forwarded(request),
                params=request.query_params), stream=True)
        except BaseException:
            done()
            raise
        return Relayed(upstream, done)

    async def fan_out(self, request: Request):
        """A control call, sent to every replica (holding new requests meanwhile if it is a HOLDING_ROUTE)."""
        body, headers, path = await request.body(), forwarded(request), request.url.path
        holding = path in HOLDING_ROUTES
        if holding:
            self.holders += 1
            self.accepting.clear()
        try:
            replies = await asyncio.gather(*(self.client.post(url + path, content=body, headers=headers,
                                                              params=request.query_params) for url in self.urls),
                                           return_exceptions=True)
        finally:
            if holding:
                self.holders -= 1
                if self.holders == 0:
                    self.accepting.set()
        unreachable = [(i, r) for i, r in enumerate(replies) if isinstance(r, Exception)]
        if unreachable:
            message = "; ".join(f"replica {i} ({self.urls[i]}): {type(r).__name__}: {r}" for i, r in unreachable)
            error = ErrorDetail(message=f"{path} did not reach every replica ({message}); the others answered",
                                type="server_error", param=None, code=502)
            return JSONResponse(ErrorBody(error=error).dump(), 502)
        if path == RELOAD_ROUTE and all(r.status_code == 200 for r in replies):
            merged = merge_reloads([ReloadReply.model_validate_json(r.content) for r in replies], self.tp)
            return JSONResponse(merged.model_dump(mode="json"))
        reply = next((r for r in replies if r.status_code >= 400), replies[0])
        return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))

    async def health(self):
        replies = await asyncio.gather(*(self.client.get(url + "/health") for url in self.urls),
                                       return_exceptions=True)
        down = [i for i, r in enumerate(replies) if isinstance(r, Exception) or r.status_code != 200]
        if down:
            return JSONResponse({"status": "unavailable", "replicas_down": down}, 503)
        return {"status": "ok", "replicas": len(self.urls)}

    async def metrics(self, request: Request):
        replies = await asyncio.gather(*(self.client.get(url + "/metrics", headers=forwarded(request))
                                         for url in self.urls))
        failed = next((r for r in replies if r.status_code != 200), None)
        if failed is not None:  # e.g. 401 under --metrics-require-api-key without the key
            return Response(failed.content, failed.status_code, media_type=failed.headers.get("content-type"))
        return Response(merge_metrics([r.text for r in replies]), media_type=CONTENT_TYPE_LATEST)

    async def first_replica(self, request: Request, path: str):
        """Routes that need no fan-out (models, server info, events, checksums): replica 0's, streamed."""
        upstream = await self.client.send(self.client.build_request(
            request.method, f"{self.urls[0]}/{path}", content=await request.body(), headers=forwarded(request),
            params=request.query_params), stream=True)
        return Relayed(upstream)


def forwarded(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def build_front(urls: Sequence[str], tp: int, client: httpx.AsyncClient | None = None) -> FastAPI:
    """The front's app over replicas at `urls` (`client`: how it reaches them; tests pass a mock transport)."""
    app = FastAPI(title="tsdev data-parallel front", docs_url=None, redoc_url=None)
    front = Front(urls, tp, client)
    for path in COMPLETION_ROUTES:
        app.add_api_route(path, front.complete, methods=["POST"])
    for path in FAN_OUT_ROUTES:
        app.add_api_route(path, front.fan_out, methods=["POST"])
    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/metrics", front.metrics, methods=["GET"])
    app.add_api_route("/{path:path}", front.first_replica, methods=["GET", "POST"])  # last: it matches any path
    return app


def run_front(server: ServerConfig, dp: int, tp: int, serve_args: Sequence[str], console: Console) -> int:
    """Bind the front's address, start the replicas, serve until SIGINT/SIGTERM, stop the replicas. Exit status as
    `tsdev serve`'s: 2 when the address or a replica cannot start."""
    from tsdev_runtime.server.body_limit import BodyLimit
    from tsdev_runtime.server.security import Guard, SecurityPolicy

    sock = claim_address(server, console)
    if sock is None:
        return 2
    args, port = replica_args(serve_args), sock.getsockname()[1]
    replicas = [ServerProcess(args, api_key=server.api_key, env=replica_gpus(i, tp), log_path=replica_log(port, i))
                for i in range(dp)]
    with sock:
        try:
            with console.status(f"starting {dp} replicas..."):
                for replica in replicas:
                    replica.start(f"starting replica {replicas.index(replica)}")
                asyncio.run(_all_healthy(replicas))
        except (StartFailed, PortInUse) as exc:
            console.print(f"[red]error:[/red] a replica did not start: {exc}")
            _stop(replicas)
            return 2
        except KeyboardInterrupt:
            _stop(replicas)
            console.print("stopped before the server started")
            return 130
        app = build_front([r.url for r in replicas], tp)
        app.add_middleware(BodyLimit, max_bytes=server.max_request_body_bytes)
        app.add_middleware(Guard, policy=SecurityPolicy.of(server))
        sock.listen(BACKLOG)

        def started() -> None:
            console.print(f"{dp} replicas at {', '.join(r.url for r in replicas)} (their output: "
                          f"{', '.join(str(r.log_path) for r in replicas)})\n"
                          f"listening on [bold]http://{server.host}:{port}[/bold] (OpenAI API under /v1)")

        async def nothing_to_stop() -> None:
            pass

        config = uvicorn.Config(app, log_level=server.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        try:
            quiet_server_class(uvicorn.Server)(config, started, nothing_to_stop).run(sockets=[sock])
        finally:
            _stop(replicas)
    return 0


def replica_log(port: int, replica: int) -> Path:
    """Where replica `replica` of the front on `port` writes its output: its banner, its spinner and its own
    `listening on` line stay off the front's output, whose `listening on` line (the front's address) is the one a
    script waits for, and the last."""
    return Path(tempfile.gettempdir()) / f"tsdev-dp-{port}-replica-{replica}.log"


async def _all_healthy(replicas: Sequence[ServerProcess]) -> None:
    await asyncio.gather(*(r.wait_healthy_async() for r in replicas))


def _stop(replicas: Sequence[ServerProcess]) -> None:
    for replica in replicas:
        replica.stop()
