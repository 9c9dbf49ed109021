"""Control routes: reload_forward, pause/continue, prefix-cache flush, and the events stream (SSE)."""
import json
from typing import Literal

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from runtime.engine.async_engine import AsyncEngine
from runtime.engine.profiler import RangeOpen
from runtime.engine.reload_forward import ReloadForward, ReloadRequest

RELOAD_DISABLED = ("reload_forward is disabled on this server: start it with `tsdev serve --allow-reload-forward` "
                   "(for development: it runs code from disk), or use `tsdev watch`, which does")


class ReloadBody(BaseModel):
    id: str = Field(min_length=1)
    mode: Literal["wait", "abort"] = "wait"
    modules: list[str] | None = None
    timeout_s: float | None = Field(None, gt=0)


class ProfileBody(BaseModel):
    activities: list[str] = ["CUDA_PROFILER"]
    num_steps: int = Field(20, ge=1)
    output_dir: str | None = None
    name: str | None = None  # the range's name (the trace file's, for TORCH)


class PauseBody(BaseModel):
    mode: Literal["abort", "wait", "keep"] = "abort"


def add_control_routes(app: FastAPI, async_engine: AsyncEngine, reload_forward: ReloadForward | None,
                       api_error: type[Exception]) -> None:
    ae = async_engine

    @app.post("/v1/rl/engine/reload_forward")
    async def reload_route(body: ReloadBody):
        if reload_forward is None:
            raise api_error(403, RELOAD_DISABLED, None, "PermissionError")
        return await reload_forward(ReloadRequest(body.id, body.mode, body.modules, body.timeout_s))

    @app.get("/v1/rl/engine/modules")
    async def reloadable_modules():
        """The modules a reload may force (loaded, under the reloadable packages)."""
        if reload_forward is None:
            raise api_error(403, RELOAD_DISABLED, None, "PermissionError")
        return {"modules": reload_forward.reloader.modules()}

    @app.post("/v1/rl/engine/pause_generation")
    async def pause(body: PauseBody | None = None):
        mode = (body or PauseBody()).mode
        async with ae.control_lock:
            aborted = 0
            if mode == "abort":
                aborted = await ae.between_steps(lambda: ae.abort_all(running_only=False))
            elif mode == "wait":
                ae.hold(True)
                try:
                    await ae.wait_until_drained()
                finally:
                    ae.hold(False)
            ae.set_paused(True)
        ae.publish({"type": "paused", "mode": mode, "aborted": aborted})
        return {"paused": True, "mode": mode, "aborted": aborted}

    @app.post("/v1/rl/engine/continue_generation")
    async def continue_generation():
        if reload_forward is not None:
            reload_forward.cancel_pending()
        async with ae.control_lock:
            ae.set_paused(False)
        ae.publish({"type": "continued"})
        return {"paused": False}

    @app.post("/flush_cache")
    async def flush_cache():
        await ae.between_steps(ae.engine.block_manager.flush)
        return {"flushed": True}

    @app.post("/start_profile")
    async def start_profile(body: ProfileBody | None = None):
        body = body or ProfileBody()
        try:
            info = await ae.run_on_engine_thread(ae.profiler.start, body.activities, body.num_steps, body.output_dir, body.name)
        except ValueError as exc:
            status = 409 if isinstance(exc, RangeOpen) else 400
            raise api_error(status, str(exc), None, "invalid_request_error") from None
        ae.publish({"type": "profile_started", **info})
        return info

    @app.post("/stop_profile")
    async def stop_profile():
        try:
            info = await ae.run_on_engine_thread(ae.profiler.stop)
        except ValueError as exc:
            raise api_error(400, str(exc), None, "invalid_request_error") from None
        ae.publish({"type": "profile_finished", **info})
        return info

    @app.get("/v1/rl/engine/events")
    async def events():
        async def stream():
            yield f"data: {json.dumps({'type': 'hello', 'paused': ae.paused})}\n\n"
            async for event in ae.events():
                yield f"data: {json.dumps(event)}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")
