"""Control routes: reload_forward, pause/continue, prefix-cache flush, profiling, and the events stream (SSE).

Bodies, replies and events are runtime.control_protocol's models, which the clients parse too.
"""
from fastapi import FastAPI

from runtime.control_protocol import (CONTINUE_ROUTE, EVENTS_ROUTE, FLUSH_ROUTE, MODULES_ROUTE, PAUSE_ROUTE,
                                      RELOAD_ROUTE, START_PROFILE_ROUTE, STOP_PROFILE_ROUTE, Continued, ContinueReply,
                                      FlushReply, ModulesReply, Paused, PauseReply, PauseRequest, ProfileFinished,
                                      ProfileRequest, ProfileStarted, ReloadRequest)
from runtime.engine.async_engine import AsyncEngine
from runtime.engine.profiler import RangeOpen
from runtime.engine.reload_forward import ReloadForward
from runtime.server.security import PathNotAllowed, SecurityPolicy
from runtime.server.sse import sse_response

RELOAD_DISABLED = ("reload_forward is disabled on this server: start it with `tsdev serve --allow-reload-forward` "
                   "(for development: it runs code from disk), or use `tsdev watch`, which does")


def add_control_routes(app: FastAPI, async_engine: AsyncEngine, reload_forward: ReloadForward | None,
                       api_error: type[Exception], security: SecurityPolicy) -> None:
    """Who may call these is security's concern (runtime/server/security.py): its Guard covers every path."""
    ae = async_engine

    def reloads() -> ReloadForward:
        if reload_forward is None:
            raise api_error(403, RELOAD_DISABLED, None, "PermissionError")
        return reload_forward

    @app.post(RELOAD_ROUTE)
    async def reload_route(body: ReloadRequest):
        return (await reloads()(body)).dump()

    @app.get(MODULES_ROUTE)
    async def reloadable_modules():
        """The modules a reload may force (loaded, under the reloadable packages)."""
        return ModulesReply(modules=reloads().reloader.modules()).dump()

    @app.post(PAUSE_ROUTE)
    async def pause(body: PauseRequest | None = None):
        mode = (body or PauseRequest()).mode
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
        ae.publish(Paused(mode=mode, aborted=aborted))
        return PauseReply(mode=mode, aborted=aborted).dump()

    @app.post(CONTINUE_ROUTE)
    async def continue_generation():
        if reload_forward is not None:
            reload_forward.cancel_pending()
        async with ae.control_lock:
            ae.set_paused(False)
        ae.publish(Continued())
        return ContinueReply().dump()

    @app.post(FLUSH_ROUTE)
    async def flush_cache():
        await ae.between_steps(ae.engine.flush_prefix_cache)
        return FlushReply().dump()

    @app.post(START_PROFILE_ROUTE)
    async def start_profile(body: ProfileRequest | None = None):
        body = body or ProfileRequest()
        try:
            directory = security.profile_target(body.output_dir, body.name)  # confined to --profile-dir
        except PathNotAllowed as exc:
            raise api_error(400, str(exc), exc.param, "invalid_request_error") from None
        try:
            info = await ae.run_on_engine_thread(ae.profiler.start, body.activities, body.num_steps, str(directory),
                                                 body.name)
        except ValueError as exc:
            status = 409 if isinstance(exc, RangeOpen) else 400
            raise api_error(status, str(exc), None, "invalid_request_error") from None
        ae.publish(ProfileStarted(**dict(info)))
        return info.dump()

    @app.post(STOP_PROFILE_ROUTE)
    async def stop_profile():
        try:
            info = await ae.run_on_engine_thread(ae.profiler.stop)
        except ValueError as exc:
            raise api_error(400, str(exc), None, "invalid_request_error") from None
        ae.publish(ProfileFinished(**dict(info)))
        return info.dump()

    @app.get(EVENTS_ROUTE)
    async def events():
        return sse_response(ae.events())
