"""reload_forward: new forward-pass code serving in a live server without a restart, the weights, the KV pool and the
graphs' memory kept, everything undone if any step fails.

Why it is a list of steps with undos: a reload touches the code, the model, the graphs and the serving state at
once, and a failure at any point must leave the old code serving. The list is `_Reload.in_pause` (run by
steps.py); what each step does and reports: docs/reload.md; the path from the client: docs/architecture.md.

The reloader is anything that satisfies `ForwardReloader` (a `typing.Protocol`: the runtime never imports the
toolkit); tsdev's `tsdev.hotreload.Reloader` is one (tests/test_reloader_protocol.py), another library's may be.
Requests, worker reports, the reply and the events are tsdev_runtime.control_protocol's models.
"""
import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from tsdev_kernels import checks
from tsdev_runtime.control_protocol import (STEPS, KernelCheckProgress, KernelCheckReply, KernelCheckRequest,
                                            ReloadFinished, ReloadReply, ReloadRequest, ReloadStarted, ReloadStep,
                                            WorkerReport)
from tsdev_runtime.engine.compiles import COMPILES
from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.errors import describe_error, stop_server
from tsdev_runtime.engine.kernel_checks import (KernelChecker, describe_failure, reported as reported_checks,
                                                serving_of, why_off)
from tsdev_runtime.engine.ranks import RankedReloader, RankLost, rank_entries, reported
from tsdev_runtime.engine.steps import Step, Steps

REMEMBERED_IDS = 256
IDLE_BEFORE_TIMING_S = 0.3  # how long the engine must have been idle before time_when_idle takes a call
IDLE_TIMING_GAP_S = 0.02  # between two of time_when_idle's calls: a request that arrives waits for one call at most
CHECK_WAIT_REPORT_S = 1.0  # a check waiting for requests says so this often (the plain reply's route looks for its
#                            client between two items; a stream's client sees it is alive)
JIT, DRAIN, FLUSH, RELOAD, WARM, RECAPTURE = STEPS
log = logging.getLogger("tsdev_runtime.server")  # `tsdev serve` prints its info lines on stderr


@runtime_checkable
class ReloadReport(Protocol):
    """What a reload did: `ok`, else `error` ("file:line: Type: message"); the rest goes into the reply."""
    ok: bool
    error: str | None
    reloaded: Sequence[str]
    dependents: Sequence[str]
    patched: int
    stale: Sequence[Mapping]  # {name, reason, where, referrers}, as StaleDefinition reads them
    needs_restart: Sequence[str]
    jit_kernels: int
    # optional: kernels_only (bool), true when the warm-up has nothing to run, graph_swaps ({old CUfunction:
    # (new CUfunction, threads per block, dynamic shared memory bytes)} or None; see the module's docstring), and
    # compiled_in_pause ({module.name: seconds} of kernels that compiled in the reload step)


@runtime_checkable
class ReloadPlan(Protocol):
    reloaded: Sequence[str]  # modules a reload would re-execute (changed or forced): none, nothing to do
    needs_restart: Sequence[str]  # changed modules outside the reloadable packages


@runtime_checkable
class ReloadTransaction(Protocol):
    """A reload applied in place: `commit()` keeps it, `rollback()` undoes every change. A reload that
    failed (`report.ok` false) has already rolled itself back."""
    report: ReloadReport

    def commit(self) -> None: ...

    def rollback(self, reason: str | None = None) -> None: ...


@runtime_checkable
class ForwardReloader(Protocol):
    """What the engine needs of a hot-reload library. `read_sources` runs once (on rank 0 with several
    ranks) and every step after it gets those bytes, so all ranks run the same code."""

    def read_sources(self) -> Mapping[str, bytes]: ...

    def plan(self, sources: Mapping[str, bytes] | None = None, modules: Iterable[str] | None = None) -> ReloadPlan: ...

    def reload(self, modules: Iterable[str] | None = None,
               sources: Mapping[str, bytes] | None = None) -> ReloadTransaction: ...

    def modules(self) -> list[str]: ...

    def compile_ahead(self, sources: Mapping[str, bytes] | None = None,
                      modules: Iterable[str] | None = None) -> tuple: ...


class StepTimeout(Exception):
    pass


class CheckRunning(Exception):
    """A `tsdev check` runs already: one at a time (the HTTP layer answers 409)."""


class ReloadForward:
    def __init__(self, async_engine: AsyncEngine, reloader: ForwardReloader, rank: int = 0):
        ranks = async_engine.engine.ranks  # tensor parallelism: every rank reloads the bytes rank 0 read
        self.reloader = RankedReloader(reloader, ranks) if ranks is not None else reloader
        self.async_engine, self.rank = async_engine, rank
        self.checker = KernelChecker(async_engine.engine.config.kernel_check)
        self.checks_off = why_off(str(async_engine.engine.runner.device))
        if self.checks_off and self.checker.mode == "strict":
            raise ValueError(f"--kernel-check strict cannot hold: {self.checks_off}")
        if self.checks_off and self.checker.mode == "report":
            log.warning("%s", self.checks_off)
        self.outcomes: OrderedDict[str, asyncio.Future[ReloadReply]] = OrderedDict()
        self.cancel_epoch = 0
        self.count = 0
        self.checking: KernelCheckProgress | None = None  # the `tsdev check` under way, where it is
        self.waiting = 0  # reload calls waiting for their turn (continue_generation would cancel them)

    async def __call__(self, request: ReloadRequest) -> ReloadReply:
        """Reload once per id: the same id again returns the first outcome (waiting for it if needed)."""
        if request.id in self.outcomes:
            return await asyncio.shield(self.outcomes[request.id])
        outcome = asyncio.get_running_loop().create_future()
        self.outcomes[request.id] = outcome
        while len(self.outcomes) > REMEMBERED_IDS:
            self.outcomes.popitem(last=False)
        epoch = self.cancel_epoch
        try:
            self.waiting += 1
            try:
                await self.async_engine.control_lock.acquire()
            finally:
                self.waiting -= 1
            try:
                if epoch != self.cancel_epoch:
                    reply = ReloadReply.of(request.id,
                                           [self._worker("cancelled by continue_generation before it started")])
                elif why := self.async_engine.engine.cannot_step():  # asleep: no memory to warm up or capture in
                    reply = ReloadReply.of(request.id, [self._worker(f"cannot reload the forward now: {why}")])
                else:
                    with COMPILES.expected():  # compiling is what a reload does
                        first = await self._run(request)
                    reply = ReloadReply.of(request.id, [first, *self._other_ranks(first.ok)])
            finally:
                self.async_engine.control_lock.release()
        except BaseException as exc:
            outcome.set_exception(exc)
            outcome.exception()  # retrieved: a repeat of this id re-raises it; nobody else needs to (no log noise)
            raise
        outcome.set_result(reply)
        return reply

    async def kernel_check_cases(self, request: KernelCheckRequest) -> list[tuple[str, tuple[int, ...]]]:
        """The cases `tsdev check` asks for (`check_kernels` runs them); ValueError for an unknown op or where the
        checks cannot run, CheckRunning while another check runs."""
        ae = self.async_engine
        if self.checks_off:
            raise ValueError(self.checks_off)
        self._one_check_at_a_time()
        serving = serving_of(ae.engine)
        async with ae.control_lock:  # the op modules as no reload is changing them
            return await ae.run_on_engine_thread(lambda: self.checker.cases(request.ops, serving))

    async def check_kernels(self, cases: list[tuple[str, tuple[int, ...]]]
                            ) -> AsyncIterator[KernelCheckProgress | KernelCheckReply]:
        """Run `cases` (`tsdev check`): a KernelCheckProgress before each, then the KernelCheckReply.

        Why one engine-thread call per case, only when no request runs: a whole check is minutes under Triton's
        interpreter, and as one call it held the engine thread that long, every completion waiting behind it. Now a
        request waits for one case at most, and the next case starts only once no request has run for
        IDLE_BEFORE_TIMING_S (a benchmark's requests in a row are never joined; meanwhile a progress item says how
        many the check waits for, every CHECK_WAIT_REPORT_S). Why a generator: the caller stops the check between
        two cases by closing it (the client went away), and `self.checking` tells /load and /health that one runs.
        The control lock is held per case, not for the whole check: a reload goes in between two cases, and the
        cases after it check the code that serves."""
        ae = self.async_engine
        self._one_check_at_a_time()
        serving, start, results = serving_of(ae.engine), time.perf_counter(), []
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
                async with ae.control_lock:
                    results.append(await ae.run_on_engine_thread(self._check_case, op, shape, serving))
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
        ae = self.async_engine
        if ae.state.phase != "serving":
            return None
        stats = ae.engine.stats()
        if (waiting := stats.running + stats.waiting) or not self._idle():
            return max(waiting, 1)
        return 0 if time.monotonic() - ae.last_step_at < IDLE_BEFORE_TIMING_S else None

    def _check_case(self, op: str, shape: tuple[int, ...], serving: checks.Serving) -> checks.Result:
        """One case, on the engine thread (a shape serving has not compiled may compile for the check: expected, not
        a request's)."""
        with COMPILES.expected():
            return self.checker.check_one(op, shape, serving, idle=self._idle())

    async def time_when_idle(self) -> None:
        """Time every declared op's current code at the serving shapes, one call at a time (~0.1 s of the engine's
        thread) whenever nothing runs, so that a reload finds the old code's times taken and its save → serving
        never waits for them (the server's start leaves it idle: done in the first seconds, off the critical path).
        Ends when all are timed; a later edit's new code is timed by that reload (time_new)."""
        ae, engine = self.async_engine, self.async_engine.engine
        if self.checker.mode == "off" or engine.ranks is not None:
            return
        serving = serving_of(engine)
        quiet_since = None  # idle this long before the first call: requests in a row (a benchmark) are never joined
        while True:
            await asyncio.sleep(IDLE_TIMING_GAP_S)
            if ae.state.phase != "serving" or not self._idle() or ae.control_lock.locked():
                quiet_since = None
                continue
            # a short request that came and went between two looks here still moved the engine's last step
            quiet_since = max(quiet_since or time.monotonic(), ae.last_step_at)
            if time.monotonic() - quiet_since < IDLE_BEFORE_TIMING_S:
                continue
            async with ae.control_lock:
                if not await ae.run_on_engine_thread(lambda: self.checker.time_one_pending(serving)):
                    return

    def cancel_pending(self) -> None:
        """continue_generation: reloads still waiting for their turn give up."""
        self.cancel_epoch += 1

    def _other_ranks(self, rank0_ok: bool) -> list[WorkerReport]:
        """The entries of ranks 1.. (tensor parallelism): their outcome and seconds of the calls this reload made."""
        ranks = self.async_engine.engine.ranks
        return [WorkerReport(**entry) for entry in rank_entries(ranks, rank0_ok)] if ranks is not None else []

    def _worker(self, error: str | None, timings: dict[str, float] | None = None, **fields) -> WorkerReport:
        """This rank's entry of the reply: ok when `error` is None; `fields` are WorkerReport's."""
        return WorkerReport(rank=self.rank, ok=error is None, error=error,
                            timings={k: round(v, 6) for k, v in (timings or {}).items()}, **fields)

    async def _run(self, request: ReloadRequest) -> WorkerReport:
        ae, engine = self.async_engine, self.async_engine.engine
        self.count += 1
        if engine.ranks is not None:
            engine.ranks.start()
        start = time.perf_counter()
        ae.publish(ReloadStarted(id=request.id, n=self.count, modules=request.modules or []))
        try:
            sources = await ae.run_on_engine_thread(self.reloader.read_sources)
            plan = self.reloader.plan(sources=sources, modules=request.modules)
        except Exception as exc:  # e.g. a forced module that does not exist
            return self._finish(request, self._worker(str(exc) if isinstance(exc, ValueError) else describe_error(exc)))
        if not plan.reloaded:  # nothing to run: serving is not interrupted
            total = time.perf_counter() - start
            timings = {"total": total, "pause": 0.0, "resumed": total}
            return self._finish(request, self._worker(None, timings, needs_restart=list(plan.needs_restart)))
        reload = _Reload(self, request, sources, start)
        if self.checks_off and reload.check_mode == "strict":
            return self._finish(request, self._worker(f"this reload asks for --kernel-check strict, which cannot hold: "
                                                      f"{self.checks_off}; nothing was reloaded"))
        if self.checks_off and reload.check_mode == "report" and any(
                checks.modules_reached(c) & set(plan.reloaded) for c in checks.declared()):
            reload.warnings.append(self.checks_off)  # a kernel edit that was not checked
        await reload.steps.run(reload.before_pause())  # the old code keeps serving meanwhile
        if reload.check_mode != "off":  # the checks' inputs, drawn if nothing runs on the GPU now
            with reload.steps.timed("check_prepare"):
                await ae.run_on_engine_thread(lambda: self.checker.prepare(reload.serving, self._idle(),
                                                                           plan.reloaded))
                reload.before_edit = self.checker.fingerprints()
        ae.hold(True)
        try:
            with reload.steps.timed("pause"):
                await self._in_pause(reload)
        finally:
            ae.hold(False)
            reload.steps.record("resumed", time.perf_counter() - start)  # the new code serves from here
        if reload.error is None and reload.check_mode == "report":  # serving resumed: between its steps
            try:
                await reload.check_kernels()
            except Exception as exc:  # the edit is in and stays: only the report is missing
                reload.warnings.append(f"the kernel checks failed to run: {describe_error(exc)}")
        self.checker.forget_drawn()
        if reload.error is None and reload.kernel_checks:  # the new code's times, serving resumed (if idle)
            await ae.run_on_engine_thread(lambda: self.checker.time_new(reload.kernel_checks, reload.serving,
                                                                        idle=self._idle()))
        return self._finish(request, reload.report())

    async def _in_pause(self, reload: "_Reload") -> None:
        """The pause's steps; a failure undoes the steps begun (every undo guarded) and is kept in `reload.error`."""
        try:
            await reload.steps.run(reload.in_pause())
        except RankLost as exc:  # a wedged rank cannot roll back: nothing can run in step any more
            stop_server(f"FATAL: reload {reload.request.id}, step '{reload.steps.current}': {exc}. The server stops "
                        "(tsdev watch restarts it).")
        except Exception as exc:
            reload.error = str(exc) if isinstance(exc, (_ReportedFailure, StepTimeout)) else describe_error(exc)
            if isinstance(exc, _NeedsRestart):
                reload.needs_restart = exc.modules
            if failures := await reload.steps.undo(reload.error):
                reload.error += f" (rollback incomplete: {'; '.join(failures)})"
                if reload.engine.ranks is not None:  # a rank's state is unknown now: they may no longer run in step
                    stop_server(f"FATAL: reload {reload.request.id}: {reload.error}. The server stops (tsdev watch "
                                "restarts it).")

    def _idle(self) -> bool:
        """Nothing runs on the GPU: no request, no step in flight (on the engine thread)."""
        engine = self.async_engine.engine
        return engine.num_running == 0 and engine.in_flight is None

    def _finish(self, request: ReloadRequest, worker: WorkerReport) -> WorkerReport:
        log.info(log_line(request.id, worker))
        self.async_engine.publish(ReloadFinished(type="reload_finished" if worker.ok else "reload_failed",
                                                 id=request.id, n=self.count, worker=worker))
        return worker


class _Reload:
    """One reload's steps and what they leave for the reply: before the pause `jit`; in it `drain`, `flush`, a guard
    (its undo recaptures the graphs once the code is restored), `reload` (its undo: the old model and code back),
    `warm`, `kernel_check` (under `strict`), `recapture` and `commit` (the point of no return). The timings keep
    the order the steps ran in."""

    def __init__(self, owner: ReloadForward, request: ReloadRequest, sources: Mapping[str, bytes], start: float):
        self.owner, self.request, self.sources, self.start = owner, request, sources, start
        self.ae, self.engine = owner.async_engine, owner.async_engine.engine
        self.deadline = start + request.timeout_s if request.timeout_s else float("inf")
        self.steps = Steps(self._publish)
        self.serving, self.before_edit = serving_of(self.engine), {}
        self.check_mode = request.kernel_check or owner.checker.mode
        self.tx, self.old_model, self.changed, self.rebuilt = None, None, set(), []
        self.jit_kernels, self.warnings, self.kernel_checks = 0, [], []
        self.warm_skipped, self.graphs_swapped, self.nodes_patched = False, False, None
        self.error: str | None = None
        self.needs_restart: list[str] = []

    def before_pause(self) -> list[Step]:
        return [Step(JIT, self._jit)]

    def in_pause(self) -> list[Step]:
        return [Step(DRAIN, self._drain, started=lambda: {"running": self.engine.num_running}),
                Step(FLUSH, lambda: self.ae.between_steps(self.engine.flush_prefix_cache)),
                Step("graphs", undo=self._recapture_old_code),  # undone after `reload`: the old code captures
                Step(RELOAD, self._reload, undo=self._undo_reload),
                Step(WARM, self._warm),
                *([Step("kernel_check", self.check_kernels)] if self.check_mode == "strict" else []),
                Step(RECAPTURE, self._recapture),
                Step("commit", self._commit)]  # last: the point of no return

    def _publish(self, name: str, state: str, fields: dict) -> None:
        if name in STEPS:  # the others are timed, with no event of their own
            self.ae.publish(ReloadStep(id=self.request.id, step=name, state=state, **fields))

    def _check_deadline(self) -> None:
        if time.perf_counter() > self.deadline:
            raise StepTimeout(f"timed out after {self.request.timeout_s} s in step '{self.steps.current}'; nothing "
                              "was changed")

    async def _jit(self) -> None:
        try:
            self.jit_kernels, _, *slowest = await asyncio.to_thread(self.owner.reloader.compile_ahead, self.sources,
                                                                    self.request.modules)
            if slowest:
                self.steps.record("jit_slowest", slowest[0])
        except Exception as exc:  # only an optimisation: the warm step compiles what is missing
            self.warnings.append(f"compiling ahead failed, kernels compile during the warm step: {describe_error(exc)}")

    async def _drain(self) -> None:
        if self.request.mode == "abort":
            await self.ae.between_steps(lambda: self.ae.abort_all(running_only=True))
        remaining = self.deadline - time.perf_counter()
        try:
            await asyncio.wait_for(self.ae.wait_until_drained(),
                                   None if remaining == float("inf") else max(remaining, 0))
        except TimeoutError:
            raise StepTimeout(f"timed out after {self.request.timeout_s} s in step '{DRAIN}' "
                              f"({self.engine.num_running} request(s) still running); nothing was changed") from None

    async def _reload(self) -> None:
        engine, request = self.engine, self.request
        before = init_signatures(engine.model)
        self.tx = await self.ae.run_on_engine_thread(
            lambda: self.owner.reloader.reload(modules=request.modules, sources=self.sources))
        if not self.tx.report.ok:
            raise _ReportedFailure(self.tx.report.error or "the reload failed")
        self.changed = changed_classes(before)
        self.rebuilt = [name or "(model)" for name, m in engine.model.named_modules() if type(m) in self.changed]
        if self.rebuilt:
            try:
                with self.steps.timed("rebuild"):
                    self.old_model = await self.ae.run_on_engine_thread(engine.rebuild_model)
            except ValueError as exc:  # the checkpoint no longer fits the new code
                restart = sorted({cls.__module__ for cls in self.changed})
                raise _NeedsRestart(f"needs restart: the weights do not fit the new code of "
                                    f"{', '.join(sorted(map(class_name, self.changed)))}: {exc}", restart) from exc
        self._check_deadline()

    async def _undo_reload(self, why: str) -> None:
        if self.old_model is not None:  # the old model (and its weights) serve again
            self.engine.restore_model(self.old_model)
        if self.tx is not None and self.tx.report.ok:  # (a failed reload rolled itself back)
            self.tx.rollback(why)

    async def _commit(self) -> None:
        """The reload is in for good on every rank. A commit that fails (another rank's, once this rank committed)
        cannot be undone and the ranks may differ: the server stops."""
        try:
            self.tx.commit()
        except Exception as exc:
            stop_server(f"FATAL: reload {self.request.id}: the commit failed ({describe_error(exc)}) once the new "
                        "code was in: the ranks may differ. The server stops (tsdev watch restarts it).")

    async def _warm(self) -> None:
        self.warm_skipped = not self.rebuilt and getattr(self.tx.report, "kernels_only", False)
        if not self.warm_skipped:
            await self.ae.run_on_engine_thread(self.engine.warmup)

    async def check_kernels(self) -> None:
        """The changed ops against their references; under `strict` (in the pause) a failed one raises."""
        checker = self.owner.checker
        with self.steps.timed("kernel_check"):
            self.kernel_checks = await self.ae.run_on_engine_thread(lambda: checker.check(self.before_edit,
                                                                                          self.serving))
        failed = next((r for r in self.kernel_checks if not r.ok), None)
        if failed is not None and self.check_mode == "strict":
            raise _ReportedFailure(describe_failure(failed))

    async def _recapture(self) -> None:
        engine, ae = self.engine, self.ae
        self.graphs_swapped = True  # the decode graphs may be new even when the prefill capture then fails
        swaps = getattr(self.tx.report, "graph_swaps", None) if self.warm_skipped else None
        patchable = not (self.request.recapture or engine.config.full_recapture or engine.ranks is not None)
        if swaps is not None and patchable:  # several ranks recapture (docs/parallel.md, "Not yet")
            try:
                self.nodes_patched = await ae.run_on_engine_thread(lambda: engine.patch_graphs(swaps))
            except Exception as exc:  # set back: the graphs are captured as any reload's
                self.warnings.append(f"patching the graphs failed, they were captured again: {describe_error(exc)}")
        if self.nodes_patched is None:
            graph_timings = await ae.run_on_engine_thread(lambda: engine.capture_graphs(deferring=True))
            for kind, seconds in graph_timings.items():
                self.steps.record(f"recapture_{kind}", sum(seconds.values()))

    async def _recapture_old_code(self, why: str) -> None:
        """Graphs were replaced by ones of the new code: recapture them with the restored old code."""
        if not self.graphs_swapped or self.ae.state.stopping:  # (stopping: the process exits, nothing serves again)
            return
        try:
            await self.ae.run_on_engine_thread(lambda: self.engine.capture_graphs(strict=False))  # prefill: eager ok
        except Exception as exc:
            stop_server(f"FATAL: after a failed reload ({why}), recapturing the CUDA graphs with the old code failed: "
                        f"{describe_error(exc)}. The server cannot serve safely and stops.")

    def report(self) -> WorkerReport:
        """This rank's entry of the reply."""
        self.steps.record("total", time.perf_counter() - self.start)
        timings = self.steps.timings
        self.old_model = None
        fields = reported(self.tx.report) if self.tx is not None else {}
        if self.rebuilt:
            fields["rebuilt"] = self.rebuilt
            if self.error is None:  # the rebuilt instances ran the new __init__: not stale any more
                classes = set(map(class_name, self.changed))
                fields["stale"] = [s for s in fields["stale"] if s.name not in classes]
        if self.needs_restart:
            fields["needs_restart"] = sorted({*fields.get("needs_restart", []), *self.needs_restart})
        fields["jit_kernels"] = self.jit_kernels or fields.get("jit_kernels", 0)
        fields["kernels_only"] = self.warm_skipped
        config = self.engine.config
        fields["graphs"] = config.device.startswith("cuda") and not config.enforce_eager
        fields["graph_nodes_patched"] = self.nodes_patched or 0
        fields["kernel_checks"] = reported_checks(self.kernel_checks)
        timings.setdefault(JIT, 0.0)
        return self.owner._worker(self.error, timings, warnings=self.warnings, **fields)


class _ReportedFailure(Exception):
    """A failure the reloader already described (with file:line) and rolled back."""


class _NeedsRestart(Exception):
    """The new code cannot run on this server's weights (a rebuilt module's shape no longer fits the
    checkpoint): the reload rolls back and `modules` need a restart."""

    def __init__(self, message: str, modules: list[str]):
        super().__init__(message)
        self.modules = modules


def _init_signature(cls: type) -> tuple:
    """What decides how an instance of `cls` is built and post-processed: its __init__'s and its post-load
    hook's code and defaults (inherited ones included). The reloader patches these in place."""
    parts = []
    for attr in ("__init__", "process_weights_after_loading"):
        fn = getattr(cls, attr, None)
        code = getattr(fn, "__code__", None)
        parts.append((_code_key(code), getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__", None)))
    return tuple(parts)


def _code_key(code) -> tuple | None:
    """A code object's content without its line numbers (an edit above it moves it, changing nothing)."""
    if code is None:
        return None
    consts = tuple(_code_key(c) if hasattr(c, "co_code") else c for c in code.co_consts)
    return code.co_code, code.co_names, code.co_varnames, code.co_freevars, consts


def init_signatures(model) -> dict[type, tuple]:
    """`_init_signature` of every module class in `model`, before a reload."""
    return {cls: _init_signature(cls) for cls in {type(m) for m in model.modules()}}


def changed_classes(before: dict[type, tuple]) -> set[type]:
    """The module classes whose __init__ or post-load hook changed since `before`."""
    return {cls for cls, signature in before.items() if _init_signature(cls) != signature}


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def log_line(request_id: str, worker: WorkerReport) -> str:
    """The server log's line for one reload: 'reload r-12 ok: tsdev_kernels.ops.activation + 3 dependent(s), paused
    0.31 s' or 'reload r-13 FAILED in warm: file:line: ...'."""
    if not worker.ok:
        step = worker.failed_step
        return f"reload {request_id} FAILED{f' in {step}' if step else ''}: {worker.error}"
    if worker.reloaded:
        what = (f"{', '.join(worker.reloaded)} + {len(worker.dependents)} dependent(s), "
                f"paused {worker.step_seconds('pause'):.2f} s")
    else:
        what = "nothing changed"
    if worker.rebuilt:
        what += f"; rebuilt {len(worker.rebuilt)} module(s) in {worker.step_seconds('rebuild'):.2f} s"
    if worker.needs_restart:
        what += f"; needs restart: {', '.join(worker.needs_restart)}"
    return f"reload {request_id} ok: {what}"
