"""What the server is doing now, in one object (`LLMEngine.state`): the control flags, the phase they make, and the
listeners told when it moves (the events stream). Every change goes through `EngineState.set` (sleep and wake
change the memory, then call `changed`).

The phase is the first of these that holds:
* stopping -- shutting down: no new request, no new events subscriber;
* sleeping -- the weights' and the KV pool's memory freed (POST /sleep): POST /wake_up;
* weights_unloaded -- the weights were discarded (a level-2 sleep, a weight update that failed midway): load them;
* paused -- the user's pause (POST /pause_generation): nothing is computed;
* holding -- a reload, a weight load or a sleep draining: running requests finish, new ones wait in the queue
  (a sleep's drain refuses new ones instead: `refusing` says why);
* serving.
"""
from __future__ import annotations

from collections.abc import Callable

from tsdev_runtime.control_protocol import Phase
from tsdev_runtime.engine.sleep import SleepState

FIELDS = ("paused", "holding", "stopping", "refusing", "weights_loaded")


class EngineState:
    def __init__(self, memory: SleepState):
        self.paused = False
        self.holding = False
        self.stopping = False
        self.refusing: str | None = None  # why new requests are refused while a sleep drains
        self.weights_loaded = True  # False after a level-2 sleep, or a weight update that failed midway, until a load
        self.memory = memory  # what is asleep (rank 0's runner's: every rank's is the same)
        self.listeners: list[Callable[[Phase], None]] = []  # told when the phase moves
        self.watchers: list[Callable[[], None]] = []  # told of every change (why requests are refused may change)
        self._phase: Phase = self.phase

    @property
    def phase(self) -> Phase:
        if self.stopping:
            return "stopping"
        if self.memory.sleeping:
            return "sleeping"
        if not self.weights_loaded:
            return "weights_unloaded"
        if self.paused:
            return "paused"
        return "holding" if self.holding or self.refusing else "serving"

    def set(self, **changes) -> None:
        """Change flags (FIELDS) and tell the listeners if the phase moved."""
        for name, value in changes.items():
            if name not in FIELDS:
                raise AttributeError(f"{name!r} is not an engine state flag ({', '.join(FIELDS)})")
            setattr(self, name, value)
        self.changed()

    def changed(self) -> None:
        for watcher in self.watchers:
            watcher()
        phase = self.phase
        if phase != self._phase:
            self._phase = phase
            for listener in self.listeners:
                listener(phase)

    def unavailable(self) -> str | None:
        """Why new requests are refused now (a sleep draining, or `cannot_step`), else None."""
        return self.refusing or self.cannot_step()

    def cannot_step(self) -> str | None:
        """Why the engine cannot compute now (sleeping, weights not loaded), else None."""
        if self.memory.sleeping:
            return (f"the server is sleeping (POST /sleep, level {self.memory.level}; asleep: "
                    f"{', '.join(sorted(self.memory.asleep))}): POST /wake_up to serve again")
        if not self.weights_loaded:
            return ("the weights were discarded (POST /sleep level 2, or a weight update that failed between its begin "
                    "and finish) and not loaded since: POST /v1/rl/engine/update_weights {\"mode\": \"full\"} (or "
                    "/v1/rl/engine/reload_weights) to load them")
        return None
