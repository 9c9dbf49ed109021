"""The engine's one owner of control (`LLMEngine.control`): what the server is doing now, the lock that gives the
control calls their turns, the calls every rank makes, and every operation that pauses serving -- pause and continue,
the prefix-cache flush, sleep and wake, weight loads, reload_forward and its graph recapture, the graphs captured after
serving resumed, the kernel checks between requests. `LLMEngine` keeps the requests and the steps; the step loop
(`AsyncEngine`, the `Loop` of steps.py) lends the operations the engine's thread between two steps.

What the server is doing now is one phase, the first of these that holds:
* stopping -- shutting down: no new request, no new events subscriber;
* sleeping -- the weights' and the KV pool's memory freed (POST /sleep): POST /wake_up;
* weights_unloaded -- the weights were discarded (a level-2 sleep, a weight update that failed midway): load them;
* paused -- the user's pause (POST /pause_generation): nothing is computed;
* holding -- a reload, a weight load or a sleep draining: running requests finish, new ones wait in the queue
  (a sleep's drain refuses new ones instead: `refusing` says why);
* serving.
Every flag changes through `set` (sleep and wake change the memory, then call `changed`); the listeners hear the phase
move (the events' StateChanged), the watchers every change (why requests are refused may change).

Each operation is its turn in `lock` (one control call at a time, in arrival order) and a list of steps (steps.py: run
in order, what began undone after a failure); a reload's steps are reload_forward.py's `Reload`. The HTTP handlers
(runtime/tsdev_runtime/server/control.py) only translate. The halves that run on the engine's thread with nothing
running (`free_memory`, `restore_memory`, `load_weights`, `checksum`, `capture_graphs`) are what offline callers
(tests, benchmarks, the weights drill) call directly.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tsdev_kernels import checks
from tsdev_runtime import distributed
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.control_protocol import (UPDATE_WEIGHTS_ROUTE, Awake, CompileAheadReply, Continued,
                                            KernelCheckProgress, KernelCheckReply, KernelCheckRequest, Paused, Phase,
                                            ReloadReply, ReloadRequest, Sleeping, WeightsReloaded, WorkerReport)
from tsdev_runtime.engine.buffers import BufferCompiles
from tsdev_runtime.engine.compiles import COMPILES
from tsdev_runtime.engine.errors import Unavailable
from tsdev_runtime.engine.kernel_checks import KernelChecker, reported as reported_checks, serving_of, why_off
from tsdev_runtime.engine.model_runner import ModelRunner
from tsdev_runtime.engine.ranks import DrivenRunner, RankedReloader, RankLedger, rank_entries
from tsdev_runtime.engine.reload_forward import ForwardReloader, Reload, worker_report
from tsdev_runtime.engine.sleep import WEIGHTS, weights_checksum
from tsdev_runtime.engine.steps import Loop, Step, run_steps
from tsdev_runtime.weights.loader import LoadReport

log = logging.getLogger("tsdev_runtime.server")  # `tsdev serve` prints its info lines on stderr

FLAGS = ("paused", "holding", "stopping", "refusing", "weights_loaded")
UPDATE_MODES = ("direct", "full")
REMEMBERED_IDS = 256  # reload ids whose outcome a repeat of the id gets
IDLE_BEFORE_TIMING_S = 0.3  # how long the engine must have been idle before time_when_idle takes a call
IDLE_TIMING_GAP_S = 0.02  # between two of time_when_idle's calls: a request that arrives waits for one call at most
CHECK_WAIT_REPORT_S = 1.0  # a check waiting for requests says so this often (the plain reply's route looks for its
#                            client between two items; a stream's client sees it is alive)


class WeightsAsleep(RuntimeError):
    """A weight load while the weights are asleep: wake them first."""


class CheckpointRefused(ValueError):
    """A weight load refused before anything changed: no checkpoint there, or one that does not fit the model."""


class LoadFailedMidway(RuntimeError):
    """A weight load failed after it began changing weights: the engine steps no more until a load succeeds."""


class CheckRunning(Exception):
    """A `tsdev check` runs already: one at a time (the HTTP layer answers 409)."""


@dataclass(frozen=True)
class WeightUpdate:
    """What `load_weights` did: the load, the mode, tensors viewed back to their checkpoint layout, recapture."""
    load: LoadReport
    mode: str
    relaid: int = 0
    recapture_seconds: float = 0.0


class EngineControl:
    """Owns the phase's flags, the lock, the rank-wide runner (`ranked`, `ranks`), the weights served, the step loop
    it serves through (`loop`), the reloader and the kernel checker with what their calls leave between them; every
    operation below is its turn in `lock`. The engine keeps the requests and the steps; what one rank keeps for itself
    (its graphs, what is asleep) stays with its runner, the only thing the other ranks have."""

    def __init__(self, engine: Any, runner: ModelRunner):
        """`engine`: the LLMEngine whose requests the operations drain (it builds this, so it is not imported here);
        `runner`: this rank's runner, what it reads or does alone."""
        self.engine, self.runner = engine, runner
        self.config: EngineConfig = engine.config
        self.ranks: RankLedger | None = None  # tensor parallelism: every rank's outcome of the calls fanned out
        self.ranked: ModelRunner | DrivenRunner = runner  # the calls every rank makes (ranks.RANK_CALLS, launch, ...)
        if distributed.initialized():
            self.ranks = RankLedger()
            self.ranked = DrivenRunner(runner, self.ranks)
        self.weights_dir: Path = engine.model_dir  # where the weights now served came from (an update changes it)
        # the phase's flags (`set`) and who hears it move
        self.paused = self.holding = self.stopping = False
        self.refusing: str | None = None  # why new requests are refused while a sleep drains
        self.weights_loaded = True  # False after a level-2 sleep, or a weight update that failed midway, until a load
        self.memory = runner.sleep_state  # what is asleep (this rank's; every rank's is the same)
        self.listeners: list[Callable[[Phase], None]] = []  # told when the phase moves
        self.watchers: list[Callable[[], None]] = []  # told of every change (why requests are refused may change)
        self._phase: Phase = self.phase
        self.attach(None)

    def attach(self, loop: Loop | None) -> None:
        """The step loop that serves the engine from now on (AsyncEngine does this): a new lock, no reloader
        (`allow_reloads`), nothing remembered of an earlier loop's reloads, checks and deferred captures."""
        self.loop, self.lock = loop, asyncio.Lock()
        self.reloader: ForwardReloader | None = None  # None: reload_forward and kernel checks refused
        self.buffers: BufferCompiles | None = None  # editors' unsaved buffers built ahead (with the reloader)
        self.checker: KernelChecker | None = None
        self.checks_off: str | None = None  # why the kernel checks cannot run here
        self.outcomes: OrderedDict[str, asyncio.Future[ReloadReply]] = OrderedDict()  # by reload id
        self.reloads = 0  # reloads run (their events' `n`)
        self.reloads_waiting = 0  # reload calls waiting for their turn (continue_generation cancels them)
        self.cancel_epoch = 0
        self.checking: KernelCheckProgress | None = None  # the `tsdev check` under way, where it is
        self.deferred_seconds, self.deferred_count = 0.0, 0  # graphs captured after a reload resumed serving

    def allow_reloads(self, reloader: ForwardReloader) -> None:
        """reload_forward and the kernel checks through `reloader` (`--allow-reload-forward`); with several ranks every
        rank reloads the bytes rank 0 read. ValueError when --kernel-check strict cannot hold here."""
        checker, checks_off = KernelChecker(self.config.kernel_check), why_off(str(self.runner.device))
        if checks_off and checker.mode == "strict":
            raise ValueError(f"--kernel-check strict cannot hold: {checks_off}")
        if checks_off and checker.mode == "report":
            log.warning("%s", checks_off)
        self.checker, self.checks_off = checker, checks_off
        self.reloader = RankedReloader(reloader, self.ranks) if self.ranks is not None else reloader
        self.buffers = BufferCompiles(self)

    def close(self) -> None:
        """Let the other ranks of a tensor-parallel engine go (they exit); nothing to do with one rank."""
        if self.ranks is not None:
            self.ranked.stop()
            self.ranks = None

    @property
    def load_report(self) -> LoadReport:
        """How the weights served came in: read (how fast), or handed over by the server this one replaced."""
        return self.runner.load_report

    def offer_weights(self, listener) -> str:
        """As the server stops for a restart (after `close`): its weights to the standby that takes over
        (`ModelRunner.offer_weights`, runtime/tsdev_runtime/weights/handover.py); what happened, in words."""
        return self.runner.offer_weights(listener, self.weights_loaded)

    # --- the phase ------------------------------------------------------------------------------

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
        """Change flags (FLAGS) and tell the listeners if the phase moved."""
        for name, value in changes.items():
            if name not in FLAGS:
                raise AttributeError(f"{name!r} is not an engine state flag ({', '.join(FLAGS)})")
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

    # --- the gates and the drain ----------------------------------------------------------------

    def hold(self, on: bool) -> None:
        """While holding, waiting requests are not admitted (they stay queued, not rejected), and no deferred graph
        is captured (a reload, a weight load or a sleep holds: the engine thread is theirs)."""
        self.set(holding=on)
        self.loop.wake()

    async def drain(self) -> None:
        """Hold new requests and let the admitted ones finish (on a paused server they stay as they are), then
        admit again: what pause's mode wait, sleep and a weight load do before they go on."""
        self.hold(True)
        try:
            await self.loop.wait_until_drained()
        finally:
            self.hold(False)

    # --- pause, continue, flush -----------------------------------------------------------------

    async def pause(self, mode: str) -> int:
        """Stop scheduling: "abort" the requests in flight, "wait" for them, "keep" them (they resume on continue). The
        number aborted."""
        loop, aborted = self.loop, {"n": 0}

        async def abort() -> None:
            aborted["n"] = await loop.between_steps(lambda: loop.abort_all(running_only=False))

        async def stop() -> None:
            self.set(paused=True)
            loop.wake()

        first = {"abort": [Step("abort", abort)], "wait": [Step("drain", self.drain)]}.get(mode, [])
        async with self.lock:
            await run_steps([*first, Step("pause", stop)])
        loop.publish(Paused(mode=mode, aborted=aborted["n"]))
        return aborted["n"]

    async def continue_generation(self) -> None:
        """Schedule again; reloads waiting for the pause to end give up first."""
        self.cancel_epoch += 1

        async def resume() -> None:
            self.set(paused=False)
            self.loop.wake()

        async with self.lock:
            await run_steps([Step("continue", resume)])
        self.loop.publish(Continued())

    async def flush_prefix_cache(self) -> None:
        """Forget the cached prefixes, between two steps (not in the lock: it changes no weights nor state): KV
        computed by other code (or other weights) is not reused."""
        await self.loop.between_steps(self.engine.block_manager.flush)

    # --- sleep and wake -------------------------------------------------------------------------

    async def sleep(self, level: int) -> dict | None:
        """Refuse new requests, drain the running ones, fail the queued, free the engine's memory at `level`; new
        requests are accepted again (and refused by the sleeping state) once it sleeps, or after a failure.
        `free_memory`'s report, None when it sleeps already."""
        loop, report = self.loop, {}

        async def refuse() -> None:
            self.set(refusing="the server is going to sleep (POST /sleep): POST /wake_up once it sleeps to serve again")

        async def accept(_reason: str = "") -> None:
            self.set(refusing=None)

        async def fail_queued() -> None:
            await loop.between_steps(lambda: loop.fail_all(Unavailable(
                "the server went to sleep (POST /sleep) before this request ran: POST /wake_up, then send it again")))

        async def free() -> None:
            report.update(await loop.run_on_engine_thread(self.free_memory, level))

        async with self.lock:
            if self.memory.sleeping:  # asleep already: nothing more to free
                return None
            await run_steps([Step("refuse", refuse, accept), Step("drain", self.drain),
                             Step("fail queued", fail_queued), Step("sleep", free), Step("accept", accept)])
        loop.publish(Sleeping(level=level, freed_bytes=report["freed"]))
        return report

    async def wake_up(self, tags: list[str] | None) -> tuple[bool, dict[str, float]]:
        """Give back the memory of `tags` (None: all); (whether anything woke, each graph kind's recapture seconds)."""
        outcome = {}

        async def wake() -> None:
            outcome["woken"], outcome["recapture"] = await self.loop.run_on_engine_thread(self.restore_memory, tags)

        async with self.lock:
            await run_steps([Step("wake", wake)])
        if outcome["woken"] and not self.memory.sleeping:
            self.loop.publish(Awake(weights_loaded=self.weights_loaded))
        return outcome["woken"], outcome["recapture"]

    def free_memory(self, level: int) -> dict[str, int | None]:
        """Free the device memory of the weights (kept in host memory at level 1, discarded at level 2), the KV
        pool and the CUDA graphs, on every rank. Nothing may be running. Returns bytes freed (`freed`), and device
        free memory before and after (`free_before`, `free_after`; None off CUDA), rank 0's."""
        if self.engine.has_unfinished():
            raise RuntimeError("requests are still queued or running: drain them before sleeping")
        self.engine.block_manager.flush()  # the KV pool is discarded
        info = self.ranked.sleep(level)
        self.set(weights_loaded=self.weights_loaded and level == 1)  # level 2 discards them
        return info

    def restore_memory(self, tags: list[str] | None = None) -> tuple[list[str], dict[str, float]]:
        """Take back the memory of `tags` (weights, kv_cache; default both); once both are back, recapture the
        graphs (their addresses changed). Returns the tags woken and the recapture's seconds per graph kind."""
        woken_and_recapture = self.ranked.wake_up(tags)
        self.changed()
        return woken_and_recapture

    # --- weights --------------------------------------------------------------------------------

    async def update_weights(self, path: Path, mode: str, update_id: str | None) -> tuple[WeightUpdate, float]:
        """reload_weights and update_weights: drain, then `load_weights`. WeightsAsleep, CheckpointRefused and
        NotImplementedError (refused before any weight changed) pass through; any other failure ends the queued
        requests (the engine steps no more until a load succeeds) and raises LoadFailedMidway saying what repairs it.
        Returns (the load's report, the call's seconds, its wait for its turn included)."""
        loop, outcome, start = self.loop, {}, time.perf_counter()

        async def load() -> None:
            try:
                outcome["update"] = await loop.run_on_engine_thread(self.load_weights, path, mode)
            except (WeightsAsleep, CheckpointRefused, NotImplementedError):
                raise
            except Exception as exc:
                why = (f"loading {path} failed midway ({type(exc).__name__}: {exc}); the engine runs no step and "
                       "requests get 503 until a weight load succeeds: the next full update (POST "
                       f"{UPDATE_WEIGHTS_ROUTE} {{\"mode\": \"full\"}}, or reload_weights) repairs it")
                await loop.between_steps(lambda: loop.fail_all(Unavailable(why)))  # not hung behind a stopped engine
                raise LoadFailedMidway(why) from exc

        async with self.lock:
            await run_steps([Step("drain", self.drain), Step("load", load)])
        seconds = time.perf_counter() - start
        loop.publish(WeightsReloaded(path=str(path), seconds=round(seconds, 6), mode=mode, id=update_id))
        return outcome["update"], seconds

    def load_weights(self, path: Path | None = None, mode: str = "direct") -> WeightUpdate:
        """Load the checkpoint at `path` (default: the served model's) into the existing parameters, on every rank
        (`direct` with no path: reload_weights).

        begin: check that it fits and that every tensor's storage can hold its cold-start checkpoint layout (else
        CheckpointRefused, nothing changed), view re-laid-out tensors back, flush the prefix cache; from here until
        finish the engine refuses to step (`unavailable`). load: the loader (pinned on CUDA) writes in place.
        finish: the post-load hooks rerun into the same storage (fp8 scales, rotary tables). `direct` keeps every
        address, so the CUDA graphs stay as captured; `full` releases the graphs first and recaptures them after.
        A load that fails after begin (on any rank) leaves the weights marked not loaded until an update succeeds."""
        if mode not in UPDATE_MODES:
            raise ValueError(f"mode {mode!r}: use {' or '.join(UPDATE_MODES)}")
        if WEIGHTS in self.memory.asleep:
            raise WeightsAsleep(f"the weights are asleep (level {self.memory.level}): POST /wake_up (tags "
                                f"[\"{WEIGHTS}\"]) first, then load them")
        path = Path(path or self.engine.model_dir)
        try:
            relaid = self.ranked.begin_update(path)  # refuses before touching anything
        except (OSError, ValueError) as exc:
            raise CheckpointRefused(f"{type(exc).__name__}: {exc}") from exc
        self.engine.block_manager.flush()  # KV computed with other weights is not reused
        self.set(weights_loaded=False)  # until every rank's load succeeded
        report, recapture = self.ranked.load_update(path, mode)
        self.set(weights_loaded=True)
        self.weights_dir = path
        return WeightUpdate(report, mode, relaid, recapture)

    async def weights_checksum(self) -> dict[str, str]:
        """The served tensors' digests, in its turn (after an update sent before it)."""
        async with self.lock:
            return await self.loop.run_on_engine_thread(self.checksum, False)

    def checksum(self, derived: bool = True) -> dict[str, str]:
        """name -> sha256 of every parameter and buffer; `derived=False`: parameters and persistent buffers only
        (what a checkpoint fills, in their runtime layout: GET /v1/rl/engine/weights_checksum)."""
        if self.ranks is not None:
            raise NotImplementedError(f"weights_checksum is not available with tensor parallelism (--tp "
                                      f"{distributed.size()}) yet: serve with --tp 1 for it")
        return weights_checksum(self.runner.model, derived)

    # --- graphs ---------------------------------------------------------------------------------

    def capture_graphs(self, strict: bool = True, deferring: bool = False) -> dict[str, dict[int, float]]:
        """(Re)capture the decode, then the prefill graphs: seconds per batch size / token bucket, by kind.
        `strict`: a prefill capture failure raises (a reload) instead of leaving prefill eager. `deferring` (a
        reload, unless --full-recapture): only the graphs the steps used since the last capture now; the others
        are pending (`capture_next`, between steps once serving resumed) and run eagerly until captured."""
        first = self.runner.used_graphs() if deferring and not self.config.full_recapture else None
        return self.ranked.capture_graphs(strict, first)

    def capture_next(self) -> dict[str, dict[int, float]]:
        """Capture one graph left for after serving (re)started (by a reload, or a start told to capture some first),
        on every rank: {kind: {size: seconds}}; one that fails stays eager. The last one logs how long they all
        took. The step loop calls it between steps (when, is its business)."""
        start = time.perf_counter()
        try:
            captured = self.ranked.capture_next()
        except Exception as exc:  # that size stays eager; serving goes on
            log.warning("capturing a deferred CUDA graph failed (%s: %s); that size runs eagerly",
                        type(exc).__name__, exc)
            captured = {}
        self.deferred_seconds += time.perf_counter() - start
        self.deferred_count += sum(map(len, captured.values()))
        if not self.runner.graphs_pending:
            if self.config.device.startswith("cuda"):  # (on the CPU the same bookkeeping captures nothing)
                log.info("captured the %d graph(s) left for after serving resumed in %.2f s", self.deferred_count,
                         self.deferred_seconds)
            self.deferred_seconds, self.deferred_count = 0.0, 0
        return captured

    # --- reload_forward -------------------------------------------------------------------------

    async def reload_forward(self, request: ReloadRequest) -> ReloadReply:
        """Reload once per id: the same id again returns the first outcome (waiting for it if needed)."""
        if request.id in self.outcomes:
            return await asyncio.shield(self.outcomes[request.id])
        outcome = asyncio.get_running_loop().create_future()
        self.outcomes[request.id] = outcome
        while len(self.outcomes) > REMEMBERED_IDS:
            self.outcomes.popitem(last=False)
        epoch = self.cancel_epoch
        try:
            self.reloads_waiting += 1
            try:
                await self.lock.acquire()
            finally:
                self.reloads_waiting -= 1
            try:
                if epoch != self.cancel_epoch:
                    reply = ReloadReply.of(request.id, [worker_report(
                        self.config.rank, "cancelled by continue_generation before it started")])
                elif why := self.cannot_step():  # asleep: no memory to warm up or capture in
                    reply = ReloadReply.of(request.id, [worker_report(
                        self.config.rank, f"cannot reload the forward now: {why}")])
                else:
                    reply = await self._reload(request)
            finally:
                self.lock.release()
        except BaseException as exc:
            outcome.set_exception(exc)
            outcome.exception()  # retrieved: a repeat of this id re-raises it; nobody else needs to (no log noise)
            raise
        outcome.set_result(reply)
        return reply

    async def _reload(self, request: ReloadRequest) -> ReloadReply:
        """A reload in its turn: rank 0's entry of the reply (`Reload`), then the other ranks' (the ledger's)."""
        self.reloads += 1
        if self.ranks is not None:
            self.ranks.start()
        with COMPILES.expected():  # compiling is what a reload does
            first = await Reload(self, request).run()
        others = rank_entries(self.ranks, first.ok) if self.ranks is not None else []
        return ReloadReply.of(request.id, [first, *(WorkerReport(**entry) for entry in others)])

    async def compile_ahead(self, path: Path, text: str, request_id: str | None = None) -> CompileAheadReply:
        """Build the kernels that an editor's unsaved `text` of `path` (resolved, under `buffers.roots()`) changes,
        while the old code serves; nothing is reloaded, and a save of that text then finds them built (buffers.py).
        No turn in the lock of its own: the build takes it only while it reads the sources and runs the text aside."""
        return await self.buffers.compile(path, text, request_id)

    # --- kernel checks (`tsdev check`, and the old code's times before an edit) ------------------

    async def kernel_check_cases(self, request: KernelCheckRequest) -> list[tuple[str, tuple[int, ...]]]:
        """The cases `tsdev check` asks for (`check_kernels` runs them); ValueError for an unknown op or where the
        checks cannot run, CheckRunning while another check runs."""
        if self.checks_off:
            raise ValueError(self.checks_off)
        self._one_check_at_a_time()
        serving = serving_of(self.engine)
        async with self.lock:  # the op modules as no reload is changing them
            return await self.loop.run_on_engine_thread(lambda: self.checker.cases(request.ops, serving))

    async def check_kernels(self, cases: list[tuple[str, tuple[int, ...]]]
                            ) -> AsyncIterator[KernelCheckProgress | KernelCheckReply]:
        """Run `cases` (`tsdev check`): a KernelCheckProgress before each, then the KernelCheckReply.

        Why one engine-thread call per case, only when no request runs: a whole check is minutes under Triton's
        interpreter, and as one call it held the engine thread that long, every completion waiting behind it. Now a
        request waits for one case at most, and the next case starts only once no request has run for
        IDLE_BEFORE_TIMING_S (a benchmark's requests in a row are never joined; meanwhile a progress item says how
        many the check waits for, every CHECK_WAIT_REPORT_S). Why a generator: the caller stops the check between
        two cases by closing it (the client went away), and `checking` tells /load and /health that one runs.
        The lock is held per case, not for the whole check: a reload goes in between two cases, and the cases after
        it check the code that serves."""
        self._one_check_at_a_time()
        serving, start, results = serving_of(self.engine), time.perf_counter(), []
        self.checking = KernelCheckProgress(done=0, total=len(cases))
        try:
            for op, shape in cases:
                told = None  # (requests waited for, when said)
                while (waiting := self._check_waits_for()) is not None:
                    now = time.monotonic()
                    if waiting and (told is None or told[0] != waiting or now - told[1] >= CHECK_WAIT_REPORT_S):
                        told = (waiting, now)
                        self.checking = KernelCheckProgress(done=len(results), total=len(cases), waiting_for=waiting)
                        yield self.checking
                    await asyncio.sleep(IDLE_TIMING_GAP_S)
                self.checking = KernelCheckProgress(done=len(results), total=len(cases), op=op, shape=list(shape))
                yield self.checking
                async with self.lock:
                    results.append(await self.loop.run_on_engine_thread(self._check_case, op, shape, serving))
        except (GeneratorExit, asyncio.CancelledError):  # closed between cases, or cancelled during one
            log.info("kernel check stopped after %d of %d case(s): its client went away", len(results), len(cases))
            raise
        finally:
            self.checking = None
        yield KernelCheckReply(ok=all(r.ok for r in results), checks=reported_checks(results),
                               ops=[c.op for c in checks.declared()], seconds=time.perf_counter() - start)

    def _one_check_at_a_time(self) -> None:
        if (running := self.checking) is not None:
            raise CheckRunning(f"a kernel check is running ({running.done} of {running.total} case(s) done): wait for "
                               "it to finish, or stop it (Ctrl-C on its `tsdev check`) and check again")

    def _check_waits_for(self) -> int | None:
        """None when the next case may start; else the requests it gives way to (0: none since the last step,
        IDLE_BEFORE_TIMING_S ago at most). A paused or held engine serves none: nothing to wait for."""
        if self.phase != "serving":
            return None
        stats = self.engine.stats()
        if (waiting := stats.running + stats.waiting) or not self.engine.drained():
            return max(waiting, 1)
        return 0 if time.monotonic() - self.loop.last_step_at < IDLE_BEFORE_TIMING_S else None

    def _check_case(self, op: str, shape: tuple[int, ...], serving: checks.Serving) -> checks.Result:
        """One case, on the engine thread (a shape serving has not compiled may compile for the check: expected, not
        a request's)."""
        with COMPILES.expected():
            return self.checker.check_one(op, shape, serving, idle=self.engine.drained())

    async def time_when_idle(self) -> None:
        """Time every declared op's current code at the serving shapes, one call at a time (~0.1 s of the engine's
        thread) whenever nothing runs, so that a reload finds the old code's times taken and its save → serving
        never waits for them (the server's start leaves it idle: done in the first seconds, off the critical path).
        Ends when all are timed; a later edit's new code is timed by that reload (time_new)."""
        if self.checker.mode == "off" or self.ranks is not None:
            return
        serving = serving_of(self.engine)
        quiet_since = None  # idle this long before the first call: requests in a row (a benchmark) are never joined
        while True:
            await asyncio.sleep(IDLE_TIMING_GAP_S)
            if self.phase != "serving" or not self.engine.drained() or self.lock.locked():
                quiet_since = None
                continue
            # a short request that came and went between two looks here still moved the engine's last step
            quiet_since = max(quiet_since or time.monotonic(), self.loop.last_step_at)
            if time.monotonic() - quiet_since < IDLE_BEFORE_TIMING_S:
                continue
            async with self.lock:
                if not await self.loop.run_on_engine_thread(lambda: self.checker.time_one_pending(serving)):
                    return
