"""No module of the project imports itself back, directly or through others. Every import counts: at the top, in a
function, and under `if TYPE_CHECKING:` (a type checker reads the files as one circle, and the reloader orders
re-execution by imports: editing either side of a circle re-executes both). A circle is two modules that cannot be
read apart.

The imports are read with `ast` from the sources (nothing is imported, so no extra is needed): relative imports are
resolved, and `from pkg import name` is an import of the submodule `pkg.name` where that is a module, else of `pkg`.
Importing `a.b.c` counts as an import of `a.b.c` alone (as grimp and import-linter count it), not of `a` and `a.b`.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"tsdev": ROOT / "tsdev", "tsdev_runtime": ROOT / "runtime" / "tsdev_runtime",
            "tsdev_kernels": ROOT / "kernels" / "tsdev_kernels"}

Graph = dict[str, dict[str, str]]  # module -> {module it imports: "file:line" of the first such import}


def modules(packages: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Every module of `packages` (top-level name -> folder): its file, and whether it is a package."""
    found = {}
    for top, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imported_by(name: str, path: Path, is_package: bool, known) -> dict[str, str]:
    """The project's modules that `name` imports anywhere in its file, each with where it first does."""
    package = name if is_package else name.rpartition(".")[0]
    found = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.name_in_b` or an outside module ("" then)
                target = target.rpartition(".")[0]
            if target and target != name:
                found.setdefault(target, f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:"
                                         f"{node.lineno}")
    return found


def import_graph(packages: dict[str, Path]) -> Graph:
    known = modules(packages)
    return {name: imported_by(name, path, is_package, known) for name, (path, is_package) in known.items()}


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child), on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def one_loop(graph: Graph, circle: list[str]) -> str:
    """One way round `circle`, from its first module back to it, each step with the line that imports:
    "a -> b (a.py:3) -> a (b.py:7)"."""
    members, start = set(circle), circle[0]
    previous, frontier = {start: None}, [start]
    while frontier:  # breadth first, inside the circle: the shortest way back to `start`
        following = []
        for module in frontier:
            for child in sorted(graph[module]):
                if child == start:
                    steps, at = [(module, child)], module
                    while previous[at] is not None:
                        steps.append((previous[at], at))
                        at = previous[at]
                    return start + "".join(f" -> {b} ({graph[a][b]})" for a, b in reversed(steps))
                if child in members and child not in previous:
                    previous[child] = module
                    following.append(child)
        frontier = following
    raise AssertionError(f"no way round {circle}")


def test_the_project_has_no_import_circles():
    graph = import_graph(PACKAGES)
    assert len(graph) > 100  # the three packages were found
    assert sum(map(len, graph.values())) > 300
    found = [f"{', '.join(circle)}\n    e.g. {one_loop(graph, circle)}" for circle in circles(graph)]
    assert not found, "import circles (cut each, e.g. with a narrow interface in its own module):\n" + "\n".join(found)


def test_the_circle_finder_finds_every_kind_of_import_and_only_circles(tmp_path):
    package = tmp_path / "circled"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circled import b\n")  # `from pkg import submodule`
    (package / "b.py").write_text("def f():\n    from . import c\n")  # relative, in a function: still an import
    (package / "c.py").write_text("import circled.a.name\n")  # a name inside a module: that module
    (package / "d.py").write_text("from circled import a\n")  # imports the circle, is no part of it
    (package / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .f import F\n")
    (package / "f.py").write_text("from circled.e import E\n")  # a circle through a type-checking import counts too
    (package / "sub" / "__init__.py").write_text("from .g import G\n")
    (package / "sub" / "g.py").write_text("from ..sub import h\n")  # `from ..sub import h`: circled.sub.h
    (package / "sub" / "h.py").write_text("import os\nfrom .. import d\n")  # outside modules are no nodes

    graph = import_graph({"circled": package})
    assert graph["circled.sub"] == {"circled.sub.g": f"{package / 'sub' / '__init__.py'}:1"}
    assert set(graph["circled.sub.g"]) == {"circled.sub.h"} and set(graph["circled.sub.h"]) == {"circled.d"}
    assert circles(graph) == [["circled.a", "circled.b", "circled.c"], ["circled.e", "circled.f"]]
    assert one_loop(graph, ["circled.e", "circled.f"]) == (
        f"circled.e -> circled.f ({package / 'e.py'}:3) -> circled.e ({package / 'f.py'}:1)")
