"""The control operations -- pause, continue, the prefix-cache flush, sleep, wake, a weight load, the checksum -- each
in its turn in the control lock, its sequence a list of steps (steps.py, as a reload's: run in order, what began
undone after a failure), and the events they publish. The HTTP handlers (runtime/tsdev_runtime/server/control.py)
only translate a request into a call here and its outcome into a reply."""
from __future__ import annotations

import time
from pathlib import Path

from tsdev_runtime.control_protocol import UPDATE_WEIGHTS_ROUTE, Awake, Continued, Paused, Sleeping, WeightsReloaded
from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.errors import Unavailable, describe_error
from tsdev_runtime.engine.llm_engine import CheckpointRefused, WeightsAsleep
from tsdev_runtime.engine.steps import Step, Steps


class LoadFailedMidway(RuntimeError):
    """A weight load failed after it began changing weights: the engine steps no more until a load succeeds."""


async def run_steps(steps: list[Step]) -> None:
    """Run `steps`; after a failure undo what began, then raise."""
    done = Steps()
    try:
        await done.run(steps)
    except BaseException as exc:
        await done.undo(describe_error(exc))
        raise


async def pause(ae: AsyncEngine, mode: str) -> int:
    """Stop scheduling: "abort" the requests in flight, "wait" for them, "keep" them (they resume on continue). The
    number aborted."""
    aborted = {"n": 0}

    async def abort() -> None:
        aborted["n"] = await ae.between_steps(lambda: ae.abort_all(running_only=False))

    async def hold() -> None:
        ae.set_paused(True)

    first = {"abort": [Step("abort", abort)], "wait": [Step("drain", ae.drain)]}.get(mode, [])
    async with ae.control_lock:
        await run_steps([*first, Step("pause", hold)])
    ae.publish(Paused(mode=mode, aborted=aborted["n"]))
    return aborted["n"]


async def continue_generation(ae: AsyncEngine, reload_forward=None) -> None:
    """Schedule again; a reload_forward waiting for the pause to end (`reload_forward` given) gives up first."""
    if reload_forward is not None:
        reload_forward.cancel_pending()

    async def resume() -> None:
        ae.set_paused(False)

    async with ae.control_lock:
        await run_steps([Step("continue", resume)])
    ae.publish(Continued())


async def flush_prefix_cache(ae: AsyncEngine) -> None:
    """Forget the cached prefixes, between two steps (not in the control lock: it changes no weights nor state)."""
    await ae.between_steps(ae.engine.flush_prefix_cache)


async def sleep(ae: AsyncEngine, level: int) -> dict | None:
    """Refuse new requests, drain the running ones, fail the queued, free the engine's memory at `level`; new
    requests are accepted again (and refused by the sleeping state) once it sleeps, or after a failure. The engine's
    report (freed bytes, device memory before and after), None when it sleeps already."""
    engine, report = ae.engine, {}

    async def refuse() -> None:
        ae.refuse("the server is going to sleep (POST /sleep): POST /wake_up once it sleeps to serve again")

    async def accept(_reason: str = "") -> None:
        ae.refuse(None)

    async def fail_queued() -> None:
        await ae.between_steps(lambda: ae.fail_all(Unavailable(
            "the server went to sleep (POST /sleep) before this request ran: POST /wake_up, then send it again")))

    async def free() -> None:
        report.update(await ae.run_on_engine_thread(engine.sleep, level))

    async with ae.control_lock:
        if engine.sleep_state.sleeping:  # asleep already: nothing more to free
            return None
        await run_steps([Step("refuse", refuse, accept), Step("drain", ae.drain), Step("fail queued", fail_queued),
                       Step("sleep", free), Step("accept", accept)])
    ae.publish(Sleeping(level=level, freed_bytes=report["freed"]))
    return report


async def wake_up(ae: AsyncEngine, tags: list[str] | None) -> tuple[bool, dict[str, float]]:
    """Give back the memory of `tags` (None: all); (whether anything woke, each graph kind's recapture seconds)."""
    engine, outcome = ae.engine, {}

    async def wake() -> None:
        outcome["woken"], outcome["recapture"] = await ae.run_on_engine_thread(engine.wake_up, tags)

    async with ae.control_lock:
        await run_steps([Step("wake", wake)])
    if outcome["woken"] and not engine.sleep_state.sleeping:
        ae.publish(Awake(weights_loaded=ae.state.weights_loaded))
    return outcome["woken"], outcome["recapture"]


async def load_weights(ae: AsyncEngine, path: Path, mode: str, update_id: str | None):
    """reload_weights and update_weights: drain, then `LLMEngine.update_weights`. WeightsAsleep, CheckpointRefused
    and NotImplementedError (refused before any weight changed) pass through; any other failure ends the queued
    requests (the engine steps no more until a load succeeds) and raises LoadFailedMidway saying what repairs it.
    Returns (the engine's update report, the call's seconds, its wait for its turn included)."""
    engine, outcome, start = ae.engine, {}, time.perf_counter()

    async def load() -> None:
        try:
            outcome["update"] = await ae.run_on_engine_thread(engine.update_weights, path, mode)
        except (WeightsAsleep, CheckpointRefused, NotImplementedError):
            raise
        except Exception as exc:
            why = (f"loading {path} failed midway ({type(exc).__name__}: {exc}); the engine runs no step and "
                   "requests get 503 until a weight load succeeds: the next full update (POST "
                   f"{UPDATE_WEIGHTS_ROUTE} {{\"mode\": \"full\"}}, or reload_weights) repairs it")
            await ae.between_steps(lambda: ae.fail_all(Unavailable(why)))  # not left hung behind a stopped engine
            raise LoadFailedMidway(why) from exc

    async with ae.control_lock:
        await run_steps([Step("drain", ae.drain), Step("load", load)])
    seconds = time.perf_counter() - start
    ae.publish(WeightsReloaded(path=str(path), seconds=round(seconds, 6), mode=mode, id=update_id))
    return outcome["update"], seconds


async def weights_checksum(ae: AsyncEngine) -> dict:
    """The served tensors' digests, in its turn (after an update sent before it)."""
    async with ae.control_lock:
        return await ae.run_on_engine_thread(ae.engine.weights_checksum, False)
