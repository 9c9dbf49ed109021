"""A reload as a transaction: it fully applies, or every in-place change is undone.

The server needs this because a reload is only half the job: warm-up and CUDA
graph capture run *after* the code changed and can still fail, and then the
old code must keep serving as if nothing happened.
"""
from __future__ import annotations

import dataclasses
import sys
import time
import traceback
import types
from dataclasses import dataclass, field

from . import cute, jit
from .patch import Patcher, same_code
from .snapshot import pin_lines, under

# Names a re-executed module keeps: what the import system set, not what its code did.
_IMPORT_STATE = ("__name__", "__file__", "__spec__", "__loader__", "__package__", "__path__",
                 "__builtins__", "__cached__")


class ReloadError(ValueError):
    """A request the reloader cannot honour (e.g. an unknown forced module); its message is the whole story."""


@dataclass
class Report:
    """What a reload did; `to_dict()` is the JSON a server sends back per worker."""
    ok: bool = True
    reloaded: list[str] = field(default_factory=list)  # changed (or forced) modules re-executed
    dependents: list[str] = field(default_factory=list)  # re-executed because they use those
    patched: int = 0  # live objects updated in place or redirected
    stale: list[dict] = field(default_factory=list)  # {name, reason, where, referrers}
    needs_restart: list[str] = field(default_factory=list)  # changed outside the reloadable packages
    jit_kernels: int = 0  # Triton kernels that will compile again on next launch
    kernels: dict[str, str] = field(default_factory=dict)  # module.name -> dialect ("triton", "gluon", "cute") of
    #                                         each kernel whose binaries this reload replaced or dropped, or whose code
    #                                         it changed (CuTe DSL: compiled again on the next call)
    kernels_only: bool = False  # only kernel bodies changed, their new binaries loaded: no warm-up needed
    # with kernels_only: {old CUfunction: (new CUfunction, threads, shared bytes)}, what captured graphs' kernel
    # nodes can be pointed at instead of capturing again; None when a new binary launches differently
    graph_swaps: dict[int, tuple[int, int, int]] | None = None
    # module.name -> seconds of each kernel whose new binaries compiled inside the reload (none found compiled ahead)
    compiled_in_pause: dict[str, float] = field(default_factory=dict)
    # seconds: read plan compile execute patch kernels stale total
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # "file:line: Type: message"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        if not self.ok:
            return f"reload failed: {self.error}"
        line = (f"reloaded {', '.join(self.reloaded) or 'nothing'} and {len(self.dependents)} dependent module(s), "
                f"{self.patched} object(s) patched in {self.timings.get('total', 0.0):.3f} s")
        if self.stale:
            line += f"; stale: {', '.join(s['name'] for s in self.stale)}"
        if self.needs_restart:
            line += f"; needs restart: {', '.join(self.needs_restart)}"
        return line


class Transaction:
    """Returned by `Reloader.reload()`; call `commit()` or `rollback()` exactly once.

    A reload that failed has already rolled itself back (`report.ok` is False);
    `rollback()` on it is a no-op, `commit()` raises.
    """

    def __init__(self, reloader, roots: tuple[str, ...]) -> None:
        self.report = Report()
        self.state = "pending"  # -> "committed" | "rolled back"
        self.exception: BaseException | None = None  # with its traceback, for logs
        self.executed: dict[str, bytes] = {}  # module -> source now running
        self._reloader = reloader
        self._roots = roots
        self._patcher = Patcher()
        self._saved: list[dict] = []  # module namespaces before re-execution

    def commit(self) -> None:
        """Keep the new code: its sources become the baseline for the next reload."""
        if self.state != "pending":
            raise RuntimeError(f"cannot commit a reload that is {self.state}: {self.report.error}")
        self.state = "committed"
        self._reloader._committed(self)
        self._release()

    def rollback(self, reason: str | None = None) -> None:
        """Undo every change this reload made; the code that ran before runs again."""
        if self.state == "rolled back":
            return
        if self.state == "committed":
            raise RuntimeError("cannot roll back a committed reload")
        failures = []
        for undo in reversed(self._patcher.undo):
            try:
                undo()
            except Exception as e:  # keep undoing the rest; report what could not be
                failures.append(f"{type(e).__name__}: {e}")
        self.state = "rolled back"
        self.report.ok = False
        self.report.error = self.report.error or reason or "rolled back by the caller"
        if failures:
            self.report.error += f" (rollback incomplete: {'; '.join(failures)})"
        self._reloader._finished(self)
        self._release()

    # -- used by Reloader ------------------------------------------------------
    def _apply(self, order: list[str], code: dict[str, types.CodeType], sources: dict[str, bytes],
               previous: dict[str, bytes], tracked: list[types.ModuleType],
               old_code: dict[str, types.CodeType | None] | None = None) -> None:
        patcher, timings = self._patcher, self.report.timings
        kernels_only = old_code is not None
        before = set(sys.modules)
        patcher.undo.append(lambda: _forget_new_modules(before, self._roots))
        patcher.undo.append(jit.snapshot_registry())
        for name in order:
            module = sys.modules[name]
            ns = vars(module)
            saved = dict(ns)
            self._saved.append(saved)
            patcher.undo.append(lambda ns=ns, saved=saved: (ns.clear(), ns.update(saved)))
            path = code[name].co_filename
            pin_lines(path, sources[name])
            patcher.undo.append(lambda path=path, src=previous[name]: pin_lines(path, src))
            patcher.note_code(module, (old_code or {}).get(name), code[name])
            _clear(ns)
            start = time.perf_counter()
            exec(code[name], ns)
            middle = time.perf_counter()
            patcher.module(module, saved)
            kernels_only = kernels_only and _same_but_kernels((old_code or {}).get(name), code[name], ns)
            timings["execute"] = timings.get("execute", 0.0) + middle - start
            timings["patch"] = timings.get("patch", 0.0) + time.perf_counter() - middle
            self.executed[name] = sources[name]
        start = time.perf_counter()
        jit.refresh_callers(patcher, tracked)
        self.report.kernels_only = kernels_only and jit.load_binaries(patcher)
        self.report.graph_swaps = patcher.graph_swaps if self.report.kernels_only else None
        self.report.compiled_in_pause = dict(patcher.compiled_in_pause)
        timings["kernels"] = time.perf_counter() - start
        start = time.perf_counter()
        patcher.find_live_stale(self._saved, tracked)  # a heap scan, only when an __init__ or a lambda changed
        cute.find_stale(patcher, self._saved, tracked)  # another, only when a CuTe DSL function changed
        patcher.describe_stale(ignore=self._saved)
        timings["stale"] = time.perf_counter() - start
        self.report.patched = patcher.patched
        self.report.stale = patcher.stale
        self.report.jit_kernels = patcher.jit_kernels
        self.report.kernels = {**jit.named_dialects(patcher.kernels_reset),
                               **{f"{module}.{name}": "cute" for module, names in patcher.cute_changed.items()
                                  for name in names}}

    def _fail(self, exc: BaseException, files: set[str]) -> None:
        self.exception = exc
        self.report.error = describe_error(exc, files)
        self.rollback()

    def _release(self) -> None:
        self._patcher = Patcher()  # drop the undo log: it pins every old object
        self._saved = []


def describe_error(exc: BaseException, files: set[str]) -> str:
    """`file:line: Type: message`, pointing into the reloaded code when the error came from there."""
    if isinstance(exc, (ReloadError, jit.KernelCompileError)):
        return str(exc)
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}"
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f.filename in files]
    where = (ours or frames or [None])[-1]
    location = f"{where.filename}:{where.lineno}: " if where else ""
    return f"{location}{type(exc).__name__}: {exc}"


def _same_but_kernels(old: types.CodeType | None, new: types.CodeType, ns: dict) -> bool:
    """A module's new code does what the old did but inside the bodies of its Triton kernels."""
    bodies = frozenset(fn.__qualname__ for fn in map(jit.base_function, filter(jit.is_kernel, ns.values())) if fn)
    return old is not None and same_code(old, new, bodies)


def _clear(ns: dict) -> None:
    """Empty a namespace as a fresh import would find it (submodules stay: the import system set them)."""
    name = ns["__name__"]
    for key, value in list(ns.items()):
        is_child = isinstance(value, types.ModuleType) and value.__name__ == f"{name}.{key}"
        if key not in _IMPORT_STATE and not is_child:
            del ns[key]
    ns["__doc__"] = None


def _forget_new_modules(before: set[str], roots) -> None:
    """Modules first imported by a reload that is undone must be imported afresh next time."""
    for name in [n for n in sys.modules if n not in before and under(n, roots)]:
        del sys.modules[name]
