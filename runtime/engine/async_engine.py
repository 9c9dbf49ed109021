"""Runs the engine beside the HTTP front: one step at a time in a worker thread, so requests keep
arriving while the model computes. Changes to the engine's request set (add, abort) are queued and
applied between steps, so the engine itself is only ever touched by one thread at a time.
"""
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from runtime.engine.llm_engine import LLMEngine, RequestOutput
from runtime.engine.sequence import SamplingParams

log = logging.getLogger("runtime.server")


class EngineError(RuntimeError):
    """The engine failed while running a request; the request was aborted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[float, list[RequestOutput]], None] | None = None):
        self.engine = engine
        self.on_step = on_step
        self._streams: dict[str, asyncio.Queue] = {}
        self._commands: list[Callable[[], None]] = []
        self._wake: asyncio.Event | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; closing the iterator early aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt_token_ids, params)
            except ValueError as exc:
                queue.put_nowait(exc)

        self._submit(add)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, ValueError):
                    finished = True
                    raise out
                if isinstance(out, BaseException):
                    raise EngineError(f"the engine failed while running this request: {out}") from out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort(request_id))

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        if self._wake:
            self._wake.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            commands, self._commands = self._commands, []
            for command in commands:
                command()
            if not self.engine.has_unfinished():
                self._wake.clear()
                if not self._commands:
                    await self._wake.wait()
                continue
            start = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:  # keep serving: fail the requests in flight, not the server
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_all(exc)
                continue
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            if self.on_step:
                self.on_step(time.perf_counter() - start, outputs)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, queue in list(self._streams.items()):
            self.engine.abort(request_id)
            queue.put_nowait(exc)
