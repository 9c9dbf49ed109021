"""Runs the engine beside the HTTP front: one step at a time in a worker thread, so requests keep
arriving while the model computes. Changes to the engine's request set (add, abort) are queued and
applied between steps, so the engine itself is only ever touched by one thread at a time. Each step's token ids
become the requests' outputs (text, stop strings, logprobs) here, on the event loop, not on the engine's thread.

Control calls (pause, continue, reload, sleep, weights) are the engine's control's (`LLMEngine.control`,
runtime/tsdev_runtime/engine/control.py), which this loop serves as its `Loop` (steps.py): the engine's thread
between steps, the drain, the events. The control's phase gates the steps (paused: nothing is computed; holding: a
reload's drain, running requests finish, new ones wait in the queue without being admitted) and each change of phase
is an event (`StateChanged`).
"""
import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from tsdev_runtime.control_protocol import Event, Hello, ProfileFinished, ProfileRange, StateChanged
from tsdev_runtime.engine.errors import EngineError, ShuttingDown, Unavailable, stop_server
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.outputs import OutputProcessor, RequestOutput, StepOutputs
from tsdev_runtime.engine.profiler import StepProfiler
from tsdev_runtime.engine.sequence import SamplingParams

log = logging.getLogger("tsdev_runtime.server")


STOP_WAIT_S = 0.5  # how long a stopping server waits for the engine thread's call in progress before leaving it
SHUTDOWN_ABORT_S = 0.5  # how long shutdown waits for the engine loop to abort the requests itself
LOOP_CALL_S = 5.0  # how long the engine thread waits for a call it hands to the event loop's thread

# A graph a reload left for after it (15-35 ms on the H200) is captured whenever the engine is idle, and while it
# serves once every this many steps: the first requests after a reload run at full speed on the graphs it captured.
STEPS_PER_DEFERRED_CAPTURE = 32


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[float, list[RequestOutput]], None] | None = None):
        self.engine = engine
        self.on_step = on_step
        self.control = engine.control
        self.outputs = OutputProcessor(lambda: engine.tokenizer)  # the outputs of the requests of `generate`
        # where the outputs of requests added by `add_request` go (the API process: runtime/.../engine/channel.py)
        self.remote: Callable[[StepOutputs, dict[str, str] | None], None] | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._subscribers: set[asyncio.Queue] = set()
        self._commands: list[Callable[[], None]] = []
        self._wake: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None  # set by shutdown: calls waiting on the engine thread give up
        self._idle: asyncio.Future | None = None  # stop()'s: done once the engine thread is idle
        self._stepped: asyncio.Event | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine", initializer=engine.runner.prepare_thread)
        self._task: asyncio.Task | None = None
        self.profiler = StepProfiler(engine.config.device, on_main_thread=self._on_loop_thread)
        self._steps_since_capture = 0
        self.last_step_at = time.monotonic()  # when the last engine step ended (idle since then, if none runs)
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self.control.listeners.append(self._phase_moved)
        self.control.attach(self)  # the control's operations run their steps through this loop

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._wake, self._stepped, self._stopping = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._event_loop, self._loop_thread = asyncio.get_running_loop(), threading.current_thread()
        self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def shutdown(self) -> None:
        """Stop serving (SIGINT/SIGTERM): refuse new requests, abort those in flight (their streams end with
        finish reason "abort") and end every events stream, so that no open connection holds the server."""
        self.control.set(stopping=True)
        if self._stopping is not None:
            self._stopping.set()  # a control call in progress answers now (run_on_engine_thread)
        for queue in self._subscribers:
            queue.put_nowait(None)
        if self._task is not None and not self._task.done():
            aborting = asyncio.ensure_future(self.between_steps(lambda: self.abort_all(running_only=False)))
            await asyncio.wait({aborting}, timeout=SHUTDOWN_ABORT_S)
            if not aborting.done():  # the engine thread is busy (a control call): end the streams from here
                for queue in self._streams.values():
                    queue.put_nowait(ShuttingDown("the server is stopping: the request was aborted"))

    async def stop(self) -> None:
        """After shutdown: the loop ends; the engine thread's call in progress gets STOP_WAIT_S to finish, then is
        left behind (the process exits without it: a kernel check under the interpreter may run for minutes)."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._idle = self._on_engine_thread(lambda: None)  # runs once the call in progress returned
        self._executor.shutdown(wait=False)
        await asyncio.wait({self._idle}, timeout=STOP_WAIT_S)

    @property
    def left_behind(self) -> bool:
        """After stop(): the engine thread still runs a call (the process may exit without waiting for it)."""
        return self._idle is not None and not self._idle.done()

    async def run_on_engine_thread(self, fn: Callable, *args):
        """Run `fn` on the thread that steps the engine (CUDA work and engine state stay on one thread). Once the
        server is stopping its caller does not wait for it: ShuttingDown at once (the call goes on, unawaited)."""
        if self._stopping is None:
            return await self._on_engine_thread(fn, *args)
        if self._stopping.is_set():
            raise ShuttingDown("the server is stopping: the call was not run")
        call, stopping = self._on_engine_thread(fn, *args), asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({call, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the caller is cancelled (a `tsdev check` whose client went away): the call goes on
            stopping.cancel()
            if not call.done():
                call.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved: no log noise
        if not call.done():
            raise ShuttingDown("the server is stopping: the call in progress was left unfinished")
        return call.result()

    def _on_engine_thread(self, fn: Callable, *args) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _on_loop_thread(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the event loop's thread and wait for it (at most LOOP_CALL_S): from the engine thread, for
        what must run on the thread that imported torch (`tsdev serve` runs the loop there)."""
        loop = self._event_loop
        if loop is None or loop.is_closed() or threading.current_thread() is self._loop_thread:
            fn()
            return

        async def call() -> None:
            fn()

        with contextlib.suppress(TimeoutError):
            asyncio.run_coroutine_threadsafe(call(), loop).result(LOOP_CALL_S)

    # --- requests --------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       after: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; closing the iterator early aborts the request. `after`: the
        request whose prompt this one shares (LLMEngine.add_request)."""
        if refusal := self.refusal():
            raise refusal
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        arrival = time.monotonic()
        self.outputs.add(request_id, len(prompt_token_ids), params, arrival)
        self.add_request(request_id, prompt_token_ids, params, arrival, after, queue.put_nowait)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, ValueError):
                    finished = True
                    raise out
                if isinstance(out, EngineError):
                    raise out
                if isinstance(out, BaseException):
                    raise EngineError(f"the engine failed while running this request: {out}") from out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            self.outputs.drop(request_id)
            if not finished:
                self.abort(request_id)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: float,
                    after: str | None, refused: Callable[[ValueError], None]) -> None:
        """Queue a request to be added between steps; `refused` gets the error of one the engine refuses."""

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, arrival_time=arrival, after=after)
            except ValueError as exc:
                refused(exc)

        self._submit(add)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request between steps (`reason` "stop": its consumer found a stop string)."""
        self._submit(lambda: self.engine.abort(request_id, reason))

    async def between_steps(self, fn: Callable):
        """Run `fn` on the event loop between two engine steps (where engine state may change) and return its result."""
        future = asyncio.get_running_loop().create_future()

        def command() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        self._submit(command)
        return await future

    def abort_all(self, running_only: bool) -> int:
        """Abort requests (the running ones, or all) and tell their streams; run it via between_steps."""
        aborted = self.engine.abort_all(running_only)
        self._hand_out(aborted)
        return len(aborted.finished)

    def fail_all(self, error: EngineError) -> int:
        """Abort every request (running or waiting) and end its stream with `error`; run it via between_steps."""
        aborted = self.engine.abort_all(running_only=False)
        if self.remote is not None:
            self.remote(StepOutputs(), dict.fromkeys(aborted.finished, str(error)))
        for request_id in aborted.finished:
            self.outputs.drop(request_id)
            if (queue := self._streams.get(request_id)) is not None:
                queue.put_nowait(error)
        return len(aborted.finished)

    def unavailable(self) -> str | None:
        """Why requests are refused now (a sleep draining, sleeping, weights not loaded), else None."""
        return self.control.unavailable()

    def refusal(self) -> EngineError | None:
        """The error a new request gets now (the server stopping, or unavailable), else None."""
        if self.control.stopping:
            return ShuttingDown("the server is shutting down: the request was not started")
        return Unavailable(why) if (why := self.unavailable()) else None

    # --- what the control's operations ask of the loop -------------------------------------------

    def wake(self) -> None:
        """Look at the control's gates again (paused, holding moved)."""
        self._wake.set()

    async def wait_until_drained(self) -> None:
        """Return once no admitted request is left running (waiting ones stay queued)."""
        while not self.engine.drained() and not self.control.paused:
            self._stepped.clear()
            await self._stepped.wait()

    # --- events ----------------------------------------------------------------------------------

    def _phase_moved(self, phase: str) -> None:
        """The state's listener (on whichever thread changed it): a StateChanged event, published on the event loop
        (at once when the change happened there)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the engine thread: hand it to the loop the engine runs beside, while it runs
            if self._event_loop is not None and not self._event_loop.is_closed():
                self._event_loop.call_soon_threadsafe(self.publish, StateChanged(state=phase))
            return
        self.publish(StateChanged(state=phase))

    def publish(self, event: Event) -> None:
        """Send an event (stamped with the server clock) to every subscriber of `events()`."""
        event.time = time.time()
        for queue in self._subscribers:
            queue.put_nowait(event)

    async def events(self) -> AsyncIterator[Event]:
        """Every event published from now on, after a `Hello` with the state a new subscriber needs; the
        stream ends when the server shuts down."""
        if self.control.stopping:
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            yield Hello(paused=self.control.paused, sleeping=self.control.memory.sleeping, state=self.control.phase,
                        time=time.time())
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._subscribers.discard(queue)

    # --- the loop --------------------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        if self._wake:
            self._wake.set()

    def _can_step(self) -> bool:
        return not self.control.paused and self.control.cannot_step() is None and self.engine.can_step()

    async def _loop(self) -> None:
        while True:
            commands, self._commands = self._commands, []
            for command in commands:
                command()
            capturing = self._can_capture()
            if capturing and (not self._can_step() or self._steps_since_capture >= STEPS_PER_DEFERRED_CAPTURE):
                self._steps_since_capture = 0
                await self._on_engine_thread(self.control.capture_next)
            if not self._can_step():
                self._stepped.set()
                self._wake.clear()
                if not self._commands and not capturing:
                    await self._wake.wait()
                continue
            start = time.perf_counter()
            self._steps_since_capture += 1
            try:
                step, closed_range = await self._on_engine_thread(self._step)
            except Exception as exc:  # keep serving: end the request the step failed on, not the others
                if self.control.ranks is not None:  # ranks that may have stopped at different points are out of step
                    stop_server(f"FATAL: an engine step failed with {self.engine.config.world_size} tensor-parallel "
                                f"ranks ({type(exc).__name__}: {exc}); they cannot be brought back in step, so the "
                                "server stops (tsdev watch restarts it).")
                log.exception("engine step failed; running the requests in flight again one at a time to find "
                              "the one it fails on")
                await self._recover(exc)
                continue
            self.last_step_at = time.monotonic()
            outputs = self._hand_out(step)
            if closed_range:
                self.publish(ProfileFinished(**dict(closed_range)))
            self._stepped.set()
            if self.on_step:
                self.on_step(time.perf_counter() - start, outputs)

    def _can_capture(self) -> bool:
        """A graph left for after serving (re)started is pending (the control captures it, `capture_next`)."""
        return bool(self.engine.runner.graphs_pending) and self.control.phase == "serving"

    def _step(self) -> tuple[StepOutputs, ProfileRange | None]:
        outputs = self.engine.step()
        return outputs, self.profiler.after_step()

    def _hand_out(self, step: StepOutputs, failed: dict[str, str] | None = None) -> list[RequestOutput]:
        """The requests' outputs of a step, each to its stream (`failed`: requests that get an error instead);
        requests a stop string ended are ended in the engine before its next step."""
        if self.remote is not None:
            self.remote(step, failed)
            if not self.outputs.requests:  # (the API process's requests only: nothing per request here)
                return []
        outputs, stopped = self.outputs.process(step)
        for request_id in stopped:
            self.abort(request_id, "stop")
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if failed and out.request_id in failed:
                log.error("request %s aborted: its step fails when it runs alone: %s", out.request_id,
                          failed[out.request_id])
                out = EngineError(f"the engine failed on this request: {failed[out.request_id]}")
            if queue is not None:
                queue.put_nowait(out)
        return outputs

    async def _recover(self, exc: Exception) -> None:
        """LLMEngine.recover: the request a step fails on alone gets the error, the others their outputs."""
        try:
            step, failed = await self._on_engine_thread(self.engine.recover)
        except Exception:
            log.exception("running the requests alone failed too; aborting the requests in flight")
            self._fail_all(exc)
            return
        self._hand_out(step, failed)
        self._stepped.set()

    def _fail_all(self, exc: Exception) -> None:
        self.engine.in_flight = None  # the step in flight is forgotten: its requests are aborted
        for request_id, queue in list(self._streams.items()):
            self.engine.abort(request_id)
            self.outputs.drop(request_id)
            queue.put_nowait(exc)
        if self.remote is not None:  # the API process's requests
            aborted = self.engine.abort_all(running_only=False)
            self.remote(StepOutputs(), dict.fromkeys(aborted.finished, f"the engine failed: {exc}"))
