"""The binaries a server's start compiled (its warm-up and graph captures), written down once it serves, so that the
next start of the same thing hands them to the compile pool (tsdev/hotreload/pool.py) as it begins: they compile side
by side while the model loads, and the warm-up finds them in Triton's disk cache instead of compiling one after
another (a fresh H100's first start: 34 compiles, 13.3 s of its warm-up).

A manifest is a JSON list, one entry per binary: the kernel's module and attribute, and the specialisation Triton's
JIT compiled (signature, constexprs and attributes with their index paths as lists, the options that differ from the
backend's defaults for that target). Binaries whose constexprs are no JSON value (a dtype, a function) are left out:
those compile in the warm-up, as before. An entry that no longer fits the code (the kernel gone, a new argument)
fails in its worker and costs that worker one compile attempt; nothing else reads it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

from . import jit
from .ahead import Job

_MISSING = object()


def entries(modules: Iterable[str]) -> list[dict]:
    """Every binary the kernels that are attributes of `modules` hold, as `jobs` reads them back."""
    found, seen, defaults = [], set(), {}  # defaults: id(backend) -> its options for {} (its target's defaults)
    for name in modules:
        module = sys.modules.get(name)
        for attr, value in list(vars(module).items()) if module is not None else ():
            kernel = jit.jit_layer(value)
            if kernel is None or id(kernel) in seen or getattr(jit.base_function(kernel), "__module__", None) != name:
                continue  # (a kernel imported from another module is that module's)
            seen.add(id(kernel))
            for cache in list(vars(kernel)["device_caches"].values()):
                backend = cache[-2]
                if id(backend) not in defaults:
                    defaults[id(backend)] = vars(backend.parse_options({}))
                for compiled in list(cache[0].values()):
                    entry = _entry(name, attr, jit.specialisation(compiled, backend), defaults[id(backend)])
                    if entry is not None:
                        found.append(entry)
    return found


def jobs(manifest: list[dict], target: Any) -> list[Job]:
    """The pool's jobs for `target` (Triton's GPUTarget of the serving device)."""
    return [Job(e["module"], e["name"], ({k: v for k, v in e["signature"].items()},
                                          {tuple(path): jit._frozen(v) for path, v in e["constexprs"]},
                                          {tuple(path): v for path, v in e["attrs"]},
                                          {k: jit._frozen(v) for k, v in e["options"].items()}), target)
            for e in manifest]


def write(path: Path, manifest: list[dict]) -> None:
    """Replace `path` at once (a start reading it meanwhile sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(manifest))
    partial.replace(path)


def read(path: Path) -> list[dict]:
    """The manifest at `path`; [] when there is none or it cannot be read (then the warm-up compiles, as before)."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return manifest if isinstance(manifest, list) and all(isinstance(e, dict) for e in manifest) else []


def _entry(module: str, name: str, spec: tuple | None, defaults: dict) -> dict | None:
    if spec is None:
        return None
    signature, constexprs, attrs, options = spec
    entry = {"module": module, "name": name, "signature": dict(signature),
             "constexprs": [[list(path), value] for path, value in constexprs.items()],
             "attrs": [[list(path), value] for path, value in attrs.items()],
             "options": {k: v for k, v in vars(options).items() if defaults.get(k, _MISSING) != v}}
    try:
        return json.loads(json.dumps(entry))  # (tuples as lists, as `jobs` reads them)
    except (TypeError, ValueError):
        return None
