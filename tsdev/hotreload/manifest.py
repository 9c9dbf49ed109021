"""The binaries a server's start compiled (its warm-up and graph captures), written down once it serves, so that the
next start of the same thing hands them to the compile pool (tsdev/hotreload/pool.py) as it begins: they compile side
by side while the model loads, and the warm-up finds them in Triton's disk cache instead of compiling one after
another (a fresh H100's first start: 34 compiles, 13.3 s of its warm-up).

A manifest is a JSON list, one entry per binary: the kernel's module and attribute, and the specialisation Triton's
JIT compiled (signature, constexprs and attributes with their index paths as lists, the options that differ from the
backend's defaults for that target). A dtype constexpr is written as {"tl.dtype": "bf16"} (the decode attention's
DOT: left out, the decode kernels compiled one after another in a fresh machine's graph capture); binaries with
other constexprs that are no JSON value (a function) are left out: those compile in the warm-up, as before. An entry
that no longer fits the code (the kernel gone, a new argument) fails in its worker and costs that worker one compile
attempt; nothing else reads it.

Each entry also holds the JIT's in-memory key of the binary and its kernel's source hash (Triton's `cache_key`):
`preload` loads into this process's kernels, under those keys, the binaries of every kernel whose source is unchanged --
Triton's disk cache has them -- so that their first launch finds them in memory (a restart's standby does that while
the old server still serves: the new server's warm-up then loads nothing).
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
                for key, compiled in list(cache[0].items()):
                    entry = _entry(name, attr, jit.specialisation(compiled, backend), defaults[id(backend)], key,
                                   _source_hash(kernel))
                    if entry is not None:
                        found.append(entry)
    return found


def jobs(manifest: list[dict], target: Any) -> list[Job]:
    """The pool's jobs for `target` (Triton's GPUTarget of the serving device)."""
    return [Job(e["module"], e["name"], ({k: v for k, v in e["signature"].items()},
                                          {tuple(path): _constexpr(v) for path, v in e["constexprs"]},
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


def _entry(module: str, name: str, spec: tuple | None, defaults: dict, key: Any = None,
           source: str | None = None) -> dict | None:
    if spec is None:
        return None
    signature, constexprs, attrs, options = spec
    entry = {"module": module, "name": name, "signature": dict(signature),
             "constexprs": [[list(path), _written_constexpr(value)] for path, value in constexprs.items()],
             "attrs": [[list(path), value] for path, value in attrs.items()],
             "options": {k: v for k, v in vars(options).items() if defaults.get(k, _MISSING) != v}}
    if isinstance(key, str) and source is not None:
        entry |= {"key": key, "hash": source}
    try:
        return json.loads(json.dumps(entry))  # (tuples as lists, as `jobs` reads them)
    except (TypeError, ValueError):
        return None


def _written_constexpr(value: Any) -> Any:
    import triton.language as tl

    return {"tl.dtype": value.name} if type(value) is tl.dtype else value


def _constexpr(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tl.dtype"}:
        import triton.language as tl

        return tl.dtype(value["tl.dtype"])
    return jit._frozen(value)


def _source_hash(kernel) -> str | None:
    try:
        return kernel.cache_key  # (Triton's hash of the kernel's source and of the @jit functions it calls)
    except Exception:  # noqa: BLE001  a dependency that cannot be hashed: no preload for it
        return None


def preload(manifest: list[dict], device: int) -> int:
    """Load the manifest's binaries into this process's kernels (the JIT layers at `module`.`name`) on CUDA device
    `device`, each under its JIT key, where the kernel's source hash is the entry's (so Triton's disk cache holds the
    binary: a read and a module load, not a compile) and the kernel holds none under that key yet. How many loaded;
    an entry that does not fit or fails is skipped (the kernel's first launch compiles or loads it, as before)."""
    loaded = 0
    for entry in manifest:
        key, source = entry.get("key"), entry.get("hash")
        kernel = jit.jit_layer(getattr(sys.modules.get(entry.get("module", "")), entry.get("name", ""), None))
        if not isinstance(key, str) or source is None or kernel is None:
            continue
        try:
            if _source_hash(kernel) != source:
                continue
            cache = kernel.device_caches[device]
            if key in cache[0]:
                continue
            [job] = jobs([entry], None)
            signature, constexprs, attrs, options = job.spec
            jit.load_binary(kernel, key, device, (signature, constexprs, attrs, cache[-2].parse_options(options)))
        except Exception:  # noqa: BLE001
            continue
        loaded += 1
    return loaded
