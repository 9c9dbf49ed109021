"""Editor saves -> settled batches of changed modules.

What an editor does on save is not one clean event (docs/watch.md, "What happens on a save"): vim deletes and re-adds
the file after creating a `4913` probe file, atomic savers write a temp file and rename it over the
original, and a formatter writes again ~100 ms later. So the watcher keeps only `.py` files of packages,
waits until the directories have been quiet for `settle` seconds, then looks at what is on disk: a path
counts when the file exists and its content differs from the last content seen. Directories are
watched, never single files (a rename would lose the watch).

The settle is on the path from save to serving, so the first sight of a reloadable file's new text -- a few ms after
the save, before the settle -- is handed to `early` (`Watcher.batches`): the daemon has the server build that text's
kernels then (the route an editor's unsaved buffer takes), and the settled reload of the same text finds them built
or being built.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib.util
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from watchfiles import awatch

from tsdev.hotreload.snapshot import import_roots, under

DEBOUNCE_MS = 1600  # the longest burst of saves gathered into one batch (watchfiles' default)
SIGHT_MS = 10  # the quiet time before watchfiles reports changes: the settle's first part, the early sight's delay


def module_name(path: str | Path) -> str | None:
    """The dotted name of a `.py` file inside regular packages (`__init__.py` up the tree), else None."""
    path = Path(path).resolve()
    if path.suffix != ".py":
        return None
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts) if parts and (path.parent / "__init__.py").is_file() else None


def classify_files(paths: Iterable[str | Path]) -> tuple[list[str], list[str], list[str]]:
    """For `tsdev reload --file`: (reloadable modules, other modules of the same top-level packages,
    ignored files). Which packages are reloadable comes from the pyproject.toml above each file's
    top-level package, so the answer does not depend on the current directory."""
    from tsdev.hotreload import default_packages

    reload, other, ignored = [], [], []
    for path in paths:
        name = module_name(path)
        if name is None:
            ignored.append(str(path))
            continue
        depth = name.count(".") + (Path(path).name == "__init__.py")
        packages = default_packages(Path(path).resolve().parents[depth])  # the folder holding the top package
        if under(name, packages):
            reload.append(name)
        elif name.split(".")[0] in {p.split(".")[0] for p in packages}:
            other.append(name)
        else:
            ignored.append(str(path))
    return sorted(set(reload)), sorted(set(other)), ignored


@dataclass
class Packages:
    """Where the watched top-level packages live and which of their modules can be reloaded in place."""
    reloadable: tuple[str, ...]  # e.g. tsdev_runtime.layers, tsdev_kernels.ops
    dirs: dict[str, Path]  # top-level package -> its directory, e.g. tsdev_runtime -> /proj/runtime/tsdev_runtime
    project: Path | None = None  # shown paths are relative to it

    @classmethod
    def locate(cls, reloadable: Iterable[str], project: Path) -> Packages:
        """Find each top-level package in the project's import roots first (pyproject.toml's
        `[tool.setuptools.packages.find] where`), then where Python would import it from."""
        reloadable = tuple(reloadable)
        roots = import_roots(project)
        dirs = {}
        for root in sorted({p.split(".")[0] for p in reloadable}):
            folder = next((r / root for r in roots if (r / root / "__init__.py").is_file()), None)
            if folder is None:
                spec = importlib.util.find_spec(root)
                if spec is None or not spec.submodule_search_locations:
                    raise FileNotFoundError(f"cannot find package {root!r} (from [tool.tsdev] reload-packages) "
                                            f"under {project} or on the Python path: run from the project root")
                folder = Path(list(spec.submodule_search_locations)[0])
            dirs[root] = folder.resolve()
        return cls(reloadable, dirs, project.resolve())

    def module(self, path: str | Path) -> str | None:
        """The module a file holds, if it lies in one of the watched packages."""
        name = module_name(path)
        if name is None or name.split(".")[0] not in self.dirs:
            return None
        return name if Path(path).resolve().is_relative_to(self.dirs[name.split(".")[0]]) else None

    def is_reloadable(self, module: str) -> bool:
        return under(module, self.reloadable)

    def files(self) -> list[Path]:
        return sorted(p for d in self.dirs.values() for p in d.rglob("*.py") if "__pycache__" not in p.parts)

    def reloadable_modules(self) -> list[str]:
        return sorted({m for p in self.files() if (m := self.module(p)) and self.is_reloadable(m)})

    def display(self, path: str | Path) -> str:
        """A short path for the screen: relative to the project, else to the folder that holds the packages."""
        path = Path(path).resolve()
        bases = [*([self.project] if self.project else []), *(folder.parent for folder in self.dirs.values())]
        base = next((b for b in bases if path.is_relative_to(b)), None)
        return str(path.relative_to(base)) if base else str(path)


@dataclass
class Changes:
    """One settled burst of saves."""
    files: list[str] = field(default_factory=list)  # display paths
    reload: list[str] = field(default_factory=list)  # changed modules inside the reloadable packages
    restart: list[str] = field(default_factory=list)  # changed modules outside them: the server restarts
    saved_at: float | None = None  # the newest change's modification time (time.time() clock)

    def __bool__(self) -> bool:
        return bool(self.files)

    def merge(self, other: Changes) -> Changes:
        def union(a, b):
            return sorted(set(a) | set(b))
        return Changes(union(self.files, other.files), union(self.reload, other.reload),
                       union(self.restart, other.restart),
                       max(filter(None, (self.saved_at, other.saved_at)), default=None))


def _digest(path: Path) -> str | None:
    try:
        return _hash(path.read_bytes())
    except OSError:  # gone again, or mid-rename
        return None


def _hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class Watcher:
    def __init__(self, packages: Packages, settle: float = 0.05):
        self.packages, self.settle = packages, settle
        self.seen: dict[str, str] = {}
        self.sighted: dict[str, str] = {}  # path -> digest of the text last handed to `early`
        self.ready = asyncio.Event()  # set once the OS watches exist (saves before that are missed)
        self.rescan()

    def rescan(self) -> None:
        """Take the current contents as the baseline (after a server start, which imports them)."""
        self.seen = {str(p): d for p in self.packages.files() if (d := _digest(p))}

    @staticmethod
    def keep(change, path: str) -> bool:
        """watchfiles filter: package sources only (no probe files, temp names without .py, caches, dotfiles)."""
        p = Path(path)
        return p.suffix == ".py" and "__pycache__" not in p.parts and not p.name.startswith(".")

    def compare(self, paths: Iterable[str]) -> Changes:
        """What really changed among `paths`: existing files with new content, as modules."""
        out = Changes()
        for p in sorted({Path(path).resolve() for path in paths}):
            path = str(p)
            module = self.packages.module(p)
            digest = _digest(p) if module else None  # None: gone (deleted, or a temp name renamed away)
            if digest is None or self.seen.get(path) == digest:
                continue
            self.seen[path] = digest
            out.saved_at = max(out.saved_at or 0.0, _modified(p))
            out.files.append(self.packages.display(p))
            (out.reload if self.packages.is_reloadable(module) else out.restart).append(module)
        return out

    async def batches(self, stop: asyncio.Event,
                      early: Callable[[Path, str], None] | None = None) -> AsyncIterator[Changes]:
        """Yield each settled burst of real changes until `stop` is set. `early(path, text)`: each reloadable file's
        new text as soon as it is seen, before the settle ends, when it parses (a file caught mid-write does not)."""
        sighted = None if early is None else (lambda paths: self._sight(paths, early))
        async for paths in settled(list(self.packages.dirs.values()), self.settle, stop, self.ready, self.keep,
                                   sighted):
            if changes := self.compare(paths):
                yield changes

    def _sight(self, paths: Iterable[str], early: Callable[[Path, str], None]) -> None:
        for p in sorted({Path(path).resolve() for path in paths}):
            module = self.packages.module(p)
            if module is None or not self.packages.is_reloadable(module):
                continue
            try:
                data = p.read_bytes()
                text = data.decode()
                compile(text, str(p), "exec", dont_inherit=True)
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
                continue
            digest = _hash(data)
            if digest != self.seen.get(str(p)) and digest != self.sighted.get(str(p)):
                self.sighted[str(p)] = digest
                early(p, text)


async def settled(dirs: list[Path], settle: float, stop: asyncio.Event, ready: asyncio.Event | None = None,
                  keep=None, sighted: Callable[[set[str]], None] | None = None) -> AsyncIterator[set[str]]:
    """The paths changed under `dirs` (watched with watchfiles, filtered by `keep`), one set per burst that has
    been quiet for `settle` seconds (each new change restarts the quiet period, for at most DEBOUNCE_MS), until `stop`
    is set; `ready` is set once the OS watches exist. `sighted(paths)`: each group of changes as watchfiles reports
    it (after SIGHT_MS of quiet), before the burst's settle ends."""
    raw: asyncio.Queue[set[str] | None] = asyncio.Queue()
    step_ms = max(1, min(SIGHT_MS, round(settle * 1000)))

    async def pump() -> None:
        try:
            async for changes in awatch(*dirs, watch_filter=keep, stop_event=stop, debounce=DEBOUNCE_MS, step=step_ms):
                raw.put_nowait({path for _, path in changes})
        finally:
            raw.put_nowait(None)  # watching ended

    task = asyncio.create_task(pump(), name="watchfiles")
    await asyncio.sleep(0)  # the task runs until awatch's first wait: its OS watches exist by then
    if ready is not None:
        ready.set()
    loop = asyncio.get_running_loop()
    try:
        while (paths := await raw.get()) is not None:
            ends = loop.time() + DEBOUNCE_MS / 1000
            more: set[str] | None = paths
            while more is not None:
                if sighted is not None:
                    sighted(more)
                try:  # watchfiles waited step_ms of quiet already
                    more = await asyncio.wait_for(raw.get(), max(0.0, min(settle - step_ms / 1000, ends - loop.time())))
                except TimeoutError:
                    break
                if more is None:
                    yield paths
                    return
                paths |= more
            yield paths
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
