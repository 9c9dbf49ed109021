"""The HTTP app over an AsyncEngine, one router per concern (openai.py: generation and tokenizing; control.py: reloads,
pause, profiling, sleep and weights; here: what the server is), the error shape for every failure (errors.py), access
before anything else (security.py). Beside an API process (`api_channel`), the engine process's app: the OpenAI
routes are the API process's (api_process.py), which reaches this app's routes through a Unix socket only."""
import asyncio
import dataclasses
import logging
import os
import socket
import time
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tsdev_runtime.config import ServerConfig
from tsdev_runtime.control_protocol import SERVER_INFO_ROUTE, ServerInfo
from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.channel import EngineSide
from tsdev_runtime.engine.errors import stop_server
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.outputs import RequestOutput
from tsdev_runtime.engine.reload_forward import ForwardReloader
from tsdev_runtime.server.body_limit import BodyLimit
from tsdev_runtime.server.chat import ChatTemplate
from tsdev_runtime.server.control import control_router, disabled_routes, profile_router, weights_router
from tsdev_runtime.server.deps import ServedModel, ServerDeps
from tsdev_runtime.server.errors import APIError, install_error_handlers
from tsdev_runtime.server.metrics import EngineMetrics, RequestMetrics
from tsdev_runtime.server.openai import openai_router
from tsdev_runtime.server.security import Guard, SecurityPolicy

log = logging.getLogger("tsdev_runtime.server")


def server_version() -> str:
    try:
        return version("tsdev")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_app(engine: LLMEngine, served_model_name: str, reloader: ForwardReloader | None = None,
              max_request_body_bytes: int = ServerConfig.max_request_body_bytes,
              security: SecurityPolicy | None = None, chat_template: str | None = None,
              api_channel: socket.socket | None = None, startup: dict[str, float] | None = None,
              moments: dict[str, float] | None = None) -> FastAPI:
    """The app; `reloader` (a tsdev.hotreload.Reloader or alike) enables reload_forward, None refuses it (403).
    `security`: who may call what (API key, loopback-only control routes, profile and weight directories).
    `chat_template`: a jinja2 file to render chat prompts with instead of the checkpoint's own.
    `api_channel`: the engine process's end of the channel to an API process (which had its hello: tsdev/launch/serve.py
    `ApiProcess.hello`); it hears "ready" once this app runs.
    `startup`: where the start's seconds went (tsdev/launch/serve.py's `startup_parts`), for GET /server_info;
    `moments`: when its parts began (ServerInfo.moments), "serving" added as the app starts (before it answers).
    `app.state.async_engine.shutdown()` ends its requests and streams (what a server does on SIGTERM)."""
    metrics = EngineMetrics(engine, served_model_name)
    request_metrics = RequestMetrics(served_model_name) if api_channel is None else None

    def on_step(seconds: float, outputs: list[RequestOutput]) -> None:
        metrics.on_step(seconds)
        if request_metrics is not None:
            request_metrics.observe(outputs)

    async_engine = AsyncEngine(engine, on_step=on_step)  # the engine's control serves through it from now on
    control = engine.control
    if reloader is not None:
        control.allow_reloads(reloader)
    security = security or SecurityPolicy()
    disabled = disabled_routes(reloader is not None)
    deps, engine_side = None, None
    if api_channel is None:
        model = ServedModel(engine.tokenizer, engine.tokenizer_dir, engine.max_model_len,
                            engine.model_config.vocab_size)
        deps = ServerDeps(async_engine, model, served_model_name, ChatTemplate(engine.tokenizer_dir, chat_template))
    else:  # the API process applied the policy; this app answers it alone, on its Unix socket
        engine_side = EngineSide(async_engine, lambda: stop_server(
            "FATAL: the API process (the HTTP front) exited: the server stops (tsdev watch restarts it)."))
        security = dataclasses.replace(security, api_key=None, allow_remote_control=True,
                                       metrics_require_api_key=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.start()
        if moments is not None:
            moments["serving"] = time.time()
        timing = asyncio.create_task(control.time_when_idle()) if reloader is not None else None
        channel = asyncio.create_task(engine_side.serve(api_channel)) if engine_side is not None else None
        yield
        for task in (timing, channel):
            if task is not None:
                task.cancel()
        await async_engine.stop()
        if deps is not None:
            deps.close()

    app = FastAPI(title="tsdev runtime", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)
    app.add_middleware(Guard, policy=security, disabled=disabled)  # added last: runs first, before the body is read
    app.state.engine, app.state.async_engine, app.state.security = engine, async_engine, security
    app.include_router(control_router(async_engine, security))
    app.include_router(profile_router(async_engine, security))
    app.include_router(weights_router(async_engine, security))
    install_error_handlers(app)
    registries = (metrics.registry,) if request_metrics is None else (metrics.registry, request_metrics.registry)
    app.include_router(info_router(engine, served_model_name, registries, reloader is not None, startup or {},
                                   {} if moments is None else moments))
    if deps is not None:
        app.include_router(openai_router(deps))
    return app


def info_router(engine: LLMEngine, name: str, registries: tuple[CollectorRegistry, ...], reloads: bool,
                startup: dict[str, float], moments: dict[str, float]) -> APIRouter:
    """What the server is: health, the served model, its version and state (and where its start went), Prometheus
    metrics. With reloads allowed, /health and /load also name the `tsdev check` under way (`kernel_check`: the engine
    is busy with it between requests) and the reloads waiting for their turn (`reloads_waiting`)."""
    router, created, control = APIRouter(), int(time.time()), engine.control

    def busy() -> dict:
        if not reloads:
            return {}
        check, waiting = control.checking, control.reloads_waiting
        return {**({"kernel_check": check.dump()} if check is not None else {}),
                **({"reloads_waiting": waiting} if waiting else {})}

    @router.get("/health")
    async def health():
        return {"status": "ok", **busy()}

    @router.get("/ping")
    @router.post("/ping")
    async def ping():  # vLLM's (SageMaker's) liveness probe: 200, no body
        return Response(status_code=200)

    @router.get("/load")
    async def load():  # vLLM's: the requests the server holds now (running and waiting), and a check as one more
        stats, check = engine.stats(), busy()
        return {"server_load": stats.running + stats.waiting + len(check), **check}

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "tsdev", "max_model_len": engine.max_model_len,
                                            "vocab_size": engine.model_config.vocab_size}]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise APIError(404, f"the model {model_id!r} does not exist: this server serves {name!r}", "model",
                           "not_found_error")
        return (await models())["data"][0]

    @router.get("/version")
    async def server_version_route():
        return {"version": server_version()}

    @router.get(SERVER_INFO_ROUTE)
    async def server_info():
        return ServerInfo(model=name, allow_reload_forward=reloads, pid=os.getpid(), state=control.phase,
                          startup=startup, moments=moments, **dict(engine.describe())).dump()

    @router.get("/metrics")
    async def prometheus():
        return Response(b"".join(map(generate_latest, registries)), media_type=CONTENT_TYPE_LATEST)

    return router
