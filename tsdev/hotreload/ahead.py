"""Compile edited Triton kernels ahead of the reload, while the old code still serves.

For every edited module that holds Triton kernels, the new source is executed into a scratch
namespace (the live module, linecache and Triton's kernel registry are left as they were; the module's
import-time side effects do run) and each kernel whose hash changed is compiled for every specialisation
its live counterpart has compiled; so is a copy of each compiled kernel elsewhere that calls an edited
`@jit` helper by name, its globals pointing at the new helper. `triton.compile` stores the binaries in
Triton's on-disk cache, keyed by source and specialisation, so the reload loads them instead of compiling,
and the serving pause excludes JIT time. A binary the cache holds already (a revert, a version seen before) is not
compiled again (`_on_disk`). With a `CompilePool` (tsdev/hotreload/pool.py) the compiles run side by
side in its processes, which apply the same sources to their own copies of the modules; without one, here, one after
another.

Triton internals used (checked on 3.6 and 3.9): `device_caches[device]` is a tuple whose first item
maps keys to compiled kernels and whose third-from-last and second-from-last items are the target and
the backend; what a compiled kernel was built for is read by `jit.specialisation`.

`prepared` (an editor's unsaved buffer compiled ahead, runtime/tsdev_runtime/engine/buffers.py): called once the
new source has run aside and the binaries to build are drawn up. Until then the caller keeps the program's modules
(and Triton's registry and linecache, which this touches) to this call; after it the compiles use nothing live, so a
reload may run meanwhile.
"""
from __future__ import annotations

import builtins
import sys
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from . import jit
from .snapshot import pin_lines


@dataclass(frozen=True)
class Job:
    """Compile the kernel at `module`.`name` (its JIT layer, under any autotune/heuristics wrappers), as the worker's
    copy of the sources defines it, for one specialisation: `spec` = (signature, constexprs, attrs, options dict)."""
    module: str
    name: str
    spec: tuple
    target: Any


@dataclass(frozen=True)
class Compiled:
    job: Job
    seconds: float
    error: str | None = None  # "file:line: Type: message" of the kernel that did not compile


class Ahead(NamedTuple):
    """What `compile_ahead` did. A tuple whose first three items are (binaries, seconds, slowest compile's seconds),
    as callers unpack it; `kernels`: module.name of each kernel compiled; `reused`: the same edit was compiled before
    (nothing compiled now, the binaries are in Triton's cache); `on_disk`: binaries the edit needs that Triton's disk
    cache held already (a revert, a version seen before), not compiled again."""
    binaries: int
    seconds: float
    slowest: float
    kernels: tuple[str, ...] = ()
    reused: bool = False
    on_disk: int = 0


class Compiler(Protocol):
    """What `compile_ahead` hands its jobs to: `CompilePool` (tsdev/hotreload/pool.py), whose workers apply `sources`
    to their own copies of the modules first. Named here so that neither this module nor the Reloader imports the
    pool, whose workers import the Reloader."""

    def compile(self, sources: Mapping[str, bytes], jobs: Sequence[Job]) -> list[Compiled]: ...


def compile_ahead(modules: list[str], sources: Mapping[str, bytes], paths: Mapping[str, str],
                  running: Mapping[str, bytes], tracked: list[types.ModuleType] = (),
                  pool: Compiler | None = None, prepared: Callable[[], None] | None = None) -> Ahead:
    """Compile the new versions of the kernels in the edited `modules`; returns (binaries compiled, seconds, seconds
    of the slowest compile, the kernels' names).

    `running` is the source each module runs now: `linecache` shows the new source only while it executes.
    `tracked`: the modules whose kernels may call an edited helper (with Triton's registry, where it has one).
    `pool`: compile in its processes, side by side (they apply `sources` themselves); else one after another here.
    `prepared()`: called once nothing live is used any more (the module docstring).
    Raises if any binary did not compile (those compile in the reload's pause: the caller warns).
    """
    if "triton" not in sys.modules:
        if prepared is not None:
            prepared()
        return Ahead(0, 0.0, 0.0)
    start = time.perf_counter()
    restore_registry = jit.snapshot_registry()  # the scratch decorators register themselves: undo that
    edited, changed = set(), {}  # ids of the edited modules' kernels; id(live helper) -> (live, its new version)
    work = []  # (live kernel, its new version, module, attribute)
    try:
        for name in modules:
            live = sys.modules.get(name)
            if live is None or name not in sources or not any(map(jit.jit_layer, vars(live).values())):
                continue
            scratch = _execute_aside(name, sources[name], paths[name], running[name], live)
            for attr, old in vars(live).items():
                new_fn, old_fn = jit.jit_layer(scratch.get(attr)), jit.jit_layer(old)
                if new_fn is None or old_fn is None:
                    continue
                edited.add(id(old_fn))
                if _hash_changed(old_fn, new_fn):  # unchanged kernels keep their binaries through the reload
                    changed[id(old_fn)] = (old_fn, new_fn)
                    work.append((old_fn, new_fn, name, attr))
        for live_fn, new_fn in _callers_aside(changed, edited, tracked):
            fn = jit.base_function(live_fn)
            work.append((live_fn, new_fn, fn.__module__, fn.__name__))
        # every binary to build, drawn now: a reload after `prepared` may reset the live kernels' caches; those
        # Triton's disk cache holds already (a revert, a version seen before) are left to the reload's load
        needed = [(new_fn, module, attr, *held) for live_fn, new_fn, module, attr in work
                  for held in _specialisations(live_fn)]
        binaries = [b for b in needed if not _on_disk(b[0], *b[3:])]
    finally:
        restore_registry()
        if prepared is not None:
            prepared()
    compiled = _compile_in(pool, binaries, sources) if pool is not None else _compile_here(binaries)
    errors = [c.error for c in compiled if c.error]
    count = len(compiled) - len(errors)
    if errors:  # the reload compiles these in its pause (and reports a broken edit with file:line)
        raise RuntimeError(f"{len(errors)} of {len(compiled)} binaries did not compile: " + "; ".join(errors[:3]))
    kernels = tuple(sorted({f"{c.job.module}.{c.job.name}" for c in compiled}))
    return Ahead(count, time.perf_counter() - start, max((c.seconds for c in compiled), default=0.0), kernels,
                 on_disk=len(needed) - len(binaries))


def _specialisations(live_fn):
    """(spec, target, backend) of every binary the live kernel holds; spec None where it cannot be read."""
    for cache in list(vars(live_fn)["device_caches"].values()):
        for compiled in list(cache[0].values()):
            yield compiled, cache[-3], cache[-2]


def _on_disk(new_fn, compiled, target, backend) -> bool:
    """Whether Triton's disk cache holds `new_fn`'s binary for a live binary's specialisation: `triton.compile`'s
    own key and lookup (the source, specialisation, options, backend, Triton and its cache-invalidating variables),
    so a revert or an edit seen before costs neither a compile nor a trip through the pool's workers (a revert's jit
    step took 0.10-0.15 s on an H100 with no compile over 0.01 s). False whenever it cannot tell: then it compiles."""
    import hashlib

    spec = jit.specialisation(compiled, backend)
    if spec is None:
        return False
    signature, constexprs, attrs, options = spec
    try:
        from triton import knobs
        from triton.compiler import compiler

        if knobs.compilation.always_compile or knobs.runtime.add_stages_inspection_hook is not None:
            return False
        src = jit.ast_source(new_fn)(new_fn, signature, constexprs, attrs)
        options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
        key = compiler.get_cache_key(src, backend, options, compiler.get_cache_invalidating_env_vars())
        group = compiler.get_cache_manager(hashlib.sha256(key.encode()).hexdigest()).get_group(f"{src.name[:150]}.json")
    except Exception:  # noqa: BLE001  (another Triton's internals: compile, as without this)
        return False
    return bool(group) and f"{src.name[:150]}.json" in group


def _compile_here(binaries) -> list[Compiled]:
    results = []
    for new_fn, module, attr, compiled, target, backend in binaries:
        job, start = Job(module, attr, (), target), time.perf_counter()
        try:
            if not _recompile(new_fn, compiled, target, backend):
                continue
        except Exception as exc:  # the reload compiles it (and reports a real error with file:line)
            results.append(Compiled(job, time.perf_counter() - start, f"{attr}: {type(exc).__name__}: {exc}"))
            continue
        results.append(Compiled(job, time.perf_counter() - start))
    return results


def _compile_in(pool: Compiler, binaries, sources: Mapping[str, bytes]) -> list[Compiled]:
    jobs = []
    for _, module, attr, compiled, target, backend in binaries:
        spec = jit.specialisation(compiled, backend)
        if spec is not None:
            signature, constexprs, attrs, options = spec
            jobs.append(Job(module, attr, (signature, constexprs, attrs, options.__dict__), target))
    return pool.compile(sources, jobs)


def _hash_changed(old_fn, new_fn) -> bool:
    try:
        return old_fn.cache_key != new_fn.cache_key
    except Exception:  # a dependency the new source lacks: the reload reports it
        return False


def _callers_aside(changed: dict, edited: set[int], tracked: list[types.ModuleType]):
    """(live kernel, a copy of it that calls the new helpers) for each compiled kernel outside the edited modules
    that names an edited helper: the reload drops its binaries (`jit.refresh_callers`), so compile it ahead too.
    Kernels that reach an edited helper only through another helper compile in the reload."""
    seen = set(edited)
    for kernel in list(jit._kernels_in(tracked)):
        live = jit.jit_layer(kernel)
        fn = jit.base_function(live)
        if live is None or fn is None or id(live) in seen or not jit._has_code(live):
            continue
        seen.add(id(live))
        swaps = {name: changed[id(value)][1] for name, value in fn.__globals__.items()
                 if name in fn.__code__.co_names and changed.get(id(value), (None,))[0] is value}
        if not swaps:
            continue
        aside = types.FunctionType(fn.__code__, {**fn.__globals__, **swaps}, fn.__name__, fn.__defaults__,
                                   fn.__closure__)
        aside.__qualname__, aside.__kwdefaults__ = fn.__qualname__, fn.__kwdefaults__
        aside.__annotations__ = dict(fn.__annotations__)
        yield live, type(live)(aside, **{k: vars(live)[k] for k in jit.OPTIONS if k in vars(live)})


def _recompile(new_fn, compiled, target, backend) -> int:
    """Compile `new_fn` for the specialisation and options of a live binary; 1 if it did."""
    import triton

    spec = jit.specialisation(compiled, backend)
    if spec is None:
        return 0
    signature, constexprs, attrs, options = spec
    triton.compile(jit.ast_source(new_fn)(new_fn, signature, constexprs, attrs), target=target,
                   options=options.__dict__)
    return 1



def _execute_aside(name: str, source: bytes, path: str, running: bytes, live: types.ModuleType) -> dict:
    """Run the new source in a fresh namespace that looks like the module's (empty if it fails). Triton reads
    a kernel's source through linecache, so that shows the new source meanwhile, then the running one again."""
    namespace = {"__name__": name, "__file__": path, "__package__": live.__package__,
                 "__spec__": live.__spec__, "__builtins__": builtins}
    pin_lines(path, source)
    try:
        exec(compile(source, path, "exec", dont_inherit=True), namespace)
    except Exception:  # the reload itself reports the error with file:line
        return {}
    finally:
        pin_lines(path, running)
    return namespace
