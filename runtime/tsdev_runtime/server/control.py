"""Control routes: reload_forward, pause/continue, prefix-cache flush, profiling, sleep/wake, reload_weights /
update_weights / weights_checksum, and the events stream (SSE). Each handler translates a request into a call of the
engine's control (`ae.control`: runtime/tsdev_runtime/engine/control.py) and its outcome into a reply.

Bodies, replies and events are tsdev_runtime.control_protocol's models, which the clients parse too.
"""
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tsdev_runtime.control_protocol import (COMPILE_AHEAD_ROUTE, CONTINUE_ROUTE, EVENTS_ROUTE, FLUSH_ROUTE,
                                            IS_SLEEPING_ROUTE, KERNEL_CHECK_ROUTE, MODULES_ROUTE, PAUSE_ROUTE,
                                            RELOAD_ROUTE, RELOAD_WEIGHTS_ROUTE, SLEEP_ROUTE, START_PROFILE_ROUTE,
                                            STOP_PROFILE_ROUTE, UPDATE_WEIGHTS_FROM_DISK_ROUTE, UPDATE_WEIGHTS_ROUTE,
                                            WAKE_UP_ROUTE, WEIGHTS_CHECKSUM_ROUTE, CompileAheadRequest, ContinueReply,
                                            ErrorBody, ErrorDetail, FlushReply, KernelCheckRequest, ModulesReply,
                                            PauseReply, PauseRequest, ProfileFinished, ProfileRequest, ProfileStarted,
                                            ReloadRequest, ReloadWeightsReply, ReloadWeightsRequest, SleepReply,
                                            SleepRequest, SleepStatus, UpdateWeightsRequest, WakeUpReply,
                                            WakeUpRequest, WeightsChecksumReply)
from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.control import CheckpointRefused, CheckRunning, EngineControl, LoadFailedMidway, WeightsAsleep
from tsdev_runtime.engine.errors import Unavailable
from tsdev_runtime.engine.profiler import RangeOpen
from tsdev_runtime.engine.sleep import overall_digest
from tsdev_runtime.server.errors import APIError
from tsdev_runtime.server.security import PathNotAllowed, SecurityPolicy
from tsdev_runtime.server.sse import sse_response

log = logging.getLogger("tsdev_runtime.server")
RELOAD_DISABLED = ("reload_forward is disabled on this server: start it with `tsdev serve --allow-reload-forward` "
                   "(for development: it runs code from disk), or use `tsdev watch`, which does")
# what --allow-reload-forward enables
RELOADS_ROUTES = (RELOAD_ROUTE, COMPILE_AHEAD_ROUTE, KERNEL_CHECK_ROUTE, MODULES_ROUTE)


async def _said(run: AsyncIterator) -> AsyncIterator:
    """A check's items as events, a failure as the last one (an ErrorBody: the 200 went out before it)."""
    try:
        async for item in run:
            yield item
    except CheckRunning as exc:  # another check began between this one's cases and its start
        yield ErrorBody(error=ErrorDetail(message=str(exc), code=409))
    except Unavailable as exc:  # the server is stopping
        yield ErrorBody(error=ErrorDetail(message=str(exc), type="server_error", code=503))
    except Exception as exc:
        log.exception("the kernel check failed")
        yield ErrorBody(error=ErrorDetail(message=f"internal error: {type(exc).__name__}: {exc} (see the server "
                                                  "log)", type="server_error", code=500))
    finally:
        await run.aclose()


def disabled_routes(reloads: bool) -> dict[str, str]:
    """The routes a server without --allow-reload-forward refuses (Guard's `disabled`), and why."""
    return {} if reloads else dict.fromkeys(RELOADS_ROUTES, RELOAD_DISABLED)


def control_router(ae: AsyncEngine, security: SecurityPolicy) -> APIRouter:
    """Reload, compile ahead, kernel checks, pause/continue, flush and the events stream. Who may call these is
    security's concern (runtime/tsdev_runtime/server/security.py): its Guard covers every path."""
    router, control = APIRouter(), ae.control

    def reloads() -> EngineControl:
        if control.reloader is None:
            raise APIError(403, RELOAD_DISABLED, None, "permission_error")
        return control

    @router.post(RELOAD_ROUTE)
    async def reload_route(body: ReloadRequest):
        return (await reloads().reload_forward(body)).dump()

    @router.post(COMPILE_AHEAD_ROUTE)
    async def compile_ahead(body: CompileAheadRequest):
        """An editor's unsaved buffer: the kernels its text changes built while serving, nothing reloaded. A syntax
        error in the text is a reply (`failed`), not an error: buffers are sent mid-edit."""
        try:
            path = security.code_path(body.path, reloads().buffers.roots())
        except PathNotAllowed as exc:
            raise APIError(400, str(exc), exc.param, "invalid_request_error") from None
        return (await control.compile_ahead(path, body.text, body.id)).dump()

    @router.post(KERNEL_CHECK_ROUTE)
    async def kernel_check(request: Request, body: KernelCheckRequest | None = None):
        """The declared kernels against their references at the serving shapes (`tsdev check`), one case at a time
        between requests (EngineControl.check_kernels). The client going away stops the check between two cases:
        a stream's end cancels it; the plain reply's route, which nothing cancels, looks for its client between
        two progress items."""
        body = body or KernelCheckRequest()
        try:
            cases = await reloads().kernel_check_cases(body)
        except ValueError as exc:
            raise APIError(400, str(exc), "ops") from None
        except CheckRunning as exc:
            raise APIError(409, str(exc), None, "invalid_request_error") from None
        run = reloads().check_kernels(cases)
        if body.stream:
            return sse_response(_said(run))
        try:
            async with aclosing(run):
                async for item in run:
                    if await request.is_disconnected():
                        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        except CheckRunning as exc:  # another check began between this one's cases and its start
            raise APIError(409, str(exc), None, "invalid_request_error") from None
        return item.dump()

    @router.get(MODULES_ROUTE)
    async def reloadable_modules():
        """The modules a reload may force (loaded, under the reloadable packages)."""
        return ModulesReply(modules=reloads().reloader.modules()).dump()

    @router.post(PAUSE_ROUTE)
    async def pause(body: PauseRequest | None = None):
        mode = (body or PauseRequest()).mode
        return PauseReply(mode=mode, aborted=await control.pause(mode)).dump()

    @router.post(CONTINUE_ROUTE)
    async def continue_generation():
        await control.continue_generation()
        return ContinueReply().dump()

    @router.post(FLUSH_ROUTE)
    async def flush_cache():
        await control.flush_prefix_cache()
        return FlushReply().dump()

    @router.get(EVENTS_ROUTE)
    async def events():
        return sse_response(ae.events())

    return router


def profile_router(ae: AsyncEngine, security: SecurityPolicy) -> APIRouter:
    """Start and stop a profile of the engine's steps, written under --profile-dir."""
    router = APIRouter()

    @router.post(START_PROFILE_ROUTE)
    async def start_profile(body: ProfileRequest | None = None):
        body = body or ProfileRequest()
        try:
            directory = security.profile_target(body.output_dir, body.name)  # confined to --profile-dir
        except PathNotAllowed as exc:
            raise APIError(400, str(exc), exc.param, "invalid_request_error") from None
        try:
            info = await ae.run_on_engine_thread(ae.profiler.start, body.activities, body.num_steps, str(directory),
                                                 body.name)
        except ValueError as exc:
            status = 409 if isinstance(exc, RangeOpen) else 400
            raise APIError(status, str(exc), None, "invalid_request_error") from None
        ae.publish(ProfileStarted(**dict(info)))
        return info.dump()

    @router.post(STOP_PROFILE_ROUTE)
    async def stop_profile():
        try:
            info = await ae.run_on_engine_thread(ae.profiler.stop)
        except ValueError as exc:
            raise APIError(400, str(exc), None, "invalid_request_error") from None
        ae.publish(ProfileFinished(**dict(info)))
        return info.dump()

    return router


def sleep_status(control: EngineControl) -> dict:
    memory = control.memory
    return dict(is_sleeping=memory.sleeping, level=memory.level, asleep=sorted(memory.asleep),
                weights_loaded=control.weights_loaded)


def weights_router(ae: AsyncEngine, security: SecurityPolicy) -> APIRouter:
    """vLLM's sleep mode and the weight reload (SGLang's /update_weights_from_disk too): each an operation of the
    engine's control (in its turn in the control lock; sleep and reload_weights drain first, as a reload does),
    translated."""
    router, control = APIRouter(), ae.control

    @router.post(SLEEP_ROUTE)
    async def sleep(body: SleepRequest | None = None):
        level = (body or SleepRequest()).level
        start = time.perf_counter()
        report = await control.sleep(level)
        if report is None:  # asleep already
            return SleepReply(**sleep_status(control)).dump()
        device_freed = None if report["free_after"] is None else report["free_after"] - report["free_before"]
        return SleepReply(**sleep_status(control), freed_bytes=report["freed"], device_freed_bytes=device_freed,
                          seconds=round(time.perf_counter() - start, 6)).dump()

    @router.post(WAKE_UP_ROUTE)
    async def wake_up(body: WakeUpRequest | None = None):
        start = time.perf_counter()
        woken, recapture = await control.wake_up((body or WakeUpRequest()).tags)
        return WakeUpReply(**sleep_status(control), woken=woken, recapture_seconds=round(sum(recapture.values()), 6),
                           seconds=round(time.perf_counter() - start, 6)).dump()

    @router.get(IS_SLEEPING_ROUTE)
    async def is_sleeping():
        return SleepStatus(**sleep_status(control)).dump()

    @router.post(RELOAD_WEIGHTS_ROUTE)
    async def reload_weights(body: ReloadWeightsRequest | None = None):
        return await load(ae, security, (body or ReloadWeightsRequest()).path, "direct", None)

    async def update_weights(body: UpdateWeightsRequest | None = None):
        body = body or UpdateWeightsRequest()
        return await load(ae, security, body.path, body.mode, body.id)

    router.post(UPDATE_WEIGHTS_ROUTE)(update_weights)
    router.post(UPDATE_WEIGHTS_FROM_DISK_ROUTE)(update_weights)  # SGLang's name and body ({"model_path"}); direct

    @router.get(WEIGHTS_CHECKSUM_ROUTE)
    async def weights_checksum():
        start = time.perf_counter()
        tensors = await control.weights_checksum()
        return WeightsChecksumReply(overall=overall_digest(tensors), tensors=tensors,
                                    seconds=round(time.perf_counter() - start, 6)).dump()

    return router


async def load(ae: AsyncEngine, security: SecurityPolicy, path_field: str | None, mode: str, update_id: str | None):
    """reload_weights and update_weights (`EngineControl.update_weights`), translated."""
    try:
        path = security.weight_path(path_field, ae.engine.model_dir) if path_field else ae.engine.model_dir
    except PathNotAllowed as exc:
        raise APIError(400, str(exc), exc.param, "invalid_request_error") from None
    try:
        update, seconds = await ae.control.update_weights(path, mode, update_id)
    except WeightsAsleep as exc:
        raise APIError(409, str(exc), None, "invalid_request_error") from None
    except CheckpointRefused as exc:  # before any weight changed
        raise APIError(400, f"{path}: {exc}", "path", "invalid_request_error") from None
    except LoadFailedMidway as exc:
        raise APIError(500, str(exc), None, "server_error") from None
    report = update.load
    graphs = (f"; graphs recaptured in {update.recapture_seconds:.2f} s" if update.recapture_seconds
              else "" if mode == "full" else "; in place, graphs kept")
    return ReloadWeightsReply(message=f"loaded {path} ({mode}): {report}{graphs}", path=str(path),
                              format=report.format, nbytes=report.nbytes, load_seconds=round(report.seconds, 6),
                              seconds=round(seconds, 6), mode=mode, id=update_id,
                              recapture_seconds=round(update.recapture_seconds, 6)).dump()
