"""A transaction of steps: each runs in turn and is timed; after a failure, `undo` undoes the steps begun (the one
that failed too), last first. A reload of the forward pass is one (runtime/tsdev_runtime/engine/reload_forward.py): its
steps are listed in the order they run, and what a failure undoes is read off the same list.

A step's undo must hold wherever its run stopped; one that raises is reported and the others still run. The last
step may be a point of no return (a reload's commit), whose failure is not undone. A step with no run is a guard: it
only adds an undo at its place in the order (what must be undone after the later steps' undos, e.g. graphs recaptured
once the code is restored).

The steps of a control operation run through the step loop serving the engine (`Loop`, which AsyncEngine is): the
engine's thread between two steps, the drain, the events. A Protocol, so that the operations (control.py,
reload_forward.py) never import the loop, which imports the engine, which builds the control.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from tsdev_runtime.control_protocol import Event
from tsdev_runtime.engine.errors import EngineError, describe_error


@dataclass
class Step:
    name: str  # its key in `Steps.timings` and its events
    run: Callable[[], Awaitable[None]] | None = None
    undo: Callable[[str], Awaitable[None]] | None = None  # given why the transaction failed
    started: Callable[[], dict] | None = None  # more fields of its "started" event


class Steps:
    def __init__(self, on_event: Callable[[str, str, dict], None] = lambda name, state, fields: None):
        """`on_event(name, state, fields)`: state "started" (fields: the step's `started`), "done" or "failed"
        (fields: seconds). `timings` is the one place a transaction's seconds are kept: the steps', and what
        `timed` and `record` add."""
        self.on_event = on_event
        self.timings: dict[str, float] = {}
        self.current = "read"  # the step running, or the last one run
        self.begun: list[Step] = []

    async def run(self, steps: Iterable[Step]) -> None:
        for step in steps:
            self.begun.append(step)
            if step.run is None:
                continue
            self.current, start = step.name, time.perf_counter()
            self.on_event(step.name, "started", step.started() if step.started else {})
            try:
                await step.run()
            except BaseException:
                self._ended(step.name, start, "failed")
                raise
            self._ended(step.name, start, "done")

    async def undo(self, reason: str) -> list[str]:
        """Undo every step begun, last first (each undo sees `reason`). An undo that raises does not stop the ones
        after it (the guards' among them); returns what failed, 'step: error' each (empty: all undone)."""
        begun, self.begun = self.begun, []
        failures = []
        for step in reversed(begun):
            if step.undo is not None:
                try:
                    await step.undo(reason)
                except Exception as exc:
                    failures.append(f"{step.name}: {describe_error(exc)}")
        return failures

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time a part that is not a step of its own (a step's sub-part, the pause around the steps) into `timings`,
        however it ends."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = time.perf_counter() - start

    def record(self, name: str, seconds: float) -> None:
        """A figure measured elsewhere (a compile pool's slowest compile, each graph kind's capture)."""
        self.timings[name] = seconds

    def _ended(self, name: str, start: float, state: str) -> None:
        seconds = time.perf_counter() - start
        self.timings[name] = seconds
        self.on_event(name, state, {"seconds": seconds})


async def run_steps(steps: list[Step]) -> None:
    """Run `steps`; after a failure undo what began, then raise."""
    done = Steps()
    try:
        await done.run(steps)
    except BaseException as exc:
        await done.undo(describe_error(exc))
        raise


class Loop(Protocol):
    """What a control operation asks of the step loop serving the engine (AsyncEngine)."""
    last_step_at: float  # when the last engine step ended (time.monotonic())

    async def between_steps(self, fn: Callable):
        """Run `fn` on the event loop between two engine steps and return its result."""

    async def run_on_engine_thread(self, fn: Callable, *args):
        """Run `fn` on the thread that steps the engine."""

    async def wait_until_drained(self) -> None:
        """Return once no admitted request is left running (waiting ones stay queued)."""

    def wake(self) -> None:
        """Look at the engine's state again (a gate moved)."""

    def publish(self, event: Event) -> None:
        """Send an event to every subscriber of the events stream."""

    def abort_all(self, running_only: bool) -> int:
        """Abort requests (the running ones, or all) and tell their streams; via between_steps."""

    def fail_all(self, error: EngineError) -> int:
        """Abort every request and end its stream with `error`; via between_steps."""
