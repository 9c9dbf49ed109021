"""Post-load processing: each module's `process_weights_after_loading` hook, run once per load.

A module that derives tensors (the rotary cos/sin table; later, fp8 scales) allocates them at
construction and fills them in its hook, which runs once per load session as soon as the module is
complete: every parameter it owns holds what the checkpoint provides, and every child module has been
processed (children before parents, so a parent may use what its children derived). A later session
(a weight update) runs the hooks again into the same storage: derived tensors are written with `copy_`,
never rebound, because CUDA graphs captured their addresses; a rebinding hook fails the session.

"Complete" comes from the loads themselves, never from declared sizes. Each load into a parameter
carries a key (its shard of a fused parameter: q, k or v of qkv_proj, gate or up of gate_up_proj; None
for a whole tensor) and an element count (under tensor parallelism, of this rank's slice). A disk load knows from the checkpoint's headers, before any
data is read, which loads each parameter will get; the first complete load records them per model, and
a later session without headers (tensors streamed in) expects the recorded ones. A repeated load
replaces its key's count instead of adding to it, so loads may arrive in any order and any number of
times, and no repeat can stand in for a load that has not arrived; a load into a module already processed
in the session marks it (and its ancestors) to be processed again at the end.
"""
import itertools
import os
from weakref import WeakKeyDictionary

from torch import nn

# Negative control of the weights drill (tsdev weights drill, tests/test_sleep.py), never for serving: on a reload,
# "skip" leaves every derived tensor as it was (stale), "rebind" derives into new memory (the guard below refuses it).
DEBUG_DERIVED_ENV = "TSDEV_DEBUG_DERIVED"

# parameter name -> {load key: element count}; the key is a shard name, or None for a whole tensor
Counts = dict[str, dict[str | None, int]]

_RECORDED: "WeakKeyDictionary[nn.Module, Counts]" = WeakKeyDictionary()


def recorded_counts(model: nn.Module) -> Counts | None:
    """The loads of `model`'s first complete load session, or None before it."""
    return _RECORDED.get(model)


def post_order(model: nn.Module) -> list[nn.Module]:
    """Every module once (shared ones, like the rotary table, too), each after all of its children."""
    order, seen = [], set()

    def visit(module: nn.Module) -> None:
        if id(module) not in seen:
            seen.add(id(module))
            for child in module.children():
                visit(child)
            order.append(module)

    visit(model)
    return order


def process_weights_after_loading(model: nn.Module) -> None:
    """Run every module's hook again, children first, into the same storage (after the weights changed
    outside the loader, or derived tensors were discarded)."""
    LoadSession(model, expected={}).finish()


class LoadSession:
    """One load into `model`'s existing parameters: call `loaded` after each load, `finish` at the end.

    `expected`: the loads each parameter gets in this session (from the checkpoint's headers); None: the
    loads recorded at the model's first load. Parameters not in it count as complete (they keep their
    values). Modules with nothing to wait for are processed at once."""

    def __init__(self, model: nn.Module, expected: Counts | None = None):
        if expected is None:
            expected = recorded_counts(model)
            if expected is None:
                raise ValueError("this model has no recorded load yet: load its checkpoint first (load_weights)")
        self.model, self.expected = model, expected
        self.reprocessing = recorded_counts(model) is not None  # derived tensors must keep their addresses
        self._names = {id(p): name for name, p in model.named_parameters()}
        unknown = set(expected) - set(self._names.values())
        if unknown:
            raise ValueError(f"loads expected into parameters the model does not have: {sorted(unknown)[:5]}")
        self.received: Counts = {name: {} for name in expected}
        self.processed: list[nn.Module] = []  # hooks run, in order
        self._done: set[int] = set()
        self._stale: set[int] = set()
        self._owners: dict[int, list[nn.Module]] = {}
        self._parents: dict[int, list[nn.Module]] = {}
        self._own: dict[int, list[str]] = {}  # a module's parameters, by name, and its children: walked once
        self._children: dict[int, list[int]] = {}
        self._order = post_order(model)
        for module in self._order:
            self._own[id(module)] = [self._names[id(p)] for p in module.parameters(recurse=False)]
            self._children[id(module)] = [id(child) for child in module.children()]
            for p in module.parameters(recurse=False):
                self._owners.setdefault(id(p), []).append(module)
            for child in module.children():
                self._parents.setdefault(id(child), []).append(module)
        for module in self._order:
            self._try(module)

    def loaded(self, param: nn.Parameter, key: str | None, numel: int) -> None:
        """`param` received the load `key` of `numel` elements (in place, already)."""
        name = self._names[id(param)]
        if key not in self.expected.get(name, {}):
            raise ValueError(f"{name}: a load {key!r} that its first load did not have (it had "
                             f"{sorted(map(str, self.expected.get(name, {})))})")
        self.received[name][key] = numel  # a repeat replaces: it never stands in for a missing load
        for module in self._owners[id(param)]:
            if id(module) in self._done:
                self._stale.add(id(module))
            else:
                self._try(module)

    def finish(self) -> Counts:
        """Check that every expected load arrived, process again what a late repeat changed, record the
        loads of the model's first session. Returns what this session received."""
        incomplete = [f"{n} (has {sorted(map(str, self.received[n]))}, expects {sorted(map(str, c))})"
                      for n, c in self.expected.items() if not self._complete(n)]
        if incomplete:
            raise ValueError(f"the load ended before {len(incomplete)} parameter(s) had all of their "
                             f"loads, e.g. {'; '.join(incomplete[:3])}")
        for module in self._order:  # a stale module makes its ancestors stale too
            if id(module) in self._stale:
                self._stale |= {id(parent) for parent in self._parents.get(id(module), [])}
                self._run_hook(module)
        assert len(self._done) == len(self._order), "a module was never complete"
        if self.expected and not self.reprocessing:
            _RECORDED[self.model] = {n: dict(c) for n, c in self.received.items()}
        return self.received

    def _complete(self, name: str) -> bool:
        return name not in self.expected or self.received[name] == self.expected[name]

    def _try(self, module: nn.Module) -> None:
        if id(module) in self._done:
            return
        if not all(self._complete(name) for name in self._own[id(module)]):
            return
        if not all(child in self._done for child in self._children[id(module)]):
            return
        self._done.add(id(module))
        self._run_hook(module)
        for parent in self._parents.get(id(module), []):
            self._try(parent)

    def _run_hook(self, module: nn.Module) -> None:
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is None:
            return
        debug = os.environ.get(DEBUG_DERIVED_ENV, "") if self.reprocessing else ""
        if debug == "skip":
            return
        before = _addresses(module)
        hook()
        if debug == "rebind":
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, buffer.clone())
        after = _addresses(module)
        moved = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
        if self.reprocessing and moved:
            raise RuntimeError(
                f"{type(module).__name__}.process_weights_after_loading rebound {', '.join(moved)}: derive into "
                "the tensors allocated at construction with copy_ (CUDA graphs captured their addresses)")
        self.processed.append(module)


def _addresses(module: nn.Module) -> dict[str, int]:
    tensors = itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
    return {name: t.data_ptr() for name, t in tensors}
