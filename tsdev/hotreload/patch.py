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
import dis
import enum
import functools
import gc
import inspect
import sys
import types
from typing import Any, Callable

from . import cute, jit
from .code import instance_paths, same_code

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
        self.kernels_reset: list[jit.Reset] = []  # Triton kernels whose binaries were dropped
        # {old binary's CUfunction: (new one's, threads, shared bytes)} for every reset binary launched before,
        # when each new one launches as its old one did: captured graphs can run the new code by pointing their
        # kernel nodes at it (`jit.load_binaries`); None when they must be captured again
        self.graph_swaps: dict[int, tuple[int, int, int]] | None = None
        self.compiled_in_pause: dict[str, float] = {}  # module.name -> seconds (`jit.load_binaries`)
        self.retuned = False  # an autotuner's configs or key changed: its choices start over
        self.jit_kernels = 0  # ... of which had compiled (or interpreted) code
        self.cute_changed: dict[str, set[str]] = {}  # module -> its CuTe DSL functions whose code changed
        self._done: dict[int, Any] = {}  # id(old) -> what its name binds to now
        self._new_to_old: dict[int, tuple[Any, Any]] = {}  # id(new) -> (new, old merged into)
        self._stale_objects: list[Any] = []
        self._stale_index: list[int] = []  # which entry of `stale` each of `_stale_objects` is
        self._groups: dict[int, tuple[str, list[str], int]] = {}  # index in _stale_objects -> (reason, paths, more)
        self._saved_values: set[int] = set()  # ids of the values the pre-reload namespaces held
        self._fresh: set[int] = set()  # ids of instances the re-execution built and _rehome gave the live class
        self._init_changed: list[tuple[type, str, list[str]]] = []  # (live class, name, attributes new __init__ adds)
        self._changed_nested: dict[int, tuple[dict, str, dict, dict]] = {}  # id(ns) -> (ns, module, old, new codes)

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
        if type(old) is functools.partial and type(new) is functools.partial:
            return self._partial(old, new)
        if is_definition(old):
            self.add_stale(old, name, f"{kind(old)} became {kind(new)}")
            return new
        return self.translate(new)

    # -- functions -------------------------------------------------------------
    def _function(self, old, new, module, name):
        if cute.is_cute(old) and cute.changed(old, new):
            self.cute_changed.setdefault(module.__name__, set()).add(old.__name__)
        self._save_function(old)
        if old.__globals__ is new.__globals__ and old.__code__.co_freevars == new.__code__.co_freevars:
            old.__code__ = new.__code__
            for old_cell, new_cell in zip(old.__closure__ or (), new.__closure__ or ()):
                self._cell(old_cell, new_cell, module, name)
            old.__defaults__ = tuple(map(self.translate, new.__defaults__)) if new.__defaults__ else None
            old.__kwdefaults__ = ({k: self.translate(v) for k, v in new.__kwdefaults__.items()}
                                  if new.__kwdefaults__ else None)
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

    def _partial(self, old, new):
        """A partial's func/args are read-only attributes, but `__setstate__` replaces them all in place."""
        state = old.__reduce__()[2]
        self.undo.append(lambda: old.__setstate__(state))
        old.__setstate__((self.translate(new.func), tuple(map(self.translate, new.args)),
                          {k: self.translate(v) for k, v in new.keywords.items()}, new.__dict__ or None))
        self.patched += 1
        return old

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
        init_change = _init_change(vars(old).get("__init__"), vars(new).get("__init__"), self.translate)
        if init_change is not None:
            self._init_changed.append((old, name, init_change))
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
                self._fresh.add(id(value))
            except TypeError:
                pass
        return value

    # -- stale -----------------------------------------------------------------
    def add_stale(self, obj: Any, name: str, reason: str) -> None:
        self._stale_index.append(len(self.stale))
        self.stale.append({"name": name, "reason": reason, "where": _where(obj), "referrers": []})
        self._stale_objects.append(obj)

    def note_code(self, module: types.ModuleType, old_code: types.CodeType | None, new_code: types.CodeType) -> None:
        """Remember a module whose lambdas or nested functions changed: live copies of those are not
        bound to any name the patcher can follow (a lambda in a registry, a closure a factory returned)."""
        if old_code is None:
            return
        old, new = _nested_codes(old_code), _nested_codes(new_code)
        changed = {q: codes for q, codes in old.items()
                   if any(not any(same_code(c, n) for n in new.get(q, ())) for c in codes)}
        if changed:
            ns = vars(module)
            self._changed_nested[id(ns)] = (ns, module.__name__, changed, new)

    def find_live_stale(self, saved: list[dict], tracked: list[types.ModuleType]) -> None:
        """Report what keeps running old code though nothing names it: live instances of a class whose
        `__init__` changed, and live lambdas/nested functions whose code changed.

        One heap scan (gc.get_referrers, ~10 ms with torch imported), and only when a reload changed an
        `__init__` or an unnamed function: the common edit (a body of a named function) pays nothing.
        """
        if not self._init_changed and not self._changed_nested:
            return
        classes: dict[int, int] = {}  # id(class or subclass) -> index in _init_changed
        for i, (cls, _, _) in enumerate(self._init_changed):
            for c in _with_subclasses(cls):
                classes.setdefault(id(c), i)
        targets = [c for c, _, _ in self._init_changed] + [ns for ns, *_ in self._changed_nested.values()]
        for cls, _, _ in self._init_changed:
            targets += [c for c in _with_subclasses(cls) if c is not cls]
        self._saved_values = {id(v) for ns in saved for v in ns.values()}
        instances, functions = self._scan(targets, classes)
        for (cls, name, added), found in zip(self._init_changed, instances):
            if found:
                reason = (f"{{n}} live instance(s) of {cls.__module__}.{cls.__qualname__} keep attributes set by "
                          "the old __init__")
                reason += f"; the new __init__ also sets {', '.join(added)}" if added else ""
                # Only instances the old namespaces hold may be dead (freed at commit): check those few
                # (gc.get_referrers costs heap size x number of objects asked about).
                maybe = [o for o in found if id(o) in self._saved_values]
                paths = instance_paths(found, tracked)
                if maybe:
                    self.add_group(cls, maybe, name, reason, paths, len(found) - len(maybe))
                else:
                    self.stale.append({"name": name, "reason": reason.format(n=len(found)), "where": _where(cls),
                                       "referrers": paths})
        for (module, qualname), found in functions.items():
            what = "lambda" if qualname.endswith("<lambda>") else "nested function"
            self.add_group(found[0].__code__, found, f"{module}.{qualname}",
                            f"{{n}} live {what}(s) created by the old code and held outside the module's names: "
                            "cannot be patched (which new one replaces it is ambiguous)")

    def add_group(self, definition, found: list, name: str, reason: str, paths: list[str] | None = None,
                   more: int = 0) -> None:
        """A stale entry for objects that count only if something outside the old namespaces holds them
        (plus `more` known to be live)."""
        self.add_stale(definition, name, reason)
        self._stale_objects[-1] = found
        self._groups[len(self._stale_objects) - 1] = (reason, paths or [], more)

    def _scan(self, targets: list, classes: dict[int, int]) -> tuple[list[list], dict]:
        """The one heap scan: instances of the classes, functions over the namespaces."""
        instances: list[list] = [[] for _ in self._init_changed]
        functions: dict[tuple[str, str], list] = {}
        fresh = self._fresh
        for ref in gc.get_referrers(*targets):
            i = classes.get(id(type(ref)))
            if i is not None:
                if id(ref) not in fresh:  # built by the new code during this reload: has the new attributes
                    instances[i].append(ref)
            elif isinstance(ref, types.FunctionType) and id(ref.__globals__) in self._changed_nested:
                ns, module, changed, new = self._changed_nested[id(ref.__globals__)]
                code = ref.__code__
                if (code.co_qualname in changed and any(same_code(code, c) for c in changed[code.co_qualname])
                        and not any(same_code(code, n) for n in new.get(code.co_qualname, ()))):
                    functions.setdefault((module, code.co_qualname), []).append(ref)
        return instances, functions

    def describe_stale(self, ignore: list) -> None:
        """Fill each stale entry's `referrers`: who still holds the old object (one heap scan for all)."""
        if not self._stale_objects:
            return
        groups = [obj if isinstance(obj, list) else [obj] for obj in self._stale_objects]
        owner = {id(o): i for i, group in enumerate(groups) for o in group}
        saved_ids = {id(x) for x in ignore}
        ignore_ids = saved_ids | {id(self._stale_objects), id(self.__dict__), id(groups)}
        ignore_ids |= {id(g) for g in groups}
        names = {id(vars(m)): m.__name__ for m in list(sys.modules.values()) if m is not None}
        refs: list[set] = [set() for _ in groups]
        objs = [o for group in groups for o in group]
        saved_values = self._saved_values
        live: set[int] = set()
        pending = []  # containers of the old namespaces (undo log): count only if held elsewhere too

        def note(ref):
            for held in gc.get_referents(ref):
                i = owner.get(id(held))
                if i is not None and any(held is o for o in groups[i]):
                    refs[i].add(_describe_referrer(ref, held, names))
                    live.add(id(held))
        ignore_ids.add(id(sys._getframe()))  # other frames count: a running loop's local keeps an object alive
        old_only: set[int] = set()  # held by the old namespaces (the undo log)
        for ref in gc.get_referrers(*objs):
            if id(ref) in saved_ids:
                old_only |= {id(x) for x in gc.get_referents(ref)}
            if id(ref) in ignore_ids or ref is objs:
                continue
            if id(ref) in saved_values and isinstance(ref, (dict, list, tuple, set)):
                pending.append(ref)
            else:
                note(ref)
        if pending:  # a second scan, only when an old registry may hold old functions
            held_elsewhere = set()
            for ref in gc.get_referrers(*pending):
                if id(ref) in ignore_ids or ref is pending:
                    continue
                held_elsewhere |= {id(x) for x in gc.get_referents(ref)}
            for ref in pending:
                if id(ref) in held_elsewhere:
                    note(ref)
                else:
                    old_only |= {id(x) for x in gc.get_referents(ref)}
        ref = pending = None
        dropped = set()
        for i, (index, found) in enumerate(zip(self._stale_index, refs)):
            entry = self.stale[index]
            entry["referrers"] = sorted(found)[:10]
            if i in self._groups:
                reason, paths, more = self._groups[i]
                # Held by the old namespaces only: freed at commit. Held by nothing visible: a running
                # frame's local (gc cannot see those), so live.
                n = more + sum(id(o) in live or id(o) not in old_only for o in groups[i])
                if not n:
                    dropped.add(index)
                entry["reason"] = reason.format(n=n)
                entry["referrers"] = paths or entry["referrers"]
        self.stale[:] = [e for i, e in enumerate(self.stale) if i not in dropped]


# -- helpers ------------------------------------------------------------------
_NOT_HELD = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<module>")


def _nested_codes(code: types.CodeType) -> dict[str, list[types.CodeType]]:
    """{qualname: codes} of the lambdas and nested functions under a module's code."""
    found: dict[str, list] = {}
    stack = [code]
    while stack:
        c = stack.pop()
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                stack.append(const)
                if const.co_name not in _NOT_HELD and (const.co_name == "<lambda>" or "<locals>" in const.co_qualname):
                    found.setdefault(const.co_qualname, []).append(const)
    return found


def _init_change(old, new, translate: Callable[[Any], Any] = lambda value: value) -> list[str] | None:
    """None when `__init__` did not change; else the attributes the new one sets on self that the old did not.
    `translate`: a new object to the old one it was merged into -- a default that is a class of the re-run module (a
    decoder layer's) is the same default, not a change (which cost every reload of a model module a heap scan)."""
    if old is new:
        return None
    old_fn, new_fn = _underlying(old), _underlying(new)
    if not isinstance(old_fn, types.FunctionType) or not isinstance(new_fn, types.FunctionType):
        return None if old is None and new is None else sorted(_self_attributes(new_fn) - _self_attributes(old_fn))
    defaults = None if new_fn.__defaults__ is None else tuple(map(translate, new_fn.__defaults__))
    kwdefaults = None if new_fn.__kwdefaults__ is None else {k: translate(v) for k, v in new_fn.__kwdefaults__.items()}
    if (same_code(old_fn.__code__, new_fn.__code__) and _same_values(old_fn.__defaults__, defaults)
            and _same_values(old_fn.__kwdefaults__, kwdefaults)):
        return None
    return sorted(_self_attributes(new_fn) - _self_attributes(old_fn))


def _same_values(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  (a default whose == does not give a bool: a tensor)
        return a is b


def _self_attributes(fn) -> set[str]:
    """Names assigned as `self.X = ...` in a method (from its bytecode: the source on disk may be newer)."""
    code = getattr(fn, "__code__", None)
    if code is None or not code.co_argcount:
        return set()
    self_name = code.co_varnames[0]
    names, previous = set(), None
    for ins in dis.get_instructions(code):
        if ins.opname == "STORE_ATTR" and previous is not None and previous.opname == "LOAD_FAST" \
                and previous.argval == self_name:
            names.add(ins.argval)
        previous = ins
    return names


def _with_subclasses(cls: type) -> list[type]:
    """`cls` and every class under it (they inherit its `__init__`)."""
    found, stack = [], [cls]
    while stack:
        c = stack.pop()
        found.append(c)
        try:
            stack.extend(type.__subclasses__(c))
        except TypeError:
            pass
    return found


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
    if type(obj) is functools.partial:
        return _underlying(obj.func)
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


def _describe_referrer(ref, obj, module_names: dict) -> str:
    if isinstance(ref, dict):
        keys = [k for k, v in ref.items() if v is obj][:1]
        key = keys[0] if keys else "?"
        if id(ref) in module_names:
            return f"{module_names[id(ref)]}.{key}"
        return f"a dict at key {key!r}"
    if isinstance(ref, types.CellType):
        return "a closure cell"
    if isinstance(ref, types.FrameType):
        return f"a local variable of {ref.f_code.co_qualname}"
    if isinstance(ref, types.MethodType):
        return f"a bound method {ref.__func__.__qualname__}"
    return f"a {type(ref).__name__}"

