"""The Reloader: what changed, what depends on it, and the reload transaction."""
from __future__ import annotations

import ast
import dataclasses
import gc
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from . import ahead, graph, jit
from .snapshot import default_packages, loaded_modules, pin_lines, read, under
from .transaction import ReloadError, Transaction


@dataclass
class Plan:
    """What a reload would do, in the order it would do it."""
    reloaded: list[str]  # changed or forced modules, provider order
    dependents: list[str]  # reloadable modules using them, provider order
    needs_restart: list[str]  # changed modules outside the reloadable packages
    order: list[str]  # reloaded + dependents as they will be executed

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class _Source:
    """One version of a module's source, compiled once and reused (dependents re-run it)."""
    source: bytes
    code: types.CodeType | None = None
    providers: set[str] | None = None  # from its imports; None until compiled


class Reloader:
    """Re-executes edited modules of `packages` in place, with their dependents.

    Construct it once the packages are imported: it records each loaded
    module's current source as the code that ran. Not thread-safe: call it from
    one thread while the program is quiescent (the engine drains first).
    """

    def __init__(self, packages: Sequence[str] | None = None, pool: ahead.Compiler | None = None,
                 compile_later: bool = False) -> None:
        self.packages = tuple(packages) if packages else tuple(default_packages())
        self.pool = pool  # compile_ahead's processes (a CompilePool, tsdev/hotreload/pool.py); None: in this process
        self.roots = tuple(sorted({p.split(".")[0] for p in self.packages}))
        self._ran: dict[str, tuple[str, _Source]] = {}  # module -> (path, source it last ran)
        self._latest: dict[str, _Source] = {}  # module -> newest source seen, compiled
        self._pending: Transaction | None = None
        self._compile_s = 0.0  # time spent compiling, for the report's timings
        self._commits = 0  # reloads committed: the code that runs changed
        self._built: tuple | None = None  # (what compile_ahead was called with, what it did): its last build
        self._compiling: threading.Thread | None = None  # compile_later's, until a method waits for it
        self._track()
        if not compile_later:  # (a server listens first, then calls compile_in_background: 0.1 s on 2 cores)
            self._graph()

    def compile_in_background(self) -> None:
        """Compile every reloadable module (so that the first reload is as fast as the rest) on a thread of its
        own, for a Reloader made with `compile_later`: each method here waits for it before it reads or changes what
        the Reloader holds."""
        self._compiling = threading.Thread(target=self._graph, name="reloader-compile", daemon=True)
        self._compiling.start()

    def _settle(self) -> None:
        if self._compiling is not None:
            self._compiling.join()
            self._compiling = None

    def reloadable(self, module: str) -> bool:
        return under(module, self.packages)

    def read_sources(self, modules: Iterable[str] | None = None) -> dict[str, bytes]:
        """Current file contents of the tracked modules (all of them by default).

        A multi-rank server calls this on rank 0 and passes the result to every
        rank's `reload(sources=...)`, so all ranks run the same bytes.
        """
        self._settle()
        self._track()
        names = self._ran if modules is None else modules
        found = {}
        for name in names:
            if name in self._ran and (data := read(self._ran[name][0])) is not None:
                found[name] = data
        return found

    def plan(self, sources: Mapping[str, bytes] | None = None, modules: Iterable[str] | None = None) -> Plan:
        """Changed modules (plus the forced `modules`), their dependents and what needs a restart."""
        self._settle()
        sources = self.read_sources() if sources is None else sources
        changed = [m for m, data in sources.items() if m in self._ran and data != self._ran[m][1].source]
        forced = list(modules or [])
        for m in forced:
            if m not in self._ran or not self.reloadable(m):
                raise ReloadError(f"cannot reload {m}: it is not a loaded module under {', '.join(self.packages)}")
        roots = {m for m in changed if self.reloadable(m)} | set(forced)
        providers = {m: self._providers(m, sources.get(m)) for m in self._ran if self.reloadable(m)}
        deps = graph.dependents(roots, providers, self.reloadable)
        rank = {name: i for i, name in enumerate(sys.modules)}
        order = graph.provider_order(roots | set(deps), providers, rank)
        return Plan(reloaded=[m for m in order if m in roots], dependents=[m for m in order if m not in roots],
                    needs_restart=sorted(m for m in changed if not self.reloadable(m)), order=order)

    def modules(self) -> list[str]:
        """The loaded modules under the reloadable packages (what `reload(modules=...)` accepts)."""
        self._settle()
        self._track()
        return sorted(m for m in self._ran if self.reloadable(m))

    def graph(self) -> dict[str, list[str]]:
        """{module: modules it uses}, for every tracked reloadable module."""
        self._settle()
        return self._graph()

    def _graph(self) -> dict[str, list[str]]:
        return {m: sorted(self._providers(m, None)) for m in self._ran if self.reloadable(m)}

    def compile_ahead(self, sources: Mapping[str, bytes] | None = None, modules: Iterable[str] | None = None,
                      prepared: Callable[[], None] | None = None) -> ahead.Ahead:
        """Compile the edited Triton kernels into Triton's disk cache before `reload` (safe while serving), in
        `pool`'s processes side by side when there is one.

        Returns (binaries compiled, seconds, seconds of the slowest compile, kernels' names, reused). The warm-up
        after the reload then loads instead of compiling. The same call again (the same sources and forced modules,
        no commit since and no binary added to the live kernels: an editor's buffer compiled ahead, then saved as it
        was) compiles nothing: `reused`, what it built is in Triton's cache.

        `prepared()` is called once this no longer needs the program left to it (ahead.py): the rest may overlap a
        reload. Until then, as every other method, call it from one thread at a time.
        """
        done, start = prepared or (lambda: None), time.perf_counter()
        try:
            self._settle()
            sources = self.read_sources() if sources is None else sources
            key = (dict(sources), tuple(modules or ()), self._commits, jit.binaries_held(self._modules()))
            if self._built is not None and self._built[0] == key:
                done()
                return self._built[1]._replace(seconds=time.perf_counter() - start, slowest=0.0, reused=True)
            plan = self.plan(sources, modules)
        except BaseException:
            done()
            raise
        # Only the edited modules: a dependent executed aside would import the live (old) providers.
        built = ahead.compile_ahead(plan.reloaded, sources, {m: self._ran[m][0] for m in plan.reloaded},
                                    {m: self._ran[m][1].source for m in plan.reloaded}, self._modules(), self.pool,
                                    prepared)
        if built.binaries:
            self._built = (key, built)
        return built

    def reload(self, modules: Iterable[str] | None = None, sources: Mapping[str, bytes] | None = None) -> Transaction:
        """Re-execute changed (and forced) modules and their dependents, patching live objects.

        Never raises for a broken edit: the returned transaction's report says
        what failed (file:line) and everything is already rolled back.
        """
        self._settle()
        if self._pending is not None:
            raise RuntimeError("the previous reload is still pending: commit() or rollback() it first")
        start = time.perf_counter()
        tx = Transaction(self, self.roots)
        timings = tx.report.timings
        files = set()
        # A reload allocates enough to trigger a full collection, which takes 50-100 ms in a process
        # holding torch (measured): let the collector wait until the reload is done.
        collecting = gc.isenabled()
        gc.disable()
        try:
            if sources is None:
                sources = self.read_sources()
            timings["read"] = time.perf_counter() - start
            self._compile_s = 0.0
            plan = self.plan(sources, modules)  # compiles the changed sources to find their imports
            tx.report.reloaded, tx.report.dependents = plan.reloaded, plan.dependents
            tx.report.needs_restart = plan.needs_restart
            files = {self._ran[m][0] for m in plan.order}
            running = {m: sources.get(m, self._ran[m][1].source) for m in plan.order}
            code = {m: self._compile(m, running[m]).code for m in plan.order}
            timings["compile"] = self._compile_s
            timings["plan"] = time.perf_counter() - start - timings["read"] - self._compile_s
            previous = {m: self._ran[m][1].source for m in plan.order}
            tx._apply(plan.order, code, running, previous, self._modules(), self._old_code(plan.order, previous))
        except BaseException as e:
            tx._fail(e, files)
            if not isinstance(e, Exception):
                raise
        finally:
            timings["total"] = time.perf_counter() - start
            if collecting:
                gc.enable()
        if tx.state == "pending":
            self._pending = tx
        return tx

    # -- bookkeeping -----------------------------------------------------------
    def _committed(self, tx: Transaction) -> None:
        for name, source in tx.executed.items():
            self._ran[name] = (self._ran[name][0], self._compile(name, source))
        self._commits += 1
        self._pending = None
        self._track()

    def _finished(self, tx: Transaction) -> None:
        if self._pending is tx:
            self._pending = None

    def _track(self) -> None:
        """Start tracking modules imported since last time; their current source is what ran."""
        for name, path in loaded_modules(self.roots).items():
            if name not in self._ran and (data := read(path)) is not None:
                self._ran[name] = (path, _Source(data))
                pin_lines(path, data)

    def _old_code(self, order: list[str], previous: dict[str, bytes]) -> dict[str, types.CodeType | None]:
        """The code each module last ran (compiled when the Reloader was built, or at the last commit)."""
        found = {}
        for name in order:
            try:
                found[name] = self._compile(name, previous[name]).code
            except SyntaxError:
                found[name] = None
        return found

    def _modules(self) -> list[types.ModuleType]:
        return [sys.modules[m] for m in self._ran if m in sys.modules]

    def _compile(self, name: str, source: bytes) -> _Source:
        """Compile (once per version) and find the imports; SyntaxError names file:line."""
        path, ran = self._ran[name]
        for cached in (ran, self._latest.get(name)):
            if cached is not None and cached.source == source and cached.code is not None:
                return cached
        start = time.perf_counter()
        try:
            tree = ast.parse(source, filename=path)
            code = compile(tree, path, "exec", dont_inherit=True)
        finally:
            self._compile_s += time.perf_counter() - start
        is_package = hasattr(sys.modules.get(name), "__path__")
        entry = _Source(source, code, graph.static_providers(tree, code, name, is_package, self._ran))
        if ran.source == source:
            self._ran[name] = (path, entry)
        else:
            self._latest[name] = entry
        return entry

    def _providers(self, name: str, source: bytes | None) -> set[str]:
        """Static imports of the source that would run (falling back to the one that ran), plus live references."""
        ran = self._ran[name][1]
        static = set()
        for candidate in (source, ran.source):
            if candidate is None:
                continue
            try:
                static = self._compile(name, candidate).providers
                break
            except SyntaxError:
                continue
        module = sys.modules.get(name)
        live = graph.runtime_providers(module, set(self._ran)) if module is not None else set()
        return static | live
