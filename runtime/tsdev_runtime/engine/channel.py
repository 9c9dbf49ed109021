"""The engine process's end of the channel to the API process (the messages: runtime/tsdev_runtime/engine/wire.py)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.outputs import StepOutputs
from tsdev_runtime.engine.wire import frame, kind_of, read_message


class EngineSide:
    """Serves the channel from the engine process's event loop: adds and aborts go to the AsyncEngine between steps,
    every step's StepOutputs go out as they are (`AsyncEngine.remote`). `on_closed` runs when the API process
    closed its end (it exited): the engine process stops."""

    def __init__(self, async_engine: AsyncEngine, on_closed: Callable[[], None]):
        self.ae, self.on_closed = async_engine, on_closed
        self.writer: asyncio.StreamWriter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._said_unavailable: str | None = None

    async def serve(self, sock) -> None:
        self.loop = asyncio.get_running_loop()
        reader, self.writer = await asyncio.open_unix_connection(sock=sock)
        self.ae.remote = self.hand_out
        self.ae.control.watchers.append(self._state_changed)
        self.send(("ready",))
        self._said_unavailable = self.ae.unavailable()
        self.send(("unavailable", self._said_unavailable))
        try:
            while (message := await read_message(reader)) is not None:
                if message[0] == "add":
                    self._add(*message[1:])
                elif message[0] == "abort":
                    self.ae.abort(message[1], message[2])
        finally:
            self.ae.remote = None
            self.ae.control.watchers.remove(self._state_changed)
            if not self.ae.control.stopping:  # the API process exited
                self.on_closed()

    def _add(self, request_id: str, prompt_token_ids: list[int], params, after: str | None, arrival: float) -> None:
        if refusal := self.ae.refusal():
            self.refuse(request_id, refusal)
            return
        self.ae.add_request(request_id, prompt_token_ids, params, arrival, after,
                            lambda exc: self.refuse(request_id, exc))

    def refuse(self, request_id: str, exc: BaseException) -> None:
        self.send(("error", request_id, kind_of(exc), str(exc), getattr(exc, "field", None)))

    def hand_out(self, step: StepOutputs, failed: dict[str, str] | None) -> None:
        """A step's outputs, to the API process; the requests that failed in it first (their error, not the abort the
        step shows for them, ends their streams)."""
        for request_id, why in (failed or {}).items():
            self.send(("error", request_id, "failed", why, None))
        if step.request_ids or step.finished or step.prompt_logprobs:
            self.send(("step", step))

    def send(self, message: tuple) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(frame(message))

    def _state_changed(self) -> None:
        """The state's watcher (on whichever thread changed it): the API process learns why requests are refused."""
        self.loop.call_soon_threadsafe(self._say_unavailable)

    def _say_unavailable(self) -> None:
        if (why := self.ae.unavailable()) != self._said_unavailable:
            self._said_unavailable = why
            self.send(("unavailable", why))
