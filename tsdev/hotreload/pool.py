"""A warm pool of compiler processes for the kernels of an edit, so that an edit's kernels compile side by side
instead of one after another on the serving thread (as torch inductor's asynchronous compile keeps its workers).
Each worker keeps its own copy of the reloadable packages at the server's newest sources and writes binaries into
Triton's disk cache, where the reload's load finds them. How it starts, what it compiles and how it fails:
docs/hotreload.md ("Triton").
"""
from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import pkgutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Mapping, Sequence

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
        self._executor = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_init_worker,
                                             initargs=(self.packages, _plain(self.target), os.getpid(), self.modules))
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


# --- in the worker ------------------------------------------------------------------------------------------------

_reloader = None


def _plain(target: Any) -> tuple | None:
    """A GPUTarget as plain values: unpickling the object would import Triton before the worker drops
    TRITON_INTERPRET."""
    return None if target is None else (target.backend, target.arch, target.warp_size)


def imported(packages: Sequence[str]) -> list[str]:
    """The modules of `packages` this process has imported (`CompilePool`'s `modules`)."""
    from .snapshot import under

    return sorted(name for name in list(sys.modules) if under(name, packages))


def _init_worker(packages: tuple[str, ...], target: tuple | None, server_pid: int, modules: tuple[str, ...] | None
                 ) -> None:
    global _reloader
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the terminal's whole process group
    threading.Thread(target=_exit_with, args=(server_pid,), daemon=True).start()
    os.environ.pop("TRITON_INTERPRET", None)  # binaries, not the interpreter's rewritten Python
    import triton  # noqa: F401

    from .reloader import Reloader

    if modules is None:
        modules = []
        for package in packages:
            module = importlib.import_module(package)
            modules += [info.name for info in pkgutil.walk_packages(getattr(module, "__path__", []), package + ".")]
    _import(modules)
    _reloader = Reloader(packages)
    if target is not None:
        from triton.backends.compiler import GPUTarget

        _warm_compiler(GPUTarget(*target))


def _exit_with(server_pid: int) -> None:
    """End this worker once the server is gone (then this process is re-parented)."""
    while os.getppid() == server_pid:
        time.sleep(1.0)
    os._exit(0)


def _warm_compiler(target: Any) -> None:
    """Compile a throwaway kernel for `target` into a scratch cache: the first compile in a process loads and sets up
    the backend (about a second); later ones take what their kernel takes."""
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    @triton.jit
    def touch(X):
        tl.store(X, tl.load(X) + 1)

    with tempfile.TemporaryDirectory() as scratch, _environ(TRITON_CACHE_DIR=scratch):
        triton.compile(ASTSource(touch, {"X": "*fp32"}, {}, {}), target=target, options={"num_warps": 1})


@contextlib.contextmanager
def _environ(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _import(modules) -> bool:
    """Import those of `modules` not imported yet; whether any was."""
    new = [name for name in modules if name not in sys.modules]
    for name in new:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional extra not installed (the CuTe DSL's): the server cannot run it either
            pass
    return bool(new)


def _ready() -> int:
    return os.getpid()


def _compile(sources: dict[str, bytes], job: Job) -> Compiled:
    """Bring this worker's modules to `sources`, then compile the job's kernel; errors come back, never raise."""
    import triton

    from . import jit

    start = time.perf_counter()
    if _import(name for name in sources if _reloader.reloadable(name)):  # what the server imported since
        _reloader.modules()  # (it tracks what was just imported)
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
        triton.compile(jit.ast_source(kernel)(kernel, signature, constexprs, attrs), target=job.target, options=options)
    except Exception as exc:
        code = jit.base_function(kernel).__code__
        return Compiled(job, time.perf_counter() - start,
                        f"{code.co_filename}:{code.co_firstlineno}: {type(exc).__name__}: {exc}")
    return Compiled(job, time.perf_counter() - start)
