"""Which tracked module uses which, and in what order to re-execute them.

Edges come from two places, both cheap: the import statements of the source
(including imports inside functions and `pkg.sub.attr` uses of an imported
package), and the live module namespace (modules and definitions it holds), so
`importlib.import_module` and registries filled at import time count too.
"""
from __future__ import annotations

import ast
import importlib.util
import types
from typing import Iterable, Mapping


def static_providers(tree: ast.Module, code: types.CodeType, name: str, is_package: bool,
                     known: Iterable[str]) -> set[str]:
    """Tracked modules that the source of module `name` imports or reaches by attribute."""
    known = set(known)
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(tree.body):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        try:
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
        except (ImportError, ValueError):
            continue
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.add(sub if sub in known else base)
    names = _code_names(code)
    for _ in range(3):  # `ops.norm.rms_norm`: follow attribute uses a few levels down
        more = {m for m in known if m.rpartition(".")[0] in found and m.rpartition(".")[2] in names}
        if more <= found:
            break
        found |= more
    found.discard(name)
    return found & known


def runtime_providers(module: types.ModuleType, known: set[str]) -> set[str]:
    """Tracked modules whose modules, functions or classes this namespace holds.

    A package's submodule attributes are skipped: the import system sets them,
    the package's code does not use them (its imports are seen statically).
    """
    found = set()
    for key, value in list(vars(module).items()):
        if isinstance(value, types.ModuleType):
            if value.__name__ != f"{module.__name__}.{key}":
                found.add(value.__name__)
        elif isinstance(value, (type, types.FunctionType)):
            found.add(getattr(value, "__module__", None))
    found.discard(module.__name__)
    return found & known


def dependents(roots: Iterable[str], providers: Mapping[str, set[str]], reloadable) -> list[str]:
    """Every reloadable module that uses a root, directly or through another reloadable one."""
    users: dict[str, set[str]] = {}
    for user, provs in providers.items():
        for p in provs:
            users.setdefault(p, set()).add(user)
    seen, todo = set(roots), list(roots)
    while todo:
        for user in users.get(todo.pop(), ()):
            if user not in seen and reloadable(user):
                seen.add(user)
                todo.append(user)
    return sorted(seen - set(roots))


def provider_order(targets: Iterable[str], providers: Mapping[str, set[str]], rank: Mapping[str, int]) -> list[str]:
    """`targets` with providers before users; cycles broken by original import order."""
    targets = set(targets)
    last = len(rank)
    by_rank = lambda m: (rank.get(m, last), m)  # noqa: E731
    order, seen = [], set()

    def visit(m: str) -> None:  # iterative would be longer; import graphs are shallow
        seen.add(m)
        for p in sorted(providers.get(m, ()), key=by_rank):
            if p not in seen:
                visit(p)
        if m in targets:
            order.append(m)

    for m in sorted(targets, key=by_rank):
        if m not in seen:
            visit(m)
    return order


def _import_nodes(body):
    """Import statements anywhere in the statement tree (expressions are skipped: faster)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            child = getattr(node, field, None)
            if child:
                yield from _import_nodes(child)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names
