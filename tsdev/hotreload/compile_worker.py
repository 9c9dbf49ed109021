"""What runs inside a `CompilePool` worker process (tsdev/hotreload/pool.py): it starts by importing the kernel modules
the server runs (and warming Triton's compiler), brings its copy of those modules to the server's newest sources with
its own `Reloader` (the sources of modules it does not hold -- the models, the layers -- are not a compile's
business), and compiles one kernel per task into Triton's disk cache. Errors come back as `Compiled.error`,
never raised. The pool imports this module; this module never imports the pool.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from . import jit
from .ahead import Compiled, Job
from .reloader import Reloader

_reloader = None  # this worker's, at the server's newest sources


def init(packages: tuple[str, ...], target: tuple | None, server_pid: int, modules: tuple[str, ...] | None) -> None:
    """The pool's initializer: import `modules` (None: every module of `packages`), then track them."""
    global _reloader
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the terminal's whole process group
    threading.Thread(target=_exit_with, args=(server_pid,), daemon=True).start()
    os.environ.pop("TRITON_INTERPRET", None)  # binaries, not the interpreter's rewritten Python
    import torch  # noqa: F401  every kernel module's: seconds on a fresh machine, side by side with the server's
    import triton  # noqa: F401

    if modules is None:
        modules = []
        for package in packages:
            module = importlib.import_module(package)
            modules += [info.name for info in pkgutil.walk_packages(getattr(module, "__path__", []), package + ".")]
    _import(modules)
    _reloader = Reloader(packages)
    if target is not None:
        warm(target)


def warm(target: tuple, modules: tuple[str, ...] = ()) -> None:
    """Warm this worker's compiler for `target` (a GPUTarget's plain values), with `modules` imported and tracked."""
    from triton.backends.compiler import GPUTarget

    if _import(modules):
        _reloader.modules()
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


def ready() -> int:
    return os.getpid()


def compile_job(sources: dict[str, bytes], job: Job) -> Compiled:
    """Bring this worker's modules to `sources`, then compile the job's kernel; errors come back, never raise."""
    import triton

    start = time.perf_counter()
    if _import([job.module]):  # (a kernel module imports what its kernels read: only those follow `sources`)
        _reloader.modules()  # (it tracks what was just imported)
    tx = _reloader.reload(sources=sources)
    if not tx.report.ok:
        return Compiled(job, time.perf_counter() - start, f"the edit did not load: {tx.report.error}")
    tx.commit()
    kernel = jit.jit_layer(getattr(sys.modules.get(job.module), job.name, None))
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
