"""CuTe DSL kernels (NVIDIA's CUTLASS Python DSL, `pip install tsdev[cute]`): what a reload does with them.

`@cute.jit` and `@cute.kernel` return plain Python functions (the decorated one under `__wrapped__`, the DSL's class
in `_dsl_cls`), which a reload patches as any function. Called directly, a `@cute.jit` function traces the new code
and the DSL's own cache is keyed by the traced IR: the next call compiles the edit. A module-level cache of
`cute.compile` results starts empty (the re-executed module binds a new dict; an `lru_cache` is cleared). What no
reload can reach is a compiled kernel kept on a long-lived object (`self.kernel = cute.compile(host, ...)` in a layer's
`__init__`): it runs the old binary until something compiles it again. `find_stale` lists each one built from a CuTe
DSL function this reload changed (as its host or one of its kernels), with who holds it.

A compiled kernel is matched by the names the DSL gives it (`function_name` "cutlass_<host>_<argument types>",
`kernel_info` keys "kernel_cutlass_<kernel>_..."): one that only calls a changed helper is not found (its names do
not say). cutlass is never imported here; without it nothing is CuTe DSL.
"""
from __future__ import annotations

import gc
import sys
import types
import warnings
from typing import Any

from .code import instance_paths, same_code

_COMPILED = ("cutlass.base_dsl.jit_executor", "JitCompiledFunction")


def is_cute(fn: Any) -> bool:
    """A function a CuTe DSL decorator returned."""
    return isinstance(fn, types.FunctionType) and "_dsl_cls" in vars(fn) and "__wrapped__" in vars(fn)


def changed(old: types.FunctionType, new: types.FunctionType) -> bool:
    """Whether the decorated function's code differs between the two decorator results. The DSL rewrites a function's
    `__code__` when it first compiles it (its AST preprocessor), keeping the code as written in `_original_code`."""
    inner_old, inner_new = vars(old)["__wrapped__"], vars(new).get("__wrapped__")
    written = vars(inner_old).get("_original_code", inner_old.__code__)
    return not (isinstance(inner_new, types.FunctionType) and same_code(written, inner_new.__code__))


def find_stale(patcher, saved: list[dict], tracked: list[types.ModuleType]) -> None:
    """Report the live compiled kernels built from the CuTe DSL functions this reload changed (`patcher.cute_changed`:
    module name -> the names of its changed CuTe functions). A kernel held only by containers of the old
    namespaces (`saved`: a module-level cache the re-execution replaced) goes with them. One heap scan, only then."""
    compiled_type = getattr(sys.modules.get(_COMPILED[0]), _COMPILED[1], None)
    if not patcher.cute_changed or not isinstance(compiled_type, type):
        return
    names = {short: f"{module}.{short}" for module, shorts in patcher.cute_changed.items() for short in shorts}
    found: dict[str, list] = {}
    with warnings.catch_warnings():  # isinstance on every object: some modules' deprecated aliases warn
        warnings.simplefilter("ignore")
        heap = [obj for obj in gc.get_objects() if isinstance(obj, compiled_type)]
    for obj in heap:
        for short in _names(obj, names):
            found.setdefault(names[short], []).append(obj)
    heap = None
    old = {id(v) for ns in saved for v in ns.values()}
    mine = {id(found), *map(id, found.values())}
    for name, objects in sorted(found.items()):
        live = [obj for obj in objects if _held_beyond(obj, old, mine)]
        if not live:
            continue
        module = sys.modules.get(name.rpartition(".")[0])
        decorated = getattr(module, name.rpartition(".")[2], None)  # where: the function as written, not the DSL's
        patcher.add_group(vars(decorated).get("__wrapped__", decorated), live, name,
                          "{n} compiled CuTe DSL kernel(s) of the old code, kept on long-lived objects: they run the "
                          "old binary until compiled again (cute.compile)", instance_paths(live, tracked))


def _held_beyond(obj, old: set[int], mine: set[int]) -> bool:
    """Whether something besides the old namespaces' values (and this scan's own lists) holds `obj`; held by nothing
    visible counts too (a running frame's local, which gc cannot see)."""
    holders = [r for r in gc.get_referrers(obj) if id(r) not in mine]
    return not holders or any(id(r) not in old for r in holders)


def _names(compiled, names) -> list[str]:
    """The function names of `names` this compiled kernel was built from (host or kernel)."""
    host = str(getattr(compiled, "function_name", "") or "")
    kernels = [str(k) for k in (getattr(compiled, "kernel_info", None) or {})]
    return [short for short in names if host.startswith(f"cutlass_{short}_")
            or any(k.startswith(f"kernel_cutlass_{short}_") for k in kernels)]
