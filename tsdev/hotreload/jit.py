"""Triton kernels: merge re-decorated kernels into the live objects, and let no stale binary run.

Triton's in-memory cache (`device_caches`) is keyed by argument
specialisation only, not by source; a kernel's `hash` is computed once and
includes the hashes of the `@jit` helpers it calls. So after an edit the live
kernel object takes the new object's whole state (fresh caches, no hash), and
every other compiled kernel whose dependency hash changed (a caller of an
edited helper, wherever it lives) drops its binaries too. Kernels whose hash
did not change keep theirs, and an autotuner whose configs and key did not
change keeps its tuned choices.

Written against attribute names, not versions (checked on Triton 3.6 and 3.9):
triton is never imported here; without it nothing is a kernel.
"""
from __future__ import annotations

import collections
import sys
import types
from typing import Any, Iterable

_CLASSES = (("triton.runtime.jit", "KernelInterface"), ("triton.runtime.jit", "JITCallable"),
            ("triton.runtime.interpreter", "InterpretedFunction"))


def kernel_types() -> tuple[type, ...]:
    found = []
    for module, name in _CLASSES:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def is_kernel(obj: Any) -> bool:
    """`@triton.jit` / `@autotune` / `@heuristics` objects, and the interpreter's."""
    classes = kernel_types()
    return bool(classes) and isinstance(obj, classes)


def base_function(obj: Any) -> types.FunctionType | None:
    """The Python function under a stack of kernel decorators."""
    for _ in range(16):
        if isinstance(obj, types.FunctionType):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def merge(patcher, old: Any, new: Any, module: types.ModuleType, name: str) -> Any:
    """Give the live kernel `old` the state of the re-decorated `new`."""
    state = dict(vars(new))
    inner_old, inner_new = vars(old).get("fn"), state.get("fn")
    if is_kernel(inner_old) and is_kernel(inner_new):  # autotune -> heuristics -> jit
        state["fn"] = patcher.merge(inner_old, inner_new, module, name)
    if _unchanged(old, new):
        _set(patcher, old, used_global_vals=vars(new).get("used_global_vals", {}))
        return old
    if "configs" in state and "cache" in state and _same_tuning(old, new):
        state["cache"] = old.cache
    had_code = _has_code(old)
    saved = dict(vars(old))

    def undo():
        vars(old).clear()
        vars(old).update(saved)
    patcher.undo.append(undo)
    vars(old).clear()
    vars(old).update(_rehome(state, new, old))
    _forget_interpreted(saved.get("fn"))
    _reregister(new, old)
    patcher.kernels_reset.append(old)
    patcher.jit_kernels += had_code
    patcher.patched += 1
    return old


def refresh_callers(patcher, modules: Iterable[types.ModuleType]) -> None:
    """Drop the binaries of compiled kernels whose dependency hash changed in this reload.

    A kernel that calls an edited helper is not re-executed when it lives in a
    module that did not change (or outside the reloadable packages), yet its
    cached binary inlines the old helper.
    """
    if not patcher.kernels_reset:
        return
    reset = {id(k) for k in patcher.kernels_reset}
    candidates = {}
    for obj in _kernels_in(modules):
        for level in _stack(obj):
            if "device_caches" in vars(level) and vars(level).get("hash") and id(level) not in reset:
                candidates[id(level)] = level
    hashes = {key: k.hash for key, k in candidates.items()}
    for k in candidates.values():
        _set(patcher, k, hash=None, used_global_vals=vars(k).get("used_global_vals", {}))
    for key, k in candidates.items():
        try:
            changed = k.cache_key != hashes[key]
        except Exception:  # a dependency vanished: certainly stale
            changed = True
        if changed:
            patcher.jit_kernels += _has_code(k)
            _set(patcher, k, device_caches=collections.defaultdict(k.create_binder), hash=None)
            patcher.kernels_reset.append(k)


# `@jit(...)` arguments that shape the binary but are not part of Triton's hash.
_OPTIONS = ("version", "do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline")


def _unchanged(old, new) -> bool:
    """A `@jit` function whose dependency hash (source, helpers, constexpr globals) and options are the same."""
    old_hash = vars(old).get("hash")
    if not old_hash or "device_caches" not in vars(old):
        return False
    if any(vars(old).get(k) != vars(new).get(k) for k in _OPTIONS):
        return False
    try:
        return new.cache_key == old_hash
    except Exception:
        return False


def _same_tuning(old, new) -> bool:
    return (list(map(str, old.configs)) == list(map(str, new.configs))
            and list(getattr(old, "keys", [])) == list(getattr(new, "keys", [])))


def _has_code(kernel) -> int:
    """1 when the kernel holds compiled binaries (or the interpreter's rewritten function)."""
    caches = vars(kernel).get("device_caches")
    if caches:
        return int(any(isinstance(entry, tuple) and entry and entry[0] for entry in caches.values()))
    rewritten = getattr(type(kernel), "rewritten_fn", None)
    return int(isinstance(rewritten, dict) and vars(kernel).get("fn") in rewritten)


def _rehome(state: dict, new, old) -> dict:
    """Re-aim state that points back at `new` (bound methods, closures) at `old`."""
    out = {}
    for key, value in state.items():
        if isinstance(value, types.MethodType) and value.__self__ is new:
            value = types.MethodType(value.__func__, old)
        elif isinstance(value, collections.defaultdict) and getattr(value.default_factory, "__self__", None) is new:
            value = collections.defaultdict(types.MethodType(value.default_factory.__func__, old), value)
        elif isinstance(value, types.FunctionType):
            for cell in value.__closure__ or ():
                if cell.cell_contents is new:
                    cell.cell_contents = old
        out[key] = value
    return out


def _forget_interpreted(fn) -> None:
    """The interpreter caches its rewritten kernels by the Python function object."""
    cls = getattr(sys.modules.get("triton.runtime.interpreter"), "InterpretedFunction", None)
    cache = getattr(cls, "rewritten_fn", None)
    if isinstance(cache, dict):
        cache.pop(fn, None)


def _registry() -> dict | None:
    """Triton's name -> kernel registry (for deserialising constants), if this Triton has one."""
    registry = getattr(sys.modules.get("triton.runtime.jit"), "_triton_jit_function_registry", None)
    return registry if isinstance(registry, dict) else None


def _reregister(new, old) -> None:
    """Triton keeps a name -> kernel registry (for deserialising constants): keep the live one there."""
    registry = _registry()
    if registry is None:
        return
    for key, value in list(registry.items()):
        if value is new:
            registry[key] = old


def snapshot_registry():
    """An undo for everything the re-executed decorators wrote into Triton's registry."""
    registry = _registry()
    if registry is None:
        return lambda: None
    saved = dict(registry)

    def undo():
        registry.clear()
        registry.update(saved)
    return undo


def _set(patcher, obj, **attrs) -> None:
    saved = {k: vars(obj)[k] for k in attrs if k in vars(obj)}

    def undo():
        for k in attrs:
            vars(obj).pop(k, None)
        vars(obj).update(saved)
    patcher.undo.append(undo)
    vars(obj).update(attrs)


def _stack(obj):
    for _ in range(16):
        if not is_kernel(obj):
            return
        yield obj
        obj = vars(obj).get("fn")


def _kernels_in(modules):
    for module in modules:
        for value in list(vars(module).values()):
            if is_kernel(value):
                yield value
    registry = _registry()
    if registry is not None:
        yield from list(registry.values())
