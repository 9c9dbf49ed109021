"""No module of the project imports itself back, directly or through others (imports made at run time, in functions
too; those only a type checker reads aside). The reloader orders re-execution by imports: editing either side of a
circle re-executes both, and a circle is two modules that cannot be read apart."""
import sys

PACKAGES = ("tsdev", "tsdev_runtime", "tsdev_kernels")


def circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child), on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
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
    return found


def test_the_project_has_no_import_circles():
    import grimp  # import-linter's, in the dev extras (imported here: collecting needs no dev extras)

    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    assert len(graph.modules) > 100  # the three packages were found
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle_and_only_it(tmp_path, monkeypatch):
    package = tmp_path / "circled"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circled import b\n")
    (package / "b.py").write_text("def f():\n    from circled import c\n")  # in a function: still an import
    (package / "c.py").write_text("import circled.a\n")
    (package / "d.py").write_text("from circled import a\n")
    (package / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circled import f\n")
    (package / "f.py").write_text("from circled import e\n")  # a circle only through a type-checking import
    monkeypatch.syspath_prepend(str(tmp_path))
    import grimp

    graph = grimp.build_graph("circled", exclude_type_checking_imports=True, cache_dir=None)
    assert circles(graph) == [["circled.a", "circled.b", "circled.c"]]
    sys.modules.pop("circled", None)
