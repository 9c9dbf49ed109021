"""Triton kernels: merge re-decorated kernels into the live objects, and let no stale binary run.

Triton's in-memory cache (`device_caches`) is keyed by argument
specialisation only, not by source; a kernel's `hash` is computed once and
includes the hashes of the `@jit` helpers it calls. So after an edit the live
kernel object takes the new object's whole state (fresh caches, no hash), and
every other compiled kernel whose dependency hash changed (a caller of an
edited helper, wherever it lives) drops its binaries too. Kernels whose hash
did not change keep theirs, and an autotuner whose configs and key did not
change keeps its tuned choices.

When every change of a reload lies inside kernel bodies, `load_binaries` gives each reset kernel its new
binaries for every specialisation the old one had compiled, under the same cache keys, so the next launch
(a graph capture's included) finds them: the server's warm-up has nothing left to run.

Written against attribute names, not versions (checked on Triton 3.6 and 3.9):
triton is never imported here; without it nothing is a kernel.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import sys
import time
import types
from typing import Any, Iterable, NamedTuple

_CLASSES = (("triton.runtime.jit", "KernelInterface"), ("triton.runtime.jit", "JITCallable"),
            ("triton.runtime.interpreter", "InterpretedFunction"))


class Reset(NamedTuple):
    """A kernel whose binaries a reload dropped: its `device_caches` before, and whether its launches still bind
    their arguments the same way (same parameters and specialisation options), so the old cache keys hold.
    `changed`: its code (or a helper's) is known to differ -- not so for a kernel never launched (no hash to compare)
    whose source is the same, which is reset only because nothing says it is unchanged."""
    kernel: Any
    caches: Any
    same_call: bool
    changed: bool = True


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


def dialect(kernel: Any) -> str:
    """"gluon" for a `@gluon.jit` kernel (a JITFunction subclass compiled from Gluon's explicit-layout IR), else
    "triton"."""
    is_gluon = getattr(kernel, "is_gluon", None)
    return "gluon" if callable(is_gluon) and is_gluon() else "triton"


def named_dialects(resets: Iterable[Reset]) -> dict[str, str]:
    """module.name -> dialect of each reset kernel whose code changed (an autotuned kernel's layers once)."""
    named = {}
    for kernel in (r.kernel for r in resets if r.changed):
        fn, innermost = base_function(kernel), [*_stack(kernel)][-1:] or [kernel]
        if fn is not None:  # an autotune/heuristics wrapper is of its JIT layer's dialect
            named[f"{fn.__module__}.{fn.__qualname__}"] = dialect(innermost[0])
    return named


def ast_source(kernel: Any) -> type:
    """The class Triton compiles `kernel`'s source with (a Gluon kernel's sets it only on its first launch)."""
    if dialect(kernel) == "gluon":
        from triton.experimental.gluon._runtime import GluonASTSource
        return GluonASTSource
    from triton.compiler import ASTSource
    return ASTSource


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
    if "configs" in state and "cache" in state:
        if _same_tuning(old, new):
            state["cache"] = old.cache
        else:
            patcher.retuned = True
    had_code = _has_code(old)
    saved = dict(vars(old))
    same_call = _same_call(saved.get("fn"), state.get("fn")) and all(saved.get(k) == state.get(k) for k in OPTIONS)

    def undo():
        vars(old).clear()
        vars(old).update(saved)
    patcher.undo.append(undo)
    vars(old).clear()
    vars(old).update(_rehome(state, new, old))
    _forget_interpreted(saved.get("fn"))
    _reregister(new, old)
    changed = bool(saved.get("hash")) or _written(saved) != _written(state)
    patcher.kernels_reset.append(Reset(old, saved.get("device_caches"), same_call, changed))
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
    reset = {id(r.kernel) for r in patcher.kernels_reset}
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
            patcher.kernels_reset.append(Reset(k, vars(k)["device_caches"], True))
            _set(patcher, k, device_caches=collections.defaultdict(k.create_binder), hash=None)


@contextlib.contextmanager
def _cache_misses(misses: list):
    """Appends to `misses` each compile Triton's disk cache did not answer (its compilation listener says)."""
    knobs = sys.modules["triton"].knobs.compilation
    chained = knobs.listener

    def listener(*, cache_hit, **kwargs):
        if not cache_hit:
            misses.append(kwargs.get("src"))
        if chained:
            chained(cache_hit=cache_hit, **kwargs)
    knobs.listener = listener
    try:
        yield
    finally:
        knobs.listener = chained


def load_binary(kernel, key, device: int, spec: tuple):
    """`kernel`'s binary for `spec` (signature, constexprs, attrs, parsed options) compiled -- from Triton's disk cache
    where it has it -- and loaded on `device`, under the JIT's key `key`: where its next launch of that specialisation
    looks."""
    signature, constexprs, attrs, options = spec
    compiled = kernel._do_compile(key, signature, device, constexprs, options, attrs, warmup=True)
    compiled._init_handles()
    return compiled


def load_binaries(patcher) -> bool:
    """Compile (Triton's disk cache has them when compiled ahead) and load each reset kernel's binaries for every
    specialisation its old version had compiled, under the old cache keys. False, loading nothing more, where
    that cannot stand in for running the kernels: a changed autotuning (it must benchmark), a kernel run by
    Triton's interpreter, a changed parameter list, a binary this code cannot read, or a specialisation on a
    kernel passed as an argument (its key holds that kernel's hash). Sets `patcher.graph_swaps` (see there) and
    `patcher.compiled_in_pause`: the seconds of each kernel whose binaries compiled here, not found compiled ahead."""
    patcher.graph_swaps = None
    if patcher.retuned:
        return False
    work = []
    for kernel, caches, same_call, _ in patcher.kernels_reset:
        if "device_caches" not in vars(kernel):
            if is_kernel(vars(kernel).get("fn")):
                continue  # a wrapper (autotune, heuristics): its JIT layer is reset on its own
            return False  # the interpreter's kernels hold no binaries: they must run to be checked
        for device, cache in (caches or {}).items():
            for key, compiled in cache[0].items():
                spec = specialisation(compiled, cache[-2])
                if spec is None or not same_call or not hasattr(kernel, "_do_compile"):
                    return False
                if any(is_kernel(v) for v in spec[1].values()):
                    return False
                work.append((kernel, device, key, spec, compiled))
    swaps = {}
    for kernel, device, key, (signature, constexprs, attrs, options), old in work:
        start, misses = time.perf_counter(), []
        try:
            with _cache_misses(misses):
                new = load_binary(kernel, key, device, (signature, constexprs, attrs, options))
        except Exception as exc:
            code = base_function(kernel).__code__
            raise KernelCompileError(f"{code.co_filename}:{code.co_firstlineno}: {type(exc).__name__}: {exc}") from exc
        if misses:  # not found compiled ahead
            seconds, fn = time.perf_counter() - start, base_function(kernel)
            name = f"{fn.__module__}.{fn.__qualname__}"
            patcher.compiled_in_pause[name] = patcher.compiled_in_pause.get(name, 0.0) + seconds
        if swaps is not None and getattr(old, "function", None):  # launched before: captured graphs may hold it
            swaps = {**swaps, old.function: launch(new)} if _swappable(old.metadata, new.metadata) else None
    patcher.graph_swaps = swaps
    return True


# What a captured kernel node holds of a Triton launch besides the function, the threads and the shared memory
# (the launcher's attributes and extra arguments): a new binary differing in these cannot take an old one's place.
_FIXED_AT_LAUNCH = ("num_ctas", "launch_cooperative_grid", "launch_pdl", "global_scratch_size",
                    "profile_scratch_size")
_OVERSIZED_SHARED = 228 * 1024  # above this Triton's launch adds an attribute


def launch(compiled) -> tuple[int, int, int]:
    """(CUfunction, threads per block, dynamic shared memory bytes) Triton launches a loaded binary with."""
    return compiled.function, 32 * compiled.metadata.num_warps, compiled.metadata.shared


def _swappable(old, new) -> bool:
    fixed = lambda m: tuple(getattr(m, f, None) for f in _FIXED_AT_LAUNCH)  # noqa: E731
    return fixed(old) == fixed(new) and max(old.shared, new.shared) <= _OVERSIZED_SHARED


class KernelCompileError(RuntimeError):
    """An edited kernel did not compile; the message starts with the kernel's file:line (Triton's own frames
    would say nothing about where to look)."""


def specialisation(compiled, backend) -> tuple | None:
    """(signature, constexprs, attrs, options) a compiled kernel was built for, or None when it is not one
    this code can read. A kernel keeps its `src` (`constants` on 3.6, `constexprs` on 3.9) and `metadata`
    (read back from the disk cache, its tuples are lists: options need tuples, they are hashed)."""
    src, metadata = getattr(compiled, "src", None), getattr(compiled, "metadata", None)
    if src is None or not hasattr(metadata, "_asdict") or backend is None:
        return None
    constexprs = getattr(src, "constexprs", None) or getattr(src, "constants", None) or {}
    options = backend.parse_options({k: _frozen(v) for k, v in metadata._asdict().items()})
    return src.signature, constexprs, src.attrs, options


def _frozen(value):
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _same_call(old_fn, new_fn) -> bool:
    """Two kernel functions whose launches bind arguments alike (names, kinds, defaults, annotations)."""
    try:
        return inspect.signature(old_fn) == inspect.signature(new_fn)
    except (TypeError, ValueError):
        return False


# `@jit(...)` arguments that shape the binary but are not part of Triton's hash.
OPTIONS = ("version", "do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline")


def _written(state: dict):
    """A kernel's code as written: its source (JITFunction), else its function's bytecode and constants (the
    interpreter's kernels keep no source)."""
    if "src" in state:
        return state["src"]
    code = getattr(state.get("fn"), "__code__", None)
    return None if code is None else (code.co_code, code.co_consts)


def _unchanged(old, new) -> bool:
    """A `@jit` function whose dependency hash (source, helpers, constexpr globals) and options are the same."""
    old_hash = vars(old).get("hash")
    if not old_hash or "device_caches" not in vars(old):
        return False
    if any(vars(old).get(k) != vars(new).get(k) for k in OPTIONS):
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


def jit_layer(obj):
    """The JITFunction (the layer that holds binaries) under autotune/heuristics wrappers, or None."""
    return next((layer for layer in _stack(obj) if "device_caches" in vars(layer)), None)


def binaries_held(modules) -> int:
    """How many binaries the kernels of `modules` (and of Triton's registry) hold: serving that compiles a kernel for
    a new specialisation changes it, a reload's reset too."""
    seen, count = set(), 0
    for kernel in _kernels_in(modules):
        for layer in _stack(kernel):
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            for entry in list((vars(layer).get("device_caches") or {}).values()):
                if isinstance(entry, tuple) and entry and isinstance(entry[0], dict):
                    count += len(entry[0])
    return count


def _kernels_in(modules):
    for module in modules:
        for value in list(vars(module).values()):
            if is_kernel(value):
                yield value
    registry = _registry()
    if registry is not None:
        yield from list(registry.values())
