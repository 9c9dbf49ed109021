"""reload_forward: new forward-pass code serving in a live server without a restart, the weights, the KV pool and the
graphs' memory kept, everything undone if any step fails.

Why it is a list of steps with undos: a reload touches the code, the model, the graphs and the serving state at
once, and a failure at any point must leave the old code serving. The list is `Reload.in_pause` (run by
steps.py); the engine's control (control.py) runs a `Reload` in its turn, once per request id, and adds the other
ranks' entries. What each step does and reports: docs/reload.md; the path from the client: docs/architecture.md.

The reloader is anything that satisfies `ForwardReloader` (a `typing.Protocol`: the runtime never imports the
toolkit); tsdev's `tsdev.hotreload.Reloader` is one (tests/test_reloader_protocol.py), another library's may be.
Requests, worker reports, the reply and the events are tsdev_runtime.control_protocol's models.
"""
import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tsdev_kernels import checks
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.control_protocol import (STEPS, ReloadFinished, ReloadRequest, ReloadStarted, ReloadStep,
                                            WorkerReport)
from tsdev_runtime.engine.errors import describe_error, stop_server
from tsdev_runtime.engine.kernel_checks import KernelChecker, describe_failure, reported as reported_checks, serving_of
from tsdev_runtime.engine.model_runner import ModelRunner
from tsdev_runtime.engine.ranks import DrivenRunner, RankLedger, RankLost, reported
from tsdev_runtime.engine.steps import Loop, Step, Steps

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

    def compile_ahead(self, sources: Mapping[str, bytes] | None = None, modules: Iterable[str] | None = None,
                      prepared: Callable[[], None] | None = None) -> tuple:
        """Build the kernels the sources change, reloading nothing: (binaries, seconds, slowest compile's seconds,
        ...), with `on_disk` (binaries Triton's disk cache held, not built again) where it has it. `prepared()`, when
        given, is called once the rest may overlap a reload (nothing live used any more)."""


class BuiltAhead(Protocol):
    """Editors' buffers being built ahead (BufferCompiles, runtime/tsdev_runtime/engine/buffers.py), as a reload sees
    them."""

    async def settled(self, sources: Mapping[str, bytes]) -> None:
        """Return once no build of exactly `sources` runs."""


class StepTimeout(Exception):
    pass


class Owner(Protocol):
    """What a reload uses of the engine's control (EngineControl, runtime/tsdev_runtime/engine/control.py), which
    runs it: a Protocol, since the control imports this module (tests/test_no_import_cycles.py)."""
    config: EngineConfig
    loop: Loop
    engine: Any  # the LLMEngine (it imports the control): drained or not, its shapes for the kernel checks
    runner: ModelRunner  # this rank's
    ranked: ModelRunner | DrivenRunner  # the calls every rank makes
    ranks: RankLedger | None
    reloader: ForwardReloader
    buffers: BuiltAhead | None  # editors' buffers being built ahead (POST compile_ahead)
    checker: KernelChecker
    checks_off: str | None  # why the kernel checks cannot run here
    weights_dir: Path  # the weights served now (a rebuilt model loads them)
    stopping: bool
    reloads: int  # this one's number, for its events

    def hold(self, on: bool) -> None: ...

    async def flush_prefix_cache(self) -> None: ...

    def capture_graphs(self, strict: bool = True, deferring: bool = False) -> dict[str, dict[int, float]]: ...


def worker_report(rank: int, error: str | None, timings: dict[str, float] | None = None, **fields) -> WorkerReport:
    """A rank's entry of the reply: ok when `error` is None; `fields` are WorkerReport's."""
    return WorkerReport(rank=rank, ok=error is None, error=error,
                        timings={k: round(v, 6) for k, v in (timings or {}).items()}, **fields)


class Reload:
    """One reload, run by the engine's control in its turn: read the sources, plan, then its steps -- before the
    pause `jit`; in it `drain`, `flush`, a guard (its undo recaptures the graphs once the code is restored), `reload`
    (its undo: the old model and code back), `warm`, `kernel_check` (under `strict`), `recapture` and `commit` (the
    point of no return) -- and what they leave for this rank's entry of the reply. The timings keep the order the
    steps ran in."""

    def __init__(self, control: Owner, request: ReloadRequest):
        self.control, self.request, self.start = control, request, time.perf_counter()
        self.loop, self.engine, self.rank = control.loop, control.engine, control.config.rank
        self.deadline = self.start + request.timeout_s if request.timeout_s else float("inf")
        self.steps = Steps(self._publish)
        self.sources: Mapping[str, bytes] = {}
        self.serving, self.before_edit = serving_of(self.engine), {}
        self.check_mode = request.kernel_check or control.checker.mode
        self.tx, self.old_model, self.changed, self.rebuilt = None, None, set(), []
        self.jit_kernels, self.warnings, self.kernel_checks = 0, [], []
        self.warm_skipped, self.graphs_swapped, self.nodes_patched = False, False, None
        self.error: str | None = None
        self.needs_restart: list[str] = []

    async def run(self) -> WorkerReport:
        """This rank's entry of the reply: the steps' outcome, or why nothing ran."""
        control, loop, request, checker = self.control, self.loop, self.request, self.control.checker
        loop.publish(ReloadStarted(id=request.id, n=control.reloads, modules=request.modules or []))
        try:
            self.sources = await loop.run_on_engine_thread(control.reloader.read_sources)
            plan = control.reloader.plan(sources=self.sources, modules=request.modules)
        except Exception as exc:  # e.g. a forced module that does not exist
            return self._finish(self._worker(str(exc) if isinstance(exc, ValueError) else describe_error(exc)))
        if not plan.reloaded:  # nothing to run: serving is not interrupted
            total = time.perf_counter() - self.start
            timings = {"total": total, "pause": 0.0, "resumed": total}
            return self._finish(self._worker(None, timings, needs_restart=list(plan.needs_restart)))
        if control.checks_off and self.check_mode == "strict":
            return self._finish(self._worker(f"this reload asks for --kernel-check strict, which cannot hold: "
                                             f"{control.checks_off}; nothing was reloaded"))
        if control.checks_off and self.check_mode == "report" and any(
                checks.modules_reached(c) & set(plan.reloaded) for c in checks.declared()):
            self.warnings.append(control.checks_off)  # a kernel edit that was not checked
        prepared = None  # the checks' inputs (drawn if nothing runs on the GPU now), while the kernels compile
        if self.check_mode != "off":
            prepared = asyncio.ensure_future(loop.run_on_engine_thread(
                lambda: (checker.prepare(self.serving, self.engine.drained(), plan.reloaded), checker.fingerprints())))
        try:
            await self.steps.run(self.before_pause())  # the old code keeps serving meanwhile
        finally:
            if prepared is not None:
                with self.steps.timed("check_prepare"):  # (what the drawing took beyond the jit step)
                    _, self.before_edit = await prepared
        control.hold(True)
        try:
            with self.steps.timed("pause"):
                await self._in_pause()
        finally:
            control.hold(False)
            self.steps.record("resumed", time.perf_counter() - self.start)  # the new code serves from here
        if self.error is None and self.check_mode == "report":  # serving resumed: between its steps
            try:
                await self.check_kernels()
            except Exception as exc:  # the edit is in and stays: only the report is missing
                self.warnings.append(f"the kernel checks failed to run: {describe_error(exc)}")
        checker.forget_drawn()
        if self.error is None and self.kernel_checks:  # the new code's times, serving resumed (if idle)
            await loop.run_on_engine_thread(lambda: checker.time_new(self.kernel_checks, self.serving,
                                                                     idle=self.engine.drained()))
        return self._finish(self.report())

    async def _in_pause(self) -> None:
        """The pause's steps; a failure undoes the steps begun (every undo guarded) and is kept in `error`."""
        try:
            await self.steps.run(self.in_pause())
        except RankLost as exc:  # a wedged rank cannot roll back: nothing can run in step any more
            stop_server(f"FATAL: reload {self.request.id}, step '{self.steps.current}': {exc}. The server stops "
                        "(tsdev watch restarts it).")
        except Exception as exc:
            self.error = str(exc) if isinstance(exc, (_ReportedFailure, StepTimeout)) else describe_error(exc)
            if isinstance(exc, _NeedsRestart):
                self.needs_restart = exc.modules
            if failures := await self.steps.undo(self.error):
                self.error += f" (rollback incomplete: {'; '.join(failures)})"
                if self.control.ranks is not None:  # a rank's state is unknown now: they may no longer run in step
                    stop_server(f"FATAL: reload {self.request.id}: {self.error}. The server stops (tsdev watch "
                                "restarts it).")

    def _worker(self, error: str | None, timings: dict[str, float] | None = None, **fields) -> WorkerReport:
        return worker_report(self.rank, error, timings, **fields)

    def _finish(self, worker: WorkerReport) -> WorkerReport:
        log.info(log_line(self.request.id, worker))
        self.loop.publish(ReloadFinished(type="reload_finished" if worker.ok else "reload_failed",
                                         id=self.request.id, n=self.control.reloads, worker=worker))
        return worker

    def before_pause(self) -> list[Step]:
        return [Step(JIT, self._jit)]

    def in_pause(self) -> list[Step]:
        return [Step(DRAIN, self._drain, started=lambda: {"running": self.engine.stats().running}),
                Step(FLUSH, self.control.flush_prefix_cache),
                Step("graphs", undo=self._recapture_old_code),  # undone after `reload`: the old code captures
                Step(RELOAD, self._reload, undo=self._undo_reload),
                Step(WARM, self._warm),
                *([Step("kernel_check", self.check_kernels)] if self.check_mode == "strict" else []),
                Step(RECAPTURE, self._recapture),
                Step("commit", self._commit)]  # last: the point of no return

    def _publish(self, name: str, state: str, fields: dict) -> None:
        if name in STEPS:  # the others are timed, with no event of their own
            self.loop.publish(ReloadStep(id=self.request.id, step=name, state=state, **fields))

    def _check_deadline(self) -> None:
        if time.perf_counter() > self.deadline:
            raise StepTimeout(f"timed out after {self.request.timeout_s} s in step '{self.steps.current}'; nothing "
                              "was changed")

    async def _jit(self) -> None:
        if self.control.buffers is not None:  # the buffer saved as it is being built: its binaries, not a second build
            await self.control.buffers.settled(self.sources)
        try:
            ahead = await asyncio.to_thread(self.control.reloader.compile_ahead, self.sources, self.request.modules)
            binaries, _, *slowest = ahead
            # ready before the pause: built now, or found in Triton's disk cache (a revert, a buffer built ahead)
            self.jit_kernels = binaries + getattr(ahead, "on_disk", 0)
            if slowest:
                self.steps.record("jit_slowest", slowest[0])
        except Exception as exc:  # only an optimisation: the warm step compiles what is missing
            self.warnings.append(f"compiling ahead failed, kernels compile during the warm step: {describe_error(exc)}")

    async def _drain(self) -> None:
        loop = self.loop
        if self.request.mode == "abort":
            await loop.between_steps(lambda: loop.abort_all(running_only=True))
        remaining = self.deadline - time.perf_counter()
        try:
            await asyncio.wait_for(loop.wait_until_drained(), None if remaining == float("inf") else max(remaining, 0))
        except TimeoutError:
            raise StepTimeout(f"timed out after {self.request.timeout_s} s in step '{DRAIN}' "
                              f"({self.engine.stats().running} request(s) still running); nothing was changed"
                              ) from None

    async def _reload(self) -> None:
        control, request = self.control, self.request
        before = init_signatures(control.runner.model)
        self.tx = await self.loop.run_on_engine_thread(
            lambda: control.reloader.reload(modules=request.modules, sources=self.sources))
        if not self.tx.report.ok:
            raise _ReportedFailure(self.tx.report.error or "the reload failed")
        self.changed = changed_classes(before)
        self.rebuilt = [name or "(model)" for name, m in control.runner.model.named_modules()
                        if type(m) in self.changed]
        if self.rebuilt:
            try:
                with self.steps.timed("rebuild"):
                    # the model built anew with the code loaded now, the weights served now loaded into it (the last
                    # update's checkpoint, else the served model's) and swapped in; the old one's kept for the undo
                    self.old_model = await self.loop.run_on_engine_thread(
                        lambda: control.ranked.rebuild_model(control.weights_dir))
            except ValueError as exc:  # the checkpoint no longer fits the new code
                restart = sorted({cls.__module__ for cls in self.changed})
                raise _NeedsRestart(f"needs restart: the weights do not fit the new code of "
                                    f"{', '.join(sorted(map(class_name, self.changed)))}: {exc}", restart) from exc
        self._check_deadline()

    async def _undo_reload(self, why: str) -> None:
        if self.old_model is not None:  # the old model (and its weights) serve again
            self.control.ranked.restore_model(self.old_model)
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
            await self.loop.run_on_engine_thread(self.control.ranked.warmup)

    async def check_kernels(self) -> None:
        """The changed ops against their references; under `strict` (in the pause) a failed one raises."""
        checker = self.control.checker
        with self.steps.timed("kernel_check"):
            self.kernel_checks = await self.loop.run_on_engine_thread(lambda: checker.check(self.before_edit,
                                                                                            self.serving))
        failed = next((r for r in self.kernel_checks if not r.ok), None)
        if failed is not None and self.check_mode == "strict":
            raise _ReportedFailure(describe_failure(failed))

    async def _recapture(self) -> None:
        control, loop = self.control, self.loop
        self.graphs_swapped = True  # the decode graphs may be new even when the prefill capture then fails
        swaps = getattr(self.tx.report, "graph_swaps", None) if self.warm_skipped else None
        patchable = not (self.request.recapture or control.config.full_recapture or control.ranks is not None)
        if swaps is not None and patchable:  # several ranks recapture (docs/parallel.md, "Not yet")
            try:
                self.nodes_patched = await loop.run_on_engine_thread(lambda: control.runner.patch_graphs(swaps))
            except Exception as exc:  # set back: the graphs are captured as any reload's
                self.warnings.append(f"patching the graphs failed, they were captured again: {describe_error(exc)}")
        if self.nodes_patched is None:
            graph_timings = await loop.run_on_engine_thread(lambda: control.capture_graphs(deferring=True))
            for kind, seconds in graph_timings.items():
                self.steps.record(f"recapture_{kind}", sum(seconds.values()))

    async def _recapture_old_code(self, why: str) -> None:
        """Graphs were replaced by ones of the new code: recapture them with the restored old code."""
        if not self.graphs_swapped or self.control.stopping:  # (stopping: the process exits, nothing serves again)
            return
        try:
            await self.loop.run_on_engine_thread(lambda: self.control.capture_graphs(strict=False))  # prefill: eager
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
        config = self.control.config
        fields["graphs"] = config.device.startswith("cuda") and not config.enforce_eager
        fields["graph_nodes_patched"] = self.nodes_patched or 0
        fields["kernel_checks"] = reported_checks(self.kernel_checks)
        timings.setdefault(JIT, 0.0)
        return self._worker(self.error, timings, warnings=self.warnings, **fields)


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
