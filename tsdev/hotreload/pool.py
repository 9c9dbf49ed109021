"""A warm pool of compiler processes for the kernels of an edit (the way torch inductor's asynchronous compile keeps
its workers): each process has imported Triton and the reloadable packages before any edit arrives, keeps its copy
of them at the server's newest sources (it applies each batch of sources through its own `Reloader`), and compiles
the kernels it is given for the specialisations the serving process had compiled. The binaries land in Triton's
disk cache, keyed by source, specialisation and target, where the reload's `jit.load_binaries` finds them: the
kernels of an edit compile side by side instead of one after another on the serving process's thread.

Workers compile for an explicit target (no GPU context: they hold no device memory) and never run Triton's
interpreter (TRITON_INTERPRET is dropped before they import Triton: the interpreter has no binaries). A worker that
dies breaks the pool (`concurrent.futures`' rule); the next call starts a new pool and runs again once.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import pkgutil
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class Job:
    """Compile the kernel at `module`.`name` (its JIT layer, under any autotune/heuristics wrappers), as the worker's
    copy of the sources defines it, for one specialisation: `spec` = (signature, constexprs, attrs, options dict)."""
    module: str
    name: str
    spec: tuple
    target: Any


@dataclass(frozen=True)
class Compiled:
    job: Job
    seconds: float
    error: str | None = None  # "file:line: Type: message" of the kernel that did not compile


class CompilePool:
    def __init__(self, packages: Sequence[str], workers: int):
        self.packages, self.workers = tuple(packages), workers
        self.restarts = 0
        self._executor: ProcessPoolExecutor | None = None
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold a CUDA context
        self._executor = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_init_worker,
                                             initargs=(self.packages,))
        for _ in range(self.workers):  # start every worker now: importing Triton and torch takes seconds
            self._executor.submit(_ready)

    def pids(self) -> list[int]:
        """The workers' process ids (once started)."""
        return [p.pid for p in (getattr(self._executor, "_processes", None) or {}).values()]

    def wait_ready(self, timeout: float = 120) -> None:
        """Block until every worker has imported what it compiles with (tests, benchmarks)."""
        futures = [self._executor.submit(_ready) for _ in range(self.workers)]
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
        futures: list[Future] = [self._executor.submit(_compile, dict(sources), job) for job in jobs]
        return [future.result() for future in futures]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            for process in list((getattr(self._executor, "_processes", None) or {}).values()):
                if process.is_alive():
                    process.terminate()
            self._executor = None


# --- in the worker ------------------------------------------------------------------------------------------------

_reloader = None


def _init_worker(packages: tuple[str, ...]) -> None:
    global _reloader
    os.environ.pop("TRITON_INTERPRET", None)  # binaries, not the interpreter's rewritten Python
    import triton  # noqa: F401

    from .reloader import Reloader

    for package in packages:
        module = importlib.import_module(package)
        for info in pkgutil.walk_packages(getattr(module, "__path__", []), package + "."):
            importlib.import_module(info.name)
    _reloader = Reloader(packages)


def _ready() -> int:
    return os.getpid()


def _compile(sources: dict[str, bytes], job: Job) -> Compiled:
    """Bring this worker's modules to `sources`, then compile the job's kernel; errors come back, never raise."""
    import triton
    from triton.compiler import ASTSource

    from . import jit

    start = time.perf_counter()
    tx = _reloader.reload(sources=sources)
    if not tx.report.ok:
        return Compiled(job, time.perf_counter() - start, f"the edit did not load: {tx.report.error}")
    tx.commit()
    kernel = next((layer for layer in jit._stack(getattr(sys.modules[job.module], job.name, None))
                   if "device_caches" in vars(layer)), None)
    if kernel is None:
        return Compiled(job, time.perf_counter() - start, f"{job.module}.{job.name} is no Triton kernel now")
    signature, constexprs, attrs, options = job.spec
    start = time.perf_counter()
    try:
        triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=job.target, options=options)
    except Exception as exc:
        code = jit.base_function(kernel).__code__
        return Compiled(job, time.perf_counter() - start,
                        f"{code.co_filename}:{code.co_firstlineno}: {type(exc).__name__}: {exc}")
    return Compiled(job, time.perf_counter() - start)
