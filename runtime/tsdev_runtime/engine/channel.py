"""The engine process's end of the channel to the API process (docs/architecture.md, "Two processes").

One stream socket (a socketpair made before the API process started: nobody else holds it) carries pickled
messages, each behind its 4-byte length. The API process sends requests in and aborts:

    ("add", request_id, prompt_token_ids, params, after, arrival_time)    ("abort", request_id, reason)

and the engine process sends, besides a first ("hello", facts) with what the routes read of the model:

    ("step", StepOutputs)          one message per step: token ids, finishes, raw logprobs -- no text
    ("error", request_id, kind, message, field)    a request refused or failed (kind: REFUSALS' keys)
    ("unavailable", why)           why new requests are refused now (None: they are not), at every phase change

Everything per request (detokenizing, stop strings, logprob objects, usage, JSON, SSE) is the API process's.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import struct
from collections.abc import Callable

from tsdev_runtime.engine.async_engine import AsyncEngine, EngineError, ShuttingDown, Unavailable
from tsdev_runtime.engine.outputs import StepOutputs
from tsdev_runtime.engine.sequence import InvalidRequest

log = logging.getLogger("tsdev_runtime.server")
LENGTH = struct.Struct("!I")
# an error's kind on the wire -> the exception the API process raises in the request's stream
# (the most specific first: ShuttingDown is an Unavailable, which is an EngineError)
REFUSALS = {"invalid": InvalidRequest, "stopping": ShuttingDown, "unavailable": Unavailable, "failed": EngineError}


def kind_of(exc: BaseException) -> str:
    return next((kind for kind, cls in REFUSALS.items() if isinstance(exc, cls)), "failed")


def frame(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> tuple | None:
    """The next message, or None once the other side closed the socket."""
    try:
        length, = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        return pickle.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


class EngineSide:
    """Serves the channel from the engine process's event loop: adds and aborts go to the AsyncEngine between steps,
    every step's StepOutputs go out as they are (`AsyncEngine.remote`). `on_closed` runs when the API process
    closed its end (it exited): the engine process stops."""

    def __init__(self, async_engine: AsyncEngine, facts: dict, on_closed: Callable[[], None]):
        self.ae, self.facts, self.on_closed = async_engine, facts, on_closed
        self.writer: asyncio.StreamWriter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sock) -> None:
        self.loop = asyncio.get_running_loop()
        reader, self.writer = await asyncio.open_unix_connection(sock=sock)
        self.ae.remote = self.hand_out
        self.ae.state.listeners.append(self._phase_moved)
        self.send(("hello", self.facts))
        self.send(("unavailable", self.ae.unavailable()))
        try:
            while (message := await read_message(reader)) is not None:
                if message[0] == "add":
                    self._add(*message[1:])
                elif message[0] == "abort":
                    self.ae.abort(message[1], message[2])
        finally:
            self.ae.remote = None
            self.ae.state.listeners.remove(self._phase_moved)
            if not self.ae.state.stopping:
                log.error("the API process closed its channel (it exited): the server stops")
                self.on_closed()

    def _add(self, request_id: str, prompt_token_ids: list[int], params, after: str | None, arrival: float) -> None:
        refusal = (ShuttingDown("the server is shutting down: the request was not started") if self.ae.state.stopping
                   else Unavailable(why) if (why := self.ae.unavailable()) else None)
        if refusal is not None:
            self.refuse(request_id, refusal)
            return
        self.ae.add_request(request_id, prompt_token_ids, params, arrival, after,
                            lambda exc: self.refuse(request_id, exc))

    def refuse(self, request_id: str, exc: BaseException) -> None:
        self.send(("error", request_id, kind_of(exc), str(exc), getattr(exc, "field", None)))

    def hand_out(self, step: StepOutputs, failed: dict[str, str] | None) -> None:
        """A step's outputs (and the requests that failed in it, with why), to the API process."""
        if step.request_ids or step.finished or step.prompt_logprobs:
            self.send(("step", step))
        for request_id, why in (failed or {}).items():
            self.send(("error", request_id, "failed", why, None))

    def send(self, message: tuple) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(frame(message))

    def _phase_moved(self, phase: str) -> None:
        """The state's listener (on whichever thread moved it): the API process learns why requests are refused."""
        self.loop.call_soon_threadsafe(lambda: self.send(("unavailable", self.ae.unavailable())))
