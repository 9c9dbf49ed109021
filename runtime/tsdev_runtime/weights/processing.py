"""Post-load processing: each module's `process_weights_after_loading` hook, run once per load.

A module that derives tensors (the rotary cos/sin table, fp8 weights and scales) allocates them at construction
and fills them in its hook, which runs once per load session as soon as the module is complete: every parameter
it owns has every key its module declared (`runtime/tsdev_runtime/weights/keys.py`), and every child module has been
processed (children before parents, so a parent may use what its children derived). A later session (a weight update)
runs the hooks again into the same storage: derived tensors are written with `copy_`, never rebound, because CUDA
graphs captured their addresses; a rebinding hook fails the session.

"Complete" is the declared keys, never element counts: loads may arrive in any order and any number of times (a
repeat replaces), no repeat can stand in for a key that has not arrived, and a load into a module already
processed in the session marks it (and its ancestors) to be processed again at the end.
"""
import itertools
import os

from torch import nn

from tsdev_runtime.weights.keys import Key, key_text

# Negative control of the weights drill (tsdev weights drill, tests/test_sleep.py), never for serving: on a reload,
# "skip" leaves every derived tensor as it was (stale), "rebind" derives into new memory (the guard below refuses it),
# "rebuild" makes the FP8 experts derive into a new kernel-configuration object (runtime/tsdev_runtime/moe/experts.py).
DEBUG_DERIVED_ENV = "TSDEV_DEBUG_DERIVED"

Keys = dict[str, frozenset[Key]]  # parameter name -> the keys its module declared


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


class LoadSession:
    """One load into `model`'s existing parameters: call `loaded` after each load, `finish` at the end.

    `expected`: the keys each parameter gets in this session (every declared one; {} to rerun every hook with
    nothing loaded). `reprocessing`: the hooks ran before, so derived tensors must keep their addresses. Modules
    with nothing to wait for are processed at once."""

    def __init__(self, model: nn.Module, expected: Keys, reprocessing: bool):
        self.model, self.expected, self.reprocessing = model, expected, reprocessing
        self._names = {id(p): name for name, p in model.named_parameters()}
        unknown = set(expected) - set(self._names.values())
        if unknown:
            raise ValueError(f"loads expected into parameters the model does not have: {sorted(unknown)[:5]}")
        self.received: dict[str, set[Key]] = {name: set() for name in expected}
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

    def loaded(self, param: nn.Parameter, key: Key) -> None:
        """`param` received its key `key` (in place, already)."""
        name = self._names[id(param)]
        if key not in self.expected.get(name, ()):
            raise ValueError(f"{name}: a load {key_text(key)!r} its module does not declare (it declares "
                             f"{sorted(map(key_text, self.expected.get(name, ())))})")
        self.received[name].add(key)
        for module in self._owners[id(param)]:
            if id(module) in self._done:
                self._stale.add(id(module))
            else:
                self._try(module)

    def finish(self) -> None:
        """Check that every expected key arrived and process again what a late repeat changed."""
        incomplete = [f"{n} (has {sorted(map(key_text, self.received[n]))}, expects {sorted(map(key_text, k))})"
                      for n, k in self.expected.items() if not self._complete(n)]
        if incomplete:
            raise ValueError(f"the load ended before {len(incomplete)} parameter(s) had all of their "
                             f"loads, e.g. {'; '.join(incomplete[:3])}")
        for module in self._order:  # a stale module makes its ancestors stale too
            if id(module) in self._stale:
                self._stale |= {id(parent) for parent in self._parents.get(id(module), [])}
                self._run_hook(module)
        assert len(self._done) == len(self._order), "a module was never complete"

    def _complete(self, name: str) -> bool:
        return name not in self.expected or self.received[name] >= self.expected[name]

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
