"""reload_forward: run new forward-pass code in a live server, keeping weights, KV pools and graphs' pool.

Steps, each timed: jit (edited Triton kernels compiled ahead into Triton's disk cache while the old
code still serves, when the reloader can), drain (new requests held, running ones finish or are aborted), flush (the prefix
cache: KV computed by old code is not reused), reload (the reloader re-executes the edited modules and
patches live objects), warm (the startup warm-up, while the old graphs still exist), recapture (the
decode graphs, then the prefill graphs; the reply's timings also carry recapture_decode and
recapture_prefill); then serving resumes (not a timed step). Any failure rolls every change back and the
old code keeps serving.

The reloader is anything with `read_sources()`, `plan(sources=, modules=)` and `reload(modules=, sources=)`
returning a transaction (`report`, `commit()`, `rollback()`), optionally `compile_ahead(sources=, modules=)`:
tsdev's `tsdev.hotreload.Reloader`, or another library's.
"""
import asyncio
import sys
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field

from runtime.engine.async_engine import AsyncEngine

REMEMBERED_IDS = 256


@dataclass
class ReloadRequest:
    id: str
    mode: str = "wait"  # wait: running requests finish first; abort: they are aborted
    modules: list[str] | None = None  # force these modules (and their dependents) to re-execute
    timeout_s: float | None = None  # bounds drain + reload


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
    def __init__(self, async_engine: AsyncEngine, reloader, rank: int = 0):
        self.async_engine, self.reloader, self.rank = async_engine, reloader, rank
        self.outcomes: OrderedDict[str, asyncio.Future] = OrderedDict()
        self.cancel_epoch = 0
        self.count = 0

    async def __call__(self, request: ReloadRequest) -> dict:
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
                    reply = self._reply(request, [self._worker("cancelled by continue_generation before it started")])
                else:
                    reply = self._reply(request, [await self._run(request)])
        except BaseException as exc:
            outcome.set_exception(exc)
            raise
        outcome.set_result(reply)
        return reply

    def cancel_pending(self) -> None:
        """continue_generation: reloads still waiting for their turn give up."""
        self.cancel_epoch += 1

    def _reply(self, request: ReloadRequest, workers: list[dict]) -> dict:
        return {"id": request.id, "ok": all(w["ok"] for w in workers), "workers": workers}

    def _worker(self, error: str | None, report: dict | None = None, timings: dict | None = None, **extra) -> dict:
        """This rank's entry of the reply: ok when `error` is None; the rest from the reloader's report."""
        report = report or {}
        return {"rank": self.rank, "ok": error is None, "error": error,
                "reloaded": report.get("reloaded", []), "dependents": report.get("dependents", []),
                "patched": report.get("patched", 0), "stale": report.get("stale", []),
                "needs_restart": report.get("needs_restart", []), "jit_kernels": report.get("jit_kernels", 0),
                "warnings": [], "timings": {k: round(v, 6) for k, v in (timings or {}).items()}, **extra}

    async def _run(self, request: ReloadRequest) -> dict:
        ae, engine = self.async_engine, self.async_engine.engine
        self.count += 1
        attempt = _Attempt(request)
        start = time.perf_counter()
        if request.timeout_s:
            attempt.deadline = start + request.timeout_s
        ae.publish({"type": "reload_started", "id": request.id, "n": self.count, "modules": request.modules or []})
        tx, error, graphs_swapped = None, None, False
        try:
            sources = await ae.run_on_engine_thread(self.reloader.read_sources)
            plan = self.reloader.plan(sources=sources, modules=request.modules)
        except Exception as exc:  # e.g. a forced module that does not exist
            return self._finish(request, self._worker(str(exc) if isinstance(exc, ValueError) else describe_error(exc)))
        if not plan.reloaded:  # nothing to run: serving is not interrupted
            timings = {"total": time.perf_counter() - start, "pause": 0.0}
            return self._finish(request, self._worker(None, {"needs_restart": plan.needs_restart}, timings))
        compile_ahead = getattr(self.reloader, "compile_ahead", None)
        jit_kernels, warnings = 0, []
        if compile_ahead is not None:  # old code keeps serving meanwhile
            async with self._step(attempt, "jit"):
                try:
                    jit_kernels, _ = await asyncio.to_thread(compile_ahead, sources, request.modules)
                except Exception as exc:  # only an optimisation: the warm step compiles what is missing
                    warnings.append(f"compiling ahead failed, kernels compile during the warm step: {describe_error(exc)}")
        ae.hold(True)
        pause_start = time.perf_counter()
        try:
            async with self._step(attempt, "drain"):
                if request.mode == "abort":
                    await ae.between_steps(lambda: ae.abort_all(running_only=True))
                remaining = attempt.deadline - time.perf_counter()
                try:
                    await asyncio.wait_for(ae.wait_until_drained(), None if remaining == float("inf") else max(remaining, 0))
                except TimeoutError:
                    raise StepTimeout(f"timed out after {request.timeout_s} s in step 'drain' "
                                      f"({len(engine.scheduler.running)} request(s) still running); nothing was changed") from None
            async with self._step(attempt, "flush"):
                await ae.between_steps(engine.block_manager.flush)
            async with self._step(attempt, "reload"):
                tx = await ae.run_on_engine_thread(lambda: self.reloader.reload(modules=request.modules, sources=sources))
                if not tx.report.ok:
                    raise _ReportedFailure(tx.report.error or "the reload failed")
                attempt.check_deadline()
            async with self._step(attempt, "warm"):
                await ae.run_on_engine_thread(engine.runner.warmup)
            async with self._step(attempt, "recapture"):
                graphs_swapped = True  # the decode graphs may be new even when the prefill capture then fails
                graph_timings = await ae.run_on_engine_thread(engine.runner.capture_graphs)
                for kind, seconds in graph_timings.items():
                    attempt.timings[f"recapture_{kind}"] = sum(seconds.values())
            tx.commit()
        except Exception as exc:
            error = str(exc) if isinstance(exc, (_ReportedFailure, StepTimeout)) else describe_error(exc)
            if tx is not None and tx.report.ok:
                tx.rollback(error)
                if graphs_swapped:
                    await self._recapture_old_code(error)
        finally:
            ae.hold(False)
            attempt.timings["pause"] = time.perf_counter() - pause_start
            attempt.timings["total"] = time.perf_counter() - start
        report = tx.report.to_dict() if tx is not None else {}
        attempt.timings.setdefault("jit", 0.0)
        worker = self._worker(error, report, attempt.timings, warnings=warnings,
                              jit_kernels=jit_kernels or report.get("jit_kernels", 0))
        return self._finish(request, worker)

    def _finish(self, request: ReloadRequest, worker: dict) -> dict:
        self.async_engine.publish({"type": "reload_finished" if worker["ok"] else "reload_failed", "id": request.id,
                                   "n": self.count, "worker": worker})
        return worker

    async def _recapture_old_code(self, why: str) -> None:
        """Graphs were replaced by ones of the new code: recapture them with the restored old code."""
        try:
            await self.async_engine.run_on_engine_thread(
                lambda: self.async_engine.engine.runner.capture_graphs(strict=False))  # prefill may fall back to eager
        except Exception as exc:
            print(f"FATAL: after a failed reload ({why}), recapturing the CUDA graphs with the old code failed: "
                  f"{describe_error(exc)}. The server cannot serve safely and stops.", file=sys.stderr, flush=True)
            import os
            os._exit(70)

    def _step(self, attempt: _Attempt, name: str):
        return _TimedStep(self.async_engine, attempt, name)


class _ReportedFailure(Exception):
    """A failure the reloader already described (with file:line) and rolled back."""


class _TimedStep:
    def __init__(self, async_engine: AsyncEngine, attempt: _Attempt, name: str):
        self.async_engine, self.attempt, self.name = async_engine, attempt, name

    async def __aenter__(self):
        self.attempt.step = self.name
        self.start = time.perf_counter()
        self.async_engine.publish({"type": "reload_step", "id": self.attempt.request.id, "step": self.name,
                                   "state": "started"})
        return self

    async def __aexit__(self, exc_type, exc, tb):
        seconds = time.perf_counter() - self.start
        self.attempt.timings[self.name] = seconds
        self.async_engine.publish({"type": "reload_step", "id": self.attempt.request.id, "step": self.name,
                                   "state": "failed" if exc else "done", "seconds": seconds})
        return False


def describe_error(exc: BaseException) -> str:
    """'file:line: Type: message', pointing at the deepest frame of the project's own code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" not in f.filename
              and not f.filename.startswith(sys.base_prefix)]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(exc).__name__}: {exc}"
