"""A `tsdev serve` started ahead of need: the interpreter up and the heavy libraries imported (torch, Triton, the HTTP
stack), waiting for its arguments on stdin. `ServerProcess` keeps one beside a running server (`standby=True`, as
`tsdev watch` does) and hands it the next start, so a restart pays neither the interpreter nor those imports.

It imports the CLI and the runtime too, as they are on disk when it starts (`Project`), noting each module's source
file; a `prepare` line (sent as the old server is told to stop, after the save that restarts it) drops the modules
whose file changed since and every project module that imports one of them, and imports those again: only what the
edit touched is read after the save (an engine file and its importers, not the kernels). The arguments follow once
the old server has exited (the GPU and the port are free), and what changed meanwhile (or since the standby started,
when no `prepare` came: a crashed server's restart) is imported again then. On a GPU it loads the kernels' binaries
the last start compiled (`preload_binaries`): a few MB of code, no other GPU memory. Like a server, it dies with its
parent. An empty stdin (the parent closed it or died) ends it quietly. On a GPU it creates its
CUDA context as it starts (TSDEV_STANDBY_DEVICE: the device the next start serves on), so that the start's load pays
none of it; the standby is started once the running server's checks are done, never beside them.

    python -m tsdev.launch.standby   # then one line on stdin: the JSON list of `tsdev` arguments, e.g. ["serve", ...]
                                     # (optionally after a line `prepare`)
"""
import ast
import contextlib
import gc
import importlib
import json
import os
import sys
import time
from pathlib import Path

from tsdev.launch.child import DEVICE_ENV, HANDED_OVER_ENV, PREPARE, warm_triton_key


PROJECT_PACKAGES = ("tsdev", "tsdev_runtime", "tsdev_kernels")
ENTRY_MODULES = ("tsdev_runtime.engine.llm_engine", "tsdev_runtime.server.app", "tsdev.cli")  # what a start imports


class Project:
    """The project's modules this process imported (`import_now`), each module's source file and its stamp (size and
    modification time) then, and which project modules each uses (tsdev/hotreload/graph.py's providers: its imports
    and what its namespace holds, as a reload finds them). `refresh` drops the
    modules whose file changed since and their importers, and imports the entry modules again: the edit's modules
    are read from disk now, the others are not. An import that fails is left to the start, which imports again and
    reports it as any start does (then nothing is kept: the start imports everything)."""

    def __init__(self):
        self.stamps: dict[str, tuple[int, int] | None] = {}  # module -> its file's stamp when imported (None: unsure)
        self.uses: dict[str, set[str]] = {}  # module -> the project modules it uses

    def import_now(self) -> None:
        """The entry modules imported (what is not imported yet), the stamps of the modules imported now noted."""
        since = time.time_ns()  # a file written from here on may be newer than what was imported: unsure
        if not _import(ENTRY_MODULES):
            self.stamps, self.uses = {}, {}
            _drop(list(project_modules()))
            return
        modules = project_modules()
        for name, path in modules.items():
            if name in self.stamps:  # imported before, and unchanged since
                continue
            stamp = _stamp(path)
            self.stamps[name] = stamp if stamp is not None and stamp[0] < since else None
            self.uses[name] = providers(name, path, set(modules))

    def changed(self) -> set[str]:
        """The modules whose file changed since they were imported, and every module using one of them."""
        from tsdev.hotreload.graph import dependents

        modules = project_modules()
        stale = {name for name, stamp in self.stamps.items()
                 if stamp is None or name not in modules or _stamp(modules[name]) != stamp}
        stale |= set(dependents(stale, self.uses, lambda name: True))
        for name in list(stale):  # a package's submodules were imported through it
            if modules.get(name, "").endswith("__init__.py"):
                stale |= {m for m in modules if m.startswith(name + ".")}
        return stale

    def refresh(self) -> None:
        stale = self.changed() if self.stamps else set(project_modules())
        _drop(sorted(stale))
        for name in stale:
            self.stamps.pop(name, None)
            self.uses.pop(name, None)
        importlib.invalidate_caches()
        self.import_now()


def project_modules() -> dict[str, str]:
    """The project's modules imported in this process, with their source files."""
    found = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] in PROJECT_PACKAGES and path and path.endswith(".py"):
            found[name] = path
    return found


def providers(name: str, path: str, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (its source at `path`) uses: `static_providers` and
    `runtime_providers` of tsdev/hotreload/graph.py, as a reload's dependents are found. Its source unreadable: what
    its namespace holds only."""
    from tsdev.hotreload.graph import runtime_providers, static_providers

    found = runtime_providers(sys.modules[name], known)
    try:
        tree = ast.parse(Path(path).read_text())
        return found | static_providers(tree, compile(tree, path, "exec"), name, path.endswith("__init__.py"), known)
    except (OSError, SyntaxError, ValueError):
        return found


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _drop(names: list[str]) -> None:
    """Forget these modules: the next import reads them again (their parent packages lose the attribute, or a
    `from package import module` would find the old one)."""
    for name in names:
        sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and getattr(sys.modules[parent], child, None) is not None:
            with contextlib.suppress(AttributeError):
                delattr(sys.modules[parent], child)


def _import(names) -> bool:
    try:
        for name in names:
            importlib.import_module(name)
    except BaseException:  # noqa: BLE001  (SystemExit included: the start reports it)
        return False
    return True


def preload_binaries() -> int:
    """The kernels' binaries the last start on this GPU compiled (the newest warm-up manifest for its architecture and
    this Triton: tsdev/hotreload/manifest.py), loaded into this process now, while the old server still serves: the
    warm-up after the restart then finds them in memory (it read each from Triton's disk cache, 0.8-1.0 s on the H100
    for 31-32 of them). Kernels whose module the edit changes are imported again by `Project.refresh` and load theirs
    at their first launch, as before. How many loaded (0 when there is nothing to load or it fails)."""
    try:
        import torch
        import triton

        from tsdev.hotreload import manifest
        from tsdev_kernels.cache import cache_dir

        major, minor = torch.cuda.get_device_capability()
        found = sorted((cache_dir() / "warmup").glob(f"sm{major * 10 + minor}-triton{triton.__version__}-*.json"),
                       key=lambda path: path.stat().st_mtime)
        return manifest.preload(manifest.read(found[-1]), torch.cuda.current_device()) if found else 0
    except Exception:  # noqa: BLE001  (a start loads them itself)
        return 0


def init_cuda(device: str) -> bool:
    """The CUDA context, made now (a few hundred MB of the GPU's memory beside the running server): a start's `load`
    included it (0.5-1 s on the H200). Nothing on the CPU or without a GPU. False when it cannot be made now (a GPU
    in exclusive-process mode, held by the running server): torch keeps that error, so this process could not serve;
    it ends, and the restart is an ordinary start."""
    import torch

    if device.startswith("cpu") or not torch.cuda.is_available():
        return True
    try:
        torch.zeros(1, device=device or "cuda")
    except RuntimeError:
        return False
    return True


def prepare(project: Project):
    """The old server stops for a restart: connect to it (before it reaches its offer), then import again what the
    save changed while a thread receives its weights and copies them (handover.py); what was received. The stopping
    server waits for the copy (its memory is what the copy reads), not for the imports."""
    from concurrent.futures import ThreadPoolExecutor

    from tsdev_runtime.weights import handover

    offer = handover.connect()
    with ThreadPoolExecutor(1, thread_name_prefix="handover") as pool:
        receiving = pool.submit(handover.receive, offer)
        project.refresh()
        return receiving.result()


def main() -> int:
    import fastapi  # noqa: F401  what every start imports first, and the slow part of it
    import httpx  # noqa: F401  the CLI's, the server's and the chat template's libraries, not the project's
    import jinja2.sandbox  # noqa: F401
    import prometheus_client  # noqa: F401
    import rich.console  # noqa: F401
    import safetensors.torch  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import typer  # noqa: F401
    import uvicorn  # noqa: F401

    try:
        import triton  # noqa: F401
    except ImportError:  # a platform without it: the server says what it needs
        pass
    if (device := os.environ.get(DEVICE_ENV)) is not None and not init_cuda(device):
        return 0
    if device is not None and not device.startswith("cpu") and torch.cuda.is_available() and "triton" in sys.modules:
        warm_triton_key()
    project = Project()
    project.import_now()
    if (device is not None and not device.startswith("cpu") and torch.cuda.is_available() and project.stamps
            and torch.device(device or "cuda").index in (None, torch.cuda.current_device())):
        preload_binaries()
    gc.collect()  # what it imported and loaded, out of the collector's reach: the server's start then collects
    gc.freeze()  # only what the start made (`freeze_heap`; 0.1-0.13 s of a walk over everything on the H100)
    line = sys.stdin.readline()
    received = None
    if line.strip() == PREPARE:
        received = prepare(project)
        line = sys.stdin.readline()
    if not line.strip():
        return 0
    os.environ[HANDED_OVER_ENV] = repr(time.time())  # the server's startup line counts from here, not the wait
    project.refresh()  # what changed since `prepare`, or since the standby started when none came (a crash's restart)
    if received is not None:
        from tsdev_runtime.weights import handover

        handover.hold(received)  # (the module as the start imports it, after the refresh)
        received = None  # the start frees the copies once its model holds them
    from tsdev.cli import app

    app(args=json.loads(line), prog_name="tsdev")
    return 0


if __name__ == "__main__":
    sys.exit(main())
