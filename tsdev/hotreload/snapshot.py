"""Which modules we track, and the source each one last ran.

Change detection compares file *contents*, never mtimes: editors, formatters
and `git checkout` all move mtimes without changing code (and vice versa).
"""
from __future__ import annotations

import importlib.util
import linecache
import sys
import tomllib
from pathlib import Path
from types import ModuleType

DEFAULT_PACKAGES = ("tsdev_runtime.models", "tsdev_runtime.layers", "tsdev_runtime.moe", "tsdev_runtime.sampling",
                    "tsdev_kernels.ops")


def _project_config(project_root: str | Path | None) -> tuple[Path, dict] | None:
    """(the folder, its parsed pyproject.toml) of the nearest pyproject.toml at or above `project_root` (default:
    the current directory), or None."""
    start = Path(project_root or Path.cwd()).resolve()
    for folder in (start, *start.parents):
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            with open(pyproject, "rb") as f:
                return folder, tomllib.load(f)
    return None


def default_packages(project_root: str | Path | None = None) -> list[str]:
    """`[tool.tsdev] reload-packages` of the nearest pyproject.toml, else DEFAULT_PACKAGES.

    Lets tsdev drive another codebase by configuration instead of code.
    """
    found = _project_config(project_root)
    config = found[1].get("tool", {}).get("tsdev", {}) if found else {}
    return list(config.get("reload-packages", DEFAULT_PACKAGES))


def import_roots(project_root: str | Path) -> list[Path]:
    """The folders a project's top-level packages are imported from: `[tool.setuptools.packages.find] where` of its
    pyproject.toml (this project: the root, runtime/ and kernels/), else the project folder itself. A process run
    on a copy of the project puts these first on its path to import the copy."""
    project = Path(project_root).resolve()
    found = _project_config(project)
    if found is None or found[0] != project:
        return [project]
    where = found[1].get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get("where", ["."])
    return [(project / folder).resolve() for folder in where]


def under(name: str, packages) -> bool:
    """True when module `name` is one of `packages` or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in packages)


def source_path(module: ModuleType) -> str | None:
    """The .py file a module was executed from (None for builtins, extensions, namespaces)."""
    spec = getattr(module, "__spec__", None)
    path = getattr(spec, "origin", None) or getattr(module, "__file__", None)
    return path if isinstance(path, str) and path.endswith(".py") else None


def loaded_modules(roots) -> dict[str, str]:
    """{name: path} of the loaded modules under the top-level packages `roots`."""
    found = {}
    for name, module in list(sys.modules.items()):
        if module is not None and under(name, roots):
            path = source_path(module)
            if path:
                found[name] = path
    return found


def read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # deleted or being replaced by an atomic save: not a change yet
        return None


def pin_lines(path: str, source: bytes) -> None:
    """Make `linecache` (so `inspect`, tracebacks, Triton) see `source` for `path`.

    Triton reads a kernel's source through `inspect.getsourcelines` when it is
    decorated and the interpreter re-reads it on first launch; both must see
    the bytes that actually ran, not whatever is on disk now. An entry with
    mtime None is never invalidated by `linecache.checkcache`. A rollback pins
    the previous source again.
    """
    text = importlib.util.decode_source(source)
    linecache.cache[path] = (len(source), None, text.splitlines(keepends=True), path)
