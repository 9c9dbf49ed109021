"""Fixtures for the hot-reload scenarios: each test gets its own throwaway package."""
import importlib
import itertools
import linecache
import os
import sys
import textwrap

import pytest

# TRITON_INTERPRET (CPU machines) is set once for the whole run by tests/conftest.py.
sys.dont_write_bytecode = True  # edits land within the same second: never trust a .pyc here

_counter = itertools.count()


class Pkg:
    """A package `hrN` under tmp_path: write modules, import them, edit them."""

    def __init__(self, root, name):
        self.root, self.name = root, name

    def write(self, rel: str, source: str) -> str:
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(source).lstrip("\n"))
        importlib.invalidate_caches()
        return path

    edit = write

    def path(self, rel: str) -> str:
        """`a` -> a.py, `sub/__init__` -> sub/__init__.py."""
        return os.path.join(self.root, rel + ".py")

    def mod(self, rel: str = ""):
        """Import `name.rel` (`sub.b` for sub/b.py)."""
        return importlib.import_module(f"{self.name}.{rel}" if rel else self.name)

    def full(self, *rels: str) -> list:
        return [f"{self.name}.{r}" if r else self.name for r in rels]

    def reloader(self, *packages: str):
        from tsdev.hotreload import Reloader
        return Reloader(self.full(*packages) if packages else [self.name])

    @staticmethod
    def reload(reloader, **kwargs):
        """Reload, assert it worked, commit; return the report."""
        tx = reloader.reload(**kwargs)
        assert tx.report.ok, tx.report.error
        tx.commit()
        return tx.report


@pytest.fixture
def pkg(tmp_path):
    name = f"hr{next(_counter)}_{os.getpid()}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    yield Pkg(str(root), name)
    sys.path.remove(str(tmp_path))
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]
    for path in [p for p in linecache.cache if p.startswith(str(root))]:
        del linecache.cache[path]

