"""reload_forward: run new forward-pass code in a live server, keeping weights, KV pools and graphs' pool.

Steps, each timed: jit (edited Triton kernels compiled ahead into Triton's disk cache while the old
code still serves, when the reloader can), drain (new requests held, running ones finish or are aborted), flush (the prefix
cache: KV computed by old code is not reused), reload (the reloader re-executes the edited modules and
patches live objects; a layer whose class changed its `__init__` or post-load hook makes the runner rebuild
the model with the new code and load the checkpoint into it, `rebuild`), warm (the startup warm-up, while the old graphs still exist), recapture (the
decode graphs, then the prefill graphs; the reply's timings also carry recapture_decode and
recapture_prefill); then serving resumes (not a timed step). The warm step runs nothing when the reloader reports
`kernels_only` (every change inside Triton kernel bodies, their new binaries loaded for every specialisation the
old ones had: the recapture is their first launch) and no layer was rebuilt; then, with one rank and without
--full-recapture, the recapture step captures nothing either when the reloader also reports `graph_swaps` (each new binary launches as its old one did):
the captured graphs' kernel nodes are pointed at the new binaries (runtime/engine/graph_patch.py, all graphs, the
pending ones too, in milliseconds). Any failure rolls every change back and the old code keeps serving.

The reloader is anything that satisfies `ForwardReloader` below (a `typing.Protocol`: the runtime never
imports the toolkit): `read_sources()`, `plan(sources=, modules=)` (what changed: `reloaded`,
`needs_restart`), `reload(modules=, sources=)` returning a transaction (its `report`, `commit()`,
`rollback(reason)`), and `modules()` (what a reload may force); optionally `compile_ahead(sources=,
modules=)` returning (binaries compiled, seconds[, seconds of the slowest compile]). tsdev's `tsdev.hotreload.Reloader` is one (tests/test_reloader_protocol.py checks it), another
library's may be. Requests, worker reports, the reply and the events are runtime.control_protocol's models.
"""
import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kernels import checks
from runtime.control_protocol import (STEPS, KernelCheckReply, KernelCheckRequest, ReloadFinished, ReloadReply, ReloadRequest, ReloadStarted, ReloadStep,
                                      StaleDefinition, WorkerReport)
from runtime.engine.compiles import COMPILES
from runtime.engine.async_engine import AsyncEngine
from runtime.engine.errors import describe_error, stop_server
from runtime.engine.kernel_checks import KernelChecker, describe_failure, reported as reported_checks, serving_of
from runtime.engine.ranks import RankedReloader, RankLost, rank_entries, reported

REMEMBERED_IDS = 256
JIT, DRAIN, FLUSH, RELOAD, WARM, RECAPTURE = STEPS
log = logging.getLogger("runtime.server")  # `tsdev serve` prints its info lines on stderr


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
    # optional: kernels_only (bool), true when the warm-up has nothing to run, and graph_swaps ({old CUfunction:
    # (new CUfunction, threads per block, dynamic shared memory bytes)} or None; see the module's docstring)


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


class StepTimeout(Exception):
    pass


@dataclass
class _Attempt:
    request: ReloadRequest
    timings: dict = field(default_factory=dict)
    step: str = "read"
    deadline: float = float("inf")

    def check_deadline(self) -> None:
        if time.perf_counter() > self.deadline:
            raise StepTimeout(f"timed out after {self.request.timeout_s} s in step '{self.step}'; nothing was changed")


class ReloadForward:
    def __init__(self, async_engine: AsyncEngine, reloader: ForwardReloader, rank: int = 0):
        ranks = async_engine.engine.ranks  # tensor parallelism: every rank reloads the bytes rank 0 read
        self.reloader = RankedReloader(reloader, ranks) if ranks is not None else reloader
        self.async_engine, self.rank = async_engine, rank
        self.checker = KernelChecker(async_engine.engine.config.kernel_check)
        self.outcomes: OrderedDict[str, asyncio.Future[ReloadReply]] = OrderedDict()
        self.cancel_epoch = 0
        self.count = 0

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
            async with self.async_engine.control_lock:
                if epoch != self.cancel_epoch:
                    reply = ReloadReply.of(request.id, [self._worker("cancelled by continue_generation before it started")])
                elif why := self.async_engine.engine.unavailable():  # asleep: no memory to warm up or capture in
                    reply = ReloadReply.of(request.id, [self._worker(f"cannot reload the forward now: {why}")])
                else:
                    with COMPILES.expected():  # compiling is what a reload does
                        first = await self._run(request)
                    reply = ReloadReply.of(request.id, [first, *self._other_ranks(first.ok)])
        except BaseException as exc:
            outcome.set_exception(exc)
            outcome.exception()  # retrieved: a repeat of this id re-raises it; nobody else needs to (no log noise)
            raise
        outcome.set_result(reply)
        return reply

    async def check_kernels(self, request: KernelCheckRequest) -> KernelCheckReply:
        """The declared ops' checks now (`tsdev check`), between steps; ValueError for an unknown op."""
        ae, start = self.async_engine, time.perf_counter()
        if not checks.runnable(str(ae.engine.runner.device)):
            raise ValueError("kernel checks run the Triton kernels: they need CUDA, or TRITON_INTERPRET=1 on the CPU")
        serving = serving_of(ae.engine)
        async with ae.control_lock:
            with COMPILES.expected():  # a shape serving has not compiled may compile for the check: not a request's
                results = await ae.run_on_engine_thread(
                    lambda: self.checker.check_now(request.ops, serving, idle=self._idle()))
        return KernelCheckReply(ok=all(r.ok for r in results), checks=reported_checks(results),
                                ops=[c.op for c in checks.declared()], seconds=time.perf_counter() - start)

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
        attempt = _Attempt(request)
        start = time.perf_counter()
        if request.timeout_s:
            attempt.deadline = start + request.timeout_s
        ae.publish(ReloadStarted(id=request.id, n=self.count, modules=request.modules or []))
        tx, error, graphs_swapped, warm_skipped, nodes_patched = None, None, False, False, None
        rebuilt, changed, old_model, needs_restart = [], set(), None, []
        try:
            sources = await ae.run_on_engine_thread(self.reloader.read_sources)
            plan = self.reloader.plan(sources=sources, modules=request.modules)
        except Exception as exc:  # e.g. a forced module that does not exist
            return self._finish(request, self._worker(str(exc) if isinstance(exc, ValueError) else describe_error(exc)))
        if not plan.reloaded:  # nothing to run: serving is not interrupted
            timings = {"total": time.perf_counter() - start, "pause": 0.0}
            return self._finish(request, self._worker(None, timings, needs_restart=list(plan.needs_restart)))
        compile_ahead = getattr(self.reloader, "compile_ahead", None)
        jit_kernels, warnings = 0, []
        if compile_ahead is not None:  # old code keeps serving meanwhile
            async with self._step(attempt, JIT):
                try:
                    jit_kernels, _, *slowest = await asyncio.to_thread(compile_ahead, sources, request.modules)
                    if slowest:
                        attempt.timings["jit_slowest"] = slowest[0]
                except Exception as exc:  # only an optimisation: the warm step compiles what is missing
                    warnings.append(f"compiling ahead failed, kernels compile during the warm step: {describe_error(exc)}")
        checker, serving, kernel_checks = self.checker, serving_of(engine), []
        if checker.on:  # the old code's times (if nothing runs on the GPU now) and the checks' inputs, while it serves
            await ae.run_on_engine_thread(lambda: checker.prepare(serving, self._idle(), plan.reloaded))
        before_edit = checker.fingerprints()
        ae.hold(True)
        pause_start = time.perf_counter()
        try:
            async with self._step(attempt, DRAIN, running=engine.num_running):
                if request.mode == "abort":
                    await ae.between_steps(lambda: ae.abort_all(running_only=True))
                remaining = attempt.deadline - time.perf_counter()
                try:
                    await asyncio.wait_for(ae.wait_until_drained(), None if remaining == float("inf") else max(remaining, 0))
                except TimeoutError:
                    raise StepTimeout(f"timed out after {request.timeout_s} s in step '{DRAIN}' "
                                      f"({engine.num_running} request(s) still running); nothing was changed") from None
            async with self._step(attempt, FLUSH):
                await ae.between_steps(engine.flush_prefix_cache)
            async with self._step(attempt, RELOAD):
                before = init_signatures(engine.model)
                tx = await ae.run_on_engine_thread(lambda: self.reloader.reload(modules=request.modules, sources=sources))
                if not tx.report.ok:
                    raise _ReportedFailure(tx.report.error or "the reload failed")
                changed = changed_classes(before)
                rebuilt = [name or "(model)" for name, m in engine.model.named_modules() if type(m) in changed]
                if rebuilt:
                    rebuild_start = time.perf_counter()
                    try:
                        old_model = await ae.run_on_engine_thread(engine.rebuild_model)
                    except ValueError as exc:  # the checkpoint no longer fits the new code
                        restart = sorted({cls.__module__ for cls in changed})
                        raise _NeedsRestart(f"needs restart: the weights do not fit the new code of "
                                            f"{', '.join(sorted(map(class_name, changed)))}: {exc}", restart) from exc
                    finally:
                        attempt.timings["rebuild"] = time.perf_counter() - rebuild_start
                attempt.check_deadline()
            async with self._step(attempt, WARM):
                warm_skipped = not rebuilt and getattr(tx.report, "kernels_only", False)
                if not warm_skipped:
                    await ae.run_on_engine_thread(engine.warmup)
            if checker.on:
                check_start = time.perf_counter()
                try:
                    kernel_checks = await ae.run_on_engine_thread(lambda: checker.check(before_edit, serving))
                finally:
                    attempt.timings["kernel_check"] = time.perf_counter() - check_start
                failed = next((r for r in kernel_checks if not r.ok), None)
                if failed is not None and checker.mode == "strict":
                    raise _ReportedFailure(describe_failure(failed))
            async with self._step(attempt, RECAPTURE):
                graphs_swapped = True  # the decode graphs may be new even when the prefill capture then fails
                swaps = getattr(tx.report, "graph_swaps", None) if warm_skipped else None
                if swaps is not None and not (request.recapture or engine.config.full_recapture or engine.ranks is not None):
                    # (several ranks: each would patch by its own binaries; not built)
                    try:
                        nodes_patched = await ae.run_on_engine_thread(lambda: engine.patch_graphs(swaps))
                    except Exception as exc:  # set back: the graphs are captured as any reload's
                        warnings.append(f"patching the graphs failed, they were captured again: {describe_error(exc)}")
                if nodes_patched is None:
                    graph_timings = await ae.run_on_engine_thread(lambda: engine.capture_graphs(deferring=True))
                    for kind, seconds in graph_timings.items():
                        attempt.timings[f"recapture_{kind}"] = sum(seconds.values())
            tx.commit()
        except RankLost as exc:  # a wedged rank cannot roll back: nothing can run in step any more
            stop_server(f"FATAL: reload {request.id}, step '{attempt.step}': {exc}. The server stops (tsdev watch "
                        "restarts it).")
        except Exception as exc:
            error = str(exc) if isinstance(exc, (_ReportedFailure, StepTimeout)) else describe_error(exc)
            if isinstance(exc, _NeedsRestart):
                error, needs_restart = str(exc), exc.modules
            if old_model is not None:  # the old model (and its weights) serve again
                engine.restore_model(old_model)
            if tx is not None and tx.report.ok:
                tx.rollback(error)
                if graphs_swapped:
                    await self._recapture_old_code(error)
        finally:
            ae.hold(False)
            attempt.timings["pause"] = time.perf_counter() - pause_start
            checker.forget_drawn()
        if error is None and kernel_checks:  # the new code's times, serving resumed (if nothing runs yet)
            await ae.run_on_engine_thread(lambda: checker.time_new(kernel_checks, serving, idle=self._idle()))
        attempt.timings["total"] = time.perf_counter() - start
        old_model = None
        fields = reported(tx.report) if tx is not None else {}
        if rebuilt:
            fields["rebuilt"] = rebuilt
            if error is None:  # the rebuilt instances ran the new __init__: not stale any more
                classes = set(map(class_name, changed))
                fields["stale"] = [s for s in fields["stale"] if s.name not in classes]
        if needs_restart:
            fields["needs_restart"] = sorted({*fields.get("needs_restart", []), *needs_restart})
        fields["jit_kernels"] = jit_kernels or fields.get("jit_kernels", 0)
        fields["kernels_only"] = warm_skipped
        fields["graph_nodes_patched"] = nodes_patched or 0
        fields["kernel_checks"] = reported_checks(kernel_checks)
        attempt.timings.setdefault(JIT, 0.0)
        return self._finish(request, self._worker(error, attempt.timings, warnings=warnings, **fields))

    def _idle(self) -> bool:
        """Nothing runs on the GPU: no request, no step in flight (on the engine thread)."""
        engine = self.async_engine.engine
        return engine.num_running == 0 and engine.in_flight is None

    def _finish(self, request: ReloadRequest, worker: WorkerReport) -> WorkerReport:
        log.info(log_line(request.id, worker))
        self.async_engine.publish(ReloadFinished(type="reload_finished" if worker.ok else "reload_failed",
                                                 id=request.id, n=self.count, worker=worker))
        return worker

    async def _recapture_old_code(self, why: str) -> None:
        """Graphs were replaced by ones of the new code: recapture them with the restored old code."""
        try:
            await self.async_engine.run_on_engine_thread(
                lambda: self.async_engine.engine.capture_graphs(strict=False))  # prefill may fall back to eager
        except Exception as exc:
            stop_server(f"FATAL: after a failed reload ({why}), recapturing the CUDA graphs with the old code failed: "
                        f"{describe_error(exc)}. The server cannot serve safely and stops.")

    def _step(self, attempt: _Attempt, name: str, **started):
        """A timed step; `started`: more fields of its ReloadStep "started" event."""
        return _TimedStep(self.async_engine, attempt, name, started)


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


class _TimedStep:
    def __init__(self, async_engine: AsyncEngine, attempt: _Attempt, name: str, started: dict):
        self.async_engine, self.attempt, self.name, self.started = async_engine, attempt, name, started

    async def __aenter__(self):
        self.attempt.step = self.name
        self.start = time.perf_counter()
        self.async_engine.publish(ReloadStep(id=self.attempt.request.id, step=self.name, state="started",
                                             **self.started))
        return self

    async def __aexit__(self, exc_type, exc, tb):
        seconds = time.perf_counter() - self.start
        self.attempt.timings[self.name] = seconds
        self.async_engine.publish(ReloadStep(id=self.attempt.request.id, step=self.name,
                                             state="failed" if exc else "done", seconds=seconds))
        return False


def log_line(request_id: str, worker: WorkerReport) -> str:
    """The server log's line for one reload: 'reload r-12 ok: kernels.ops.activation + 3 dependent(s), paused
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
