"""The old code's times a reload's kernel check compares against are taken while the server is idle, one call at a
time, not inside a reload before its pause (where the first edit of the norm ops waited 1.9 s on the H200)."""
import pytest
import asyncio

from tsdev_runtime.engine import control as engine_control
from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev.hotreload import Reloader


@pytest.mark.slow
def test_idle_timing_takes_one_call_at_a_time_only_while_nothing_runs_and_ends(make_engine, monkeypatch):
    monkeypatch.setattr(engine_control, "IDLE_TIMING_GAP_S", 0.01)
    monkeypatch.setattr(engine_control, "IDLE_BEFORE_TIMING_S", 0.05)
    engine = make_engine()
    seen = []

    async def scenario():
        ae = AsyncEngine(engine)
        await ae.start()
        control = engine.control
        control.allow_reloads(Reloader(["tsdev_kernels.ops"]))
        pending = [True] * 5 + [False]

        def time_one(serving):
            seen.append((engine.stats().running, engine.in_flight is None, control.lock.locked()))  # (idle: no step)
            return pending.pop(0)

        control.checker.time_one_pending = time_one
        streams = [ae.generate(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(3)]
        timing = asyncio.create_task(control.time_when_idle())
        for stream in streams:
            async for _ in stream:
                pass
        await asyncio.wait_for(timing, 10)  # it ends once every op is timed
        await ae.stop()

    asyncio.run(scenario())
    assert len(seen) == 6
    assert all(running == 0 and idle and locked for running, idle, locked in seen), seen  # never beside a request


@pytest.mark.slow
@pytest.mark.parametrize("every_look_in_a_gap", [False, True])
def test_requests_in_a_row_are_never_joined_by_a_timing_call(make_engine, monkeypatch, every_look_in_a_gap):
    """A benchmark's requests come one after another with short gaps between them: the timing waits for the engine to
    have been idle IDLE_BEFORE_TIMING_S, so none of its calls lands between two of them -- also when each of its looks
    happens to fall in a gap (a slow machine's CI did that: the requests came and went between two looks)."""
    import time

    monkeypatch.setattr(engine_control, "IDLE_TIMING_GAP_S", 0.01)
    monkeypatch.setattr(engine_control, "IDLE_BEFORE_TIMING_S", 0.3)
    engine = make_engine()
    calls, last_request_end = [], []

    async def scenario():
        ae = AsyncEngine(engine)
        await ae.start()
        control = engine.control
        control.allow_reloads(Reloader(["tsdev_kernels.ops"]))
        control.checker.time_one_pending = lambda serving: calls.append(time.monotonic()) or len(calls) < 3
        if every_look_in_a_gap:
            monkeypatch.setattr(engine, "drained", lambda: True)
        timing = asyncio.create_task(control.time_when_idle())
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < 1.0:  # one request after another, a few ms apart
            async for _ in ae.generate(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)):
                pass
            i += 1
            await asyncio.sleep(0.02)
        last_request_end.append(time.monotonic())
        await asyncio.wait_for(timing, 10)
        await ae.stop()

    asyncio.run(scenario())
    assert len(calls) == 3 and min(calls) > last_request_end[0], (calls, last_request_end)
