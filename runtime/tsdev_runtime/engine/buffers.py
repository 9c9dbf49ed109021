"""Compiling ahead on an editor's unsaved buffer (POST /v1/rl/engine/compile_ahead, `tsdev reload --ahead`): the Triton
kernels that the buffer's text changes are built into Triton's disk cache while the old code serves, and nothing is
reloaded, so that the save's reload finds them built (its jit step a cache hit) and save -> serving loses the compile.

Why it is shaped so:
* One build at a time: the compile pool is shared with the reloads' jit step. A newer buffer of a file supersedes its
  older one still waiting (typing on makes the older text moot); buffers of other files wait their turn.
* The reloader is left to the build (the control's lock) only while it reads the sources and runs the text aside
  (milliseconds: the reloader's `prepared` callback says when); the compiles that follow run in the pool's processes
  while the control's other calls take their turns. A reload whose sources are the ones being built (the buffer
  saved as it was sent) waits for the build and finds its binaries; a reload of other text does not wait.
* Never on the engine's thread: reading, parsing and running the text aside happen in a worker thread, as the
  reload's own jit step.
"""
from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.control_protocol import CompileAheadReply, CompiledAhead
from tsdev_runtime.engine.errors import describe_error
from tsdev_runtime.engine.reload_forward import ForwardReloader
from tsdev_runtime.engine.steps import Loop


class Owner(Protocol):
    """What a build uses of the engine's control (EngineControl): a Protocol, since the control imports this."""
    config: EngineConfig
    loop: Loop
    lock: asyncio.Lock
    reloader: ForwardReloader


@dataclass
class _Buffer:
    module: str
    path: Path
    text: str
    reply: asyncio.Future
    id: str | None = None
    arrived: float = field(default_factory=time.perf_counter)


@dataclass
class _Building:
    sources: Mapping[str, bytes]  # what it builds: the files on disk, the buffer in place of its file
    done: asyncio.Future


class BufferCompiles:
    """The builds of editors' buffers, one at a time, newest buffer per file."""

    def __init__(self, control: Owner):
        self.control = control
        self.waiting: dict[str, _Buffer] = {}  # module -> its newest buffer not started yet, oldest first
        self.building: _Building | None = None
        self._runner: asyncio.Task | None = None

    def files(self) -> dict[Path, str]:
        """file (resolved) -> module, for every module a reload may re-execute."""
        return module_files(self.control.reloader.modules())

    def roots(self) -> list[Path]:
        """The reloadable packages' directories (a single-module package: its file): where a buffer's path may lie."""
        return package_roots(self.control.reloader.modules())

    async def compile(self, path: Path, text: str, request_id: str | None = None) -> CompileAheadReply:
        """Build the kernels `text` changes for the file at `path` (resolved, inside `roots`), in its turn."""
        module = self.files().get(path)
        if module is None:
            return CompileAheadReply(path=str(path), id=request_id, outcome="nothing", ok=True,
                                     reason=f"{path} is not a module the server has imported: nothing of it runs yet")
        buffer = _Buffer(module, path, text, asyncio.get_running_loop().create_future(), request_id)
        if (older := self.waiting.pop(module, None)) is not None:
            older.reply.set_result(_reply(older, "superseded", reason="a newer buffer of this file came before this "
                                                                      "one's turn: that one is built instead"))
        self.waiting[module] = buffer
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await asyncio.shield(buffer.reply)

    async def settled(self, sources: Mapping[str, bytes]) -> None:
        """Return once no build of exactly `sources` runs: a reload of the text being built waits for its binaries."""
        building = self.building
        if building is not None and building.sources == sources:
            await asyncio.wait([building.done])

    async def _run(self) -> None:
        while self.waiting:
            buffer = self.waiting.pop(next(iter(self.waiting)))
            try:
                reply = await self._build(buffer)
            except asyncio.CancelledError:  # the server stops: every caller hears so
                for left in (buffer, *self.waiting.values()):
                    left.reply.set_result(_reply(left, "failed", error="the server stopped before it was built"))
                self.waiting.clear()
                raise
            except Exception as exc:
                reply = _reply(buffer, "failed", error=describe_error(exc))
            buffer.reply.set_result(reply)

    async def _build(self, buffer: _Buffer) -> CompileAheadReply:
        control, loop = self.control, asyncio.get_running_loop()
        prepared = loop.create_future()

        def on_prepared() -> None:  # (from the build's thread)
            loop.call_soon_threadsafe(lambda: prepared.done() or prepared.set_result(None))

        async with control.lock:  # the reloader is the build's while it reads the sources and runs the text aside
            waited = time.perf_counter() - buffer.arrived
            sources, early = await asyncio.to_thread(self._sources, buffer)
            if early is not None:
                return early.model_copy(update={"waited": round(waited, 6)})
            build = asyncio.ensure_future(asyncio.to_thread(control.reloader.compile_ahead, sources, None, on_prepared))
            self.building = _Building(sources, build)
            await asyncio.wait([build, prepared], return_when=asyncio.FIRST_COMPLETED)
        try:  # the pool compiles; reloads and the other control calls take their turns meanwhile
            binaries, seconds, *rest = await build
        except Exception as exc:  # a kernel of the text does not compile: the save's reload will say where
            return self._said(_reply(buffer, "failed", waited=waited, error=str(exc) or describe_error(exc)))
        finally:
            self.building = None
        slowest = rest[0] if rest else 0.0
        kernels, reused = (list(rest[1]), bool(rest[2])) if len(rest) >= 3 else ([], False)
        if not binaries:
            return _reply(buffer, "nothing", waited=waited, reason=self._why_nothing(rest[3] if len(rest) >= 4 else 0))
        return self._said(_reply(buffer, "compiled", waited=waited, compiled=binaries, kernels=kernels, reused=reused,
                                 seconds=seconds, slowest=slowest))

    def _said(self, reply: CompileAheadReply) -> CompileAheadReply:
        """A build (or a kernel that failed to build) is an event: the watch daemon shows it. What built nothing, or
        a syntax error mid-edit, is only answered."""
        self.control.loop.publish(CompiledAhead(reply=reply))
        return reply

    def _sources(self, buffer: _Buffer) -> tuple[dict[str, bytes], CompileAheadReply | None]:
        """(the sources to build: the files, the buffer in place of its own; a reply when there is nothing to build)."""
        try:
            compile(buffer.text, str(buffer.path), "exec", dont_inherit=True)
        except SyntaxError as exc:  # mid-edit: said, not raised (the save's reload reports it too)
            return {}, _reply(buffer, "failed", error=f"{buffer.path}:{exc.lineno}: SyntaxError: {exc.msg}")
        reloader = self.control.reloader
        sources = {**reloader.read_sources(), buffer.module: buffer.text.encode()}
        if buffer.module not in reloader.plan(sources=sources).reloaded:
            return sources, _reply(buffer, "nothing", reason=f"the server runs this text of {buffer.module} already")
        return sources, None

    def _why_nothing(self, on_disk: int = 0) -> str:
        if on_disk:
            return (f"the binaries this text needs ({on_disk}) are in Triton's cache already (a version built "
                    "before): saving it reloads without compiling")
        if not self.control.config.device.startswith("cuda"):
            return (f"on {self.control.config.device} Triton's interpreter runs the kernels: there are no binaries to "
                    "build (on a GPU the kernels this text changes are built here)")
        return ("no kernel the server has compiled changes with this text (its Triton kernels, and those calling its "
                "@jit helpers, hash as before)")


def _reply(buffer: _Buffer, outcome: str, waited: float = 0.0, seconds: float = 0.0, slowest: float = 0.0,
           **fields) -> CompileAheadReply:
    return CompileAheadReply(path=str(buffer.path), id=buffer.id, module=buffer.module, outcome=outcome,
                             ok=outcome != "failed", waited=round(waited, 6), seconds=round(seconds, 6),
                             slowest=round(slowest, 6), **fields)


def module_files(modules: Iterable[str]) -> dict[Path, str]:
    """file (resolved) -> module name, for each of `modules` loaded from a file."""
    found = {}
    for name in modules:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            found[Path(file).resolve()] = name
    return found


def package_roots(modules: Iterable[str]) -> list[Path]:
    """The directories of the outermost packages among `modules` (a module with no package among them: its file)."""
    names, roots = set(modules), []
    for name in sorted(names):
        if any(name.startswith(other + ".") for other in names):
            continue
        module = sys.modules.get(name)
        where = list(getattr(module, "__path__", None) or [])
        if where:
            roots.append(Path(where[0]))
        elif getattr(module, "__file__", None):
            roots.append(Path(module.__file__))
    return roots
