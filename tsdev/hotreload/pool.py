"""A warm pool of compiler processes for the kernels of an edit, so that an edit's kernels compile side by side
instead of one after another on the serving thread (as torch inductor's asynchronous compile keeps its workers).
Each worker keeps its own copy of the reloadable packages at the server's newest sources and writes binaries into
Triton's disk cache, where the reload's load finds them. How it starts, what it compiles and how it fails:
docs/hotreload.md ("Triton").
"""
from __future__ import annotations

import multiprocessing
import os
import sys
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Mapping, Sequence

from . import compile_worker
from .ahead import Compiled, Job


class CompilePool:
    def __init__(self, packages: Sequence[str], workers: int, target: Any = None, modules: Sequence[str] | None = None):
        """`target` (Triton's GPUTarget of the serving device): warm each worker's compiler for it. `modules`: what each
        worker imports as it starts -- the serving process's modules of `packages` (`imported`), so a worker holds what
        the server runs and nothing more (a module for an optional extra, the CuTe DSL's, stays out unless the server
        uses it); None: every module of the packages. A module whose source `compile` brings and the worker lacks is
        imported then."""
        self.packages, self.workers, self.target = tuple(packages), workers, target
        self.modules = None if modules is None else tuple(modules)
        self.restarts = 0
        self._executor: ProcessPoolExecutor | None = None
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold a CUDA context
        self._executor = ProcessPoolExecutor(self.workers, mp_context=context, initializer=compile_worker.init,
                                             initargs=(self.packages, _plain(self.target), os.getpid(), self.modules))
        for _ in range(self.workers):  # start every worker now: importing Triton and torch takes seconds
            self._executor.submit(compile_worker.ready)

    def aim(self, target: Any, modules: Sequence[str] | None) -> None:
        """For a pool started before the serving device was known (`target` None, `modules` ()): its target now,
        and the serving process's modules; each worker (as they take the tasks) warms its compiler for the target
        and imports those modules (one that lacks them imports them when a compile needs them)."""
        self.target, self.modules = target, None if modules is None else tuple(modules)
        for _ in range(self.workers):
            self._executor.submit(compile_worker.warm, _plain(target), self.modules or ())

    def pids(self) -> list[int]:
        """The workers' process ids (once started)."""
        return [p.pid for p in (getattr(self._executor, "_processes", None) or {}).values()]

    def wait_ready(self, timeout: float = 120) -> None:
        """Block until every worker has imported what it compiles with (tests, benchmarks)."""
        futures = [self._executor.submit(compile_worker.ready) for _ in range(self.workers)]
        for future in futures:
            future.result(timeout)

    def compile(self, sources: Mapping[str, bytes], jobs: Sequence[Job]) -> list[Compiled]:
        """Compile `jobs` concurrently (one task each), every worker first at `sources` (module -> source bytes of
        the tracked modules). Results in the order of `jobs`. A broken pool is replaced and the batch run again,
        once."""
        if not jobs:
            return []
        try:
            return self._run(sources, jobs)
        except BrokenProcessPool:
            self.restarts += 1
            self.close()
            self._start()
            return self._run(sources, jobs)

    def _run(self, sources: Mapping[str, bytes], jobs: Sequence[Job]) -> list[Compiled]:
        futures: list[Future] = [self._executor.submit(compile_worker.compile_job, dict(sources), job) for job in jobs]
        return [future.result() for future in futures]

    def close(self) -> None:
        if self._executor is None:
            return
        processes = list((getattr(self._executor, "_processes", None) or {}).values())  # shutdown() forgets them
        self._executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(5)
        self._executor = None


def _plain(target: Any) -> tuple | None:
    """A GPUTarget as plain values: unpickling the object would import Triton before the worker drops
    TRITON_INTERPRET."""
    return None if target is None else (target.backend, target.arch, target.warp_size)


def imported(packages: Sequence[str]) -> list[str]:
    """The modules of `packages` this process has imported that hold a Triton or Gluon kernel or `@jit` helper (their
    own or imported): `CompilePool`'s `modules`. A worker imports those (and what they import), never the model code
    around them, so that an edit's reload in a worker re-runs only what a compile reads (`benchmarks/worker_reload.py`:
    0.022 s before an activation edit's compile on two cores, 0.025 s re-running the models and layers too)."""
    from . import jit
    from .snapshot import under

    def holds_kernels(name: str) -> bool:
        module = sys.modules.get(name)
        return module is not None and any(jit.is_kernel(value) for value in list(vars(module).values()))

    return sorted(name for name in list(sys.modules) if under(name, packages) and holds_kernels(name))
