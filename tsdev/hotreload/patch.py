"""Make the objects that existed before a reload behave like the re-executed ones.

A re-executed module holds *new* functions and classes, but the running
program holds the old ones everywhere: `from x import f` copies, registries,
bound methods stored at init, `nn.Module` instances, kernel plans. So each old
definition is updated in place (and kept as the module's binding, so identity
and `isinstance` keep working) or, when that is impossible, redirected to the
new one. What can be neither is reported as stale instead of being silently
wrong. Every change is recorded in `undo` so a transaction can revert it.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import gc
import inspect
import sys
import types
from typing import Any, Callable

from . import jit

MISSING = object()
_LRU = type(functools.lru_cache(maxsize=None)(lambda: None))
_SLOTS = (types.MemberDescriptorType, types.GetSetDescriptorType)  # bound to one class's layout
_KEEP_IN_CLASS = {"__dict__", "__weakref__", "_abc_impl"}
_DESCRIPTORS = (staticmethod, classmethod, property, functools.cached_property)
_DESCRIPTOR_FUNCTIONS = ("__func__", "fget", "fset", "fdel", "func")  # where each kind keeps its function
_REHOME_MAX = 1000  # module-level containers larger than this are tables: not scanned on every reload
TARGET = "__tsdev_target__"  # kw-only default through which a redirected function finds its replacement


class Patcher:
    """One reload's worth of in-place updates, with the log to undo them."""

    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []
        self.patched = 0
        self.stale: list[dict] = []
        self.kernels_reset: list[Any] = []  # Triton kernels whose binaries were dropped
        self.jit_kernels = 0  # ... of which had compiled (or interpreted) code
        self._done: dict[int, Any] = {}  # id(old) -> what its name binds to now
        self._new_to_old: dict[int, tuple[Any, Any]] = {}  # id(new) -> (new, old merged into)
        self._stale_objects: list[Any] = []

    # -- entry point ---------------------------------------------------------
    def module(self, module: types.ModuleType, before: dict) -> None:
        """Merge a re-executed module's definitions into the ones in `before`."""
        ns = vars(module)
        prefix = module.__name__ + "."
        for key, new in list(ns.items()):
            old = before.get(key, MISSING)
            if old is not MISSING and old is not new:
                ns[key] = self.merge(old, new, module, prefix + key)
        for key, value in list(ns.items()):  # values built by the re-execution itself
            if before.get(key, MISSING) is not value:
                ns[key] = self._rehome(value)

    def merge(self, old: Any, new: Any, module: types.ModuleType, name: str) -> Any:
        """Update `old` to behave like `new`; return what the name should bind to."""
        if old is new:
            return old
        if id(old) in self._done:
            return self._done[id(old)]
        if not (defined_in(old, module) or defined_in(new, module)):
            return self.translate(new)  # someone else's object: theirs to reload
        self._done[id(old)] = old  # provisional: breaks cycles (recursive closures, nested classes)
        result = self._merge(old, new, module, name)
        self._done[id(old)] = result
        if result is old:
            self._new_to_old[id(new)] = (new, old)
        return result

    def translate(self, value: Any) -> Any:
        """The old object a new one was merged into, else the value itself."""
        pair = self._new_to_old.get(id(value))
        return pair[1] if pair is not None and pair[0] is value else value

    # -- dispatch --------------------------------------------------------------
    def _merge(self, old, new, module, name):
        if isinstance(old, types.FunctionType) and isinstance(new, types.FunctionType):
            return self._function(old, new, module, name)
        if isinstance(old, type) and isinstance(new, type):
            return self._class(old, new, module, name)
        if isinstance(old, _LRU) and isinstance(new, _LRU):
            self.merge(old.__wrapped__, new.__wrapped__, module, name)
            old.cache_clear()  # entries computed by the old code must not be served again
            self.patched += 1
            return old if old.cache_parameters() == new.cache_parameters() else new
        if jit.is_kernel(old) and jit.is_kernel(new) and type(old) is type(new):
            return jit.merge(self, old, new, module, name)
        if isinstance(old, _DESCRIPTORS) and type(old) is type(new):
            for attr in _DESCRIPTOR_FUNCTIONS:
                o, n = getattr(old, attr, None), getattr(new, attr, None)
                if o is not None and n is not None:
                    self.merge(o, n, module, name)
            return new  # descriptors are immutable; the class gets the new one
        if is_definition(old):
            self.add_stale(old, name, f"{kind(old)} became {kind(new)}")
            return new
        return self.translate(new)

    # -- functions -------------------------------------------------------------
    def _function(self, old, new, module, name):
        self._save_function(old)
        if old.__globals__ is new.__globals__ and old.__code__.co_freevars == new.__code__.co_freevars:
            old.__code__ = new.__code__
            for old_cell, new_cell in zip(old.__closure__ or (), new.__closure__ or ()):
                self._cell(old_cell, new_cell, module, name)
            old.__defaults__ = tuple(map(self.translate, new.__defaults__)) if new.__defaults__ else None
            old.__kwdefaults__ = {k: self.translate(v) for k, v in new.__kwdefaults__.items()} if new.__kwdefaults__ else None
            old.__annotations__ = dict(new.__annotations__)
            old.__dict__ = {k: self.translate(v) for k, v in new.__dict__.items()}
            old.__doc__, old.__name__, old.__qualname__ = new.__doc__, new.__name__, new.__qualname__
            self.patched += 1
            return old
        # The closure changed shape (or the code now lives in another module): a
        # function's closure cannot be resized, so the old one forwards instead.
        old.__code__ = _trampoline(len(old.__code__.co_freevars))
        old.__defaults__ = None
        old.__kwdefaults__ = {TARGET: new}
        old.__dict__ = {"__wrapped__": new}  # inspect.signature() follows it
        self.patched += 1
        return new

    def _cell(self, old_cell, new_cell, module, name):
        new = _cell_get(new_cell)
        old = _cell_get(old_cell)
        if new is MISSING:
            if old is not MISSING:
                del old_cell.cell_contents
            return
        if old is not new:
            old_cell.cell_contents = self.merge(old, new, module, name) if old is not MISSING else self.translate(new)

    def _save_function(self, fn):
        cells = [(c, _cell_get(c)) for c in fn.__closure__ or ()]
        state = (fn.__code__, fn.__defaults__, fn.__kwdefaults__, fn.__annotations__, fn.__dict__,
                 fn.__doc__, fn.__name__, fn.__qualname__)

        def undo():
            (fn.__code__, fn.__defaults__, fn.__kwdefaults__, fn.__annotations__, fn.__dict__,
             fn.__doc__, fn.__name__, fn.__qualname__) = state
            for cell, value in cells:
                if value is MISSING:
                    if _cell_get(cell) is not MISSING:
                        del cell.cell_contents
                else:
                    cell.cell_contents = value
        self.undo.append(undo)

    # -- classes ---------------------------------------------------------------
    def _class(self, old, new, module, name):
        reason = self._layout_change(old, new)
        if reason is None and tuple(map(self.translate, new.__bases__)) != old.__bases__:
            reason = _try_set_bases(old, tuple(map(self.translate, new.__bases__)), self.undo)
        if reason:
            self.add_stale(old, name, reason)
            return new
        self._new_to_old[id(new)] = (new, old)  # methods, nested classes, instances translate to old
        saved = dict(vars(old))
        self.undo.append(lambda: _restore_class(old, saved))
        _point_class_cells(new, old)
        is_enum = isinstance(old, enum.EnumMeta)
        for key, value in list(vars(new).items()):
            if _keep_in_class(key, value) or (is_enum and not is_definition(value)):
                continue
            current = vars(old).get(key, MISSING)
            value = self.translate(value) if current is MISSING else self.merge(current, value, module, f"{name}.{key}")
            if current is not value:
                type.__setattr__(old, key, value)
        for key, value in list(vars(old).items()):
            if key not in vars(new) and not _keep_in_class(key, value) and not (is_enum and not is_definition(value)):
                type.__delattr__(old, key)  # a removed override falls back to the base class
        if is_enum:
            self._sync_enum(old, new)
        self.patched += 1
        return old

    def _layout_change(self, old, new) -> str | None:
        """Why live instances of `old` could not become instances of `new`, if they could not."""
        if type(old) is not self.translate(type(new)):
            return f"metaclass changed to {type(new).__qualname__}"
        if vars(old).get("__slots__") != vars(new).get("__slots__"):
            return "__slots__ changed"
        if dataclasses.is_dataclass(old) or dataclasses.is_dataclass(new):
            before = [f.name for f in dataclasses.fields(old)] if dataclasses.is_dataclass(old) else []
            after = [f.name for f in dataclasses.fields(new)] if dataclasses.is_dataclass(new) else []
            if before != after:
                return f"dataclass fields changed from {before} to {after}"
        if getattr(old, "_fields", None) != getattr(new, "_fields", None):
            return "namedtuple fields changed"
        if isinstance(old, enum.EnumMeta):
            members = old.__members__
            if any(k in members and members[k]._value_ != m._value_ for k, m in new.__members__.items()):
                return "enum member values changed"
            if issubclass(old, enum.Flag) and list(members) != list(new.__members__):
                return "Flag members changed"
        return None

    def _sync_enum(self, old, new):
        """Add/remove members on the live enum, keeping the existing members' identity."""
        saved = (dict(old._member_map_), list(old._member_names_), dict(old._value2member_map_))

        def undo():
            old._member_map_.clear(), old._member_map_.update(saved[0])
            old._member_names_[:] = saved[1]
            old._value2member_map_.clear(), old._value2member_map_.update(saved[2])
        self.undo.append(undo)
        for key, member in new.__members__.items():
            if key in old._member_map_:
                continue
            if member._name_ != key:  # an alias of another member
                member = old._member_map_[member._name_]
            else:
                member.__class__ = old
                old._member_names_.append(key)
                try:
                    old._value2member_map_[member._value_] = member
                except TypeError:  # unhashable values are looked up linearly
                    pass
            old._member_map_[key] = member
            type.__setattr__(old, key, member)
        for key in [k for k in old._member_map_ if k not in new.__members__]:
            member = old._member_map_.pop(key)
            if key in old._member_names_:
                old._member_names_.remove(key)
                old._value2member_map_.pop(member._value_, None)
            if key in vars(old):
                type.__delattr__(old, key)

    # -- values built at module level ------------------------------------------
    def _rehome(self, value):
        """Point module-level values made during re-execution at the old (merged) objects.

        `DEFAULT = Config()` or `LAYERS = {"norm": RMSNorm}` hold the *new*
        class; `isinstance(x, Config)` against live instances would fail.
        Small containers (registries, not tables) are translated one level deep.
        """
        if not self._new_to_old or (isinstance(value, (dict, list, tuple)) and len(value) > _REHOME_MAX):
            return value
        if isinstance(value, dict):
            for k, v in list(value.items()):
                value[k] = self._rehome_one(v)
            return value
        if isinstance(value, list):
            value[:] = [self._rehome_one(v) for v in value]
            return value
        if isinstance(value, tuple) and type(value) is tuple:
            return tuple(self._rehome_one(v) for v in value)
        return self._rehome_one(value)

    def _rehome_one(self, value):
        translated = self.translate(value)
        if translated is not value:
            return translated
        cls = self.translate(type(value))
        if cls is not type(value):
            try:
                value.__class__ = cls
            except TypeError:
                pass
        return value

    # -- stale -----------------------------------------------------------------
    def add_stale(self, obj: Any, name: str, reason: str) -> None:
        self.stale.append({"name": name, "reason": reason, "where": _where(obj), "referrers": []})
        self._stale_objects.append(obj)

    def describe_stale(self, ignore: list) -> None:
        """Fill each stale entry's `referrers`: who still holds the old object."""
        if not self._stale_objects:
            return
        ignore_ids = {id(x) for x in ignore} | {id(self._stale_objects), id(self.__dict__)}
        names = {id(vars(m)): m.__name__ for m in list(sys.modules.values()) if m is not None}
        for entry, obj in zip(self.stale, self._stale_objects):
            refs = []
            for ref in gc.get_referrers(obj):
                if id(ref) in ignore_ids or isinstance(ref, types.FrameType) or _is_args_of_call(ref, obj):
                    continue
                refs.append(_describe_referrer(ref, obj, names))
            entry["referrers"] = sorted(set(refs))[:10]


# -- helpers ------------------------------------------------------------------
def defined_in(obj: Any, module: types.ModuleType) -> bool:
    """Whether `obj` is a definition made by `module`'s code (so it is ours to update)."""
    obj = _underlying(obj)
    if isinstance(obj, types.FunctionType):
        return obj.__globals__ is vars(module) or obj.__module__ == module.__name__
    return isinstance(obj, type) and obj.__module__ == module.__name__


def _underlying(obj: Any) -> Any:
    """The function (or class) under kernel, cache and descriptor wrappers."""
    if jit.is_kernel(obj):
        return jit.base_function(obj)
    if isinstance(obj, _LRU):
        return obj.__wrapped__
    if isinstance(obj, _DESCRIPTORS):
        return next((f for a in _DESCRIPTOR_FUNCTIONS if (f := getattr(obj, a, None))), None)
    return obj


def is_definition(obj: Any) -> bool:
    return isinstance(obj, (types.FunctionType, type, _LRU) + _DESCRIPTORS) or jit.is_kernel(obj)


def kind(obj: Any) -> str:
    if isinstance(obj, type):
        return "class"
    if isinstance(obj, types.FunctionType):
        return "function"
    return type(obj).__name__


def _keep_in_class(key: str, value: Any) -> bool:
    return key in _KEEP_IN_CLASS or isinstance(value, _SLOTS)


def _try_set_bases(cls, bases, undo) -> str | None:
    previous = cls.__bases__
    try:
        cls.__bases__ = bases
    except TypeError as e:
        return f"base classes changed and cannot be set on the live class: {e}"
    undo.append(lambda: setattr(cls, "__bases__", previous))
    return None


def _restore_class(cls, saved: dict) -> None:
    for key, value in list(vars(cls).items()):
        if key not in saved and not _keep_in_class(key, value):
            type.__delattr__(cls, key)
    for key, value in saved.items():
        if not _keep_in_class(key, value) and vars(cls).get(key, MISSING) is not value:
            type.__setattr__(cls, key, value)


def _functions_in(value, depth: int = 3):
    """Functions reachable from a class attribute: unwrap descriptors and decorator closures."""
    if depth == 0:
        return
    if isinstance(value, _DESCRIPTORS):
        for attr in _DESCRIPTOR_FUNCTIONS:
            yield from _functions_in(getattr(value, attr, None), depth)
    elif isinstance(value, types.FunctionType):
        yield value
        for cell in value.__closure__ or ():
            yield from _functions_in(_cell_get(cell), depth - 1)


def _point_class_cells(new: type, old: type) -> None:
    """Zero-argument `super()` reads a `__class__` cell: aim the new methods' cells at the live class."""
    for value in vars(new).values():
        for fn in _functions_in(value):
            if "__class__" in fn.__code__.co_freevars:
                cell = fn.__closure__[fn.__code__.co_freevars.index("__class__")]
                if _cell_get(cell) is new:
                    cell.cell_contents = old


def _cell_get(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return MISSING


@functools.cache
def _trampoline(n_freevars: int) -> types.CodeType:
    """Code that forwards every call to `__kwdefaults__[TARGET]`, with `n_freevars`
    unused free variables so it fits the old function's closure."""
    cells = [f"_cell{i}" for i in range(n_freevars)]
    src = "def _outer():\n"
    src += "".join(f"    {c} = None\n" for c in cells)
    src += f"    def redirected(*args, {TARGET}, **kwargs):\n"
    if cells:
        src += f"        if False: ({', '.join(cells)},)\n"
    src += f"        return {TARGET}(*args, **kwargs)\n    return redirected\n"
    namespace: dict = {}
    exec(compile(src, "<tsdev.hotreload redirect>", "exec"), namespace)
    return namespace["_outer"]().__code__


def _where(obj) -> str:
    """file:line where a definition starts (its first decorator)."""
    code = getattr(_underlying(obj), "__code__", None)
    if code is not None:
        return f"{code.co_filename}:{code.co_firstlineno}"
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (OSError, TypeError):
        return getattr(sys.modules.get(getattr(obj, "__module__", "")), "__file__", None) or "?"


def _is_args_of_call(ref, obj) -> bool:
    """gc.get_referrers(obj) sees its own argument tuple."""
    return type(ref) is tuple and len(ref) == 1 and ref[0] is obj


def _describe_referrer(ref, obj, module_names: dict) -> str:
    if isinstance(ref, dict):
        keys = [k for k, v in ref.items() if v is obj][:1]
        key = keys[0] if keys else "?"
        if id(ref) in module_names:
            return f"{module_names[id(ref)]}.{key}"
        return f"a dict at key {key!r}"
    if isinstance(ref, types.CellType):
        return "a closure cell"
    if isinstance(ref, types.MethodType):
        return f"a bound method {ref.__func__.__qualname__}"
    return f"a {type(ref).__name__}"
