"""Run the hot-reload edit scenarios through tsdev, IPython's autoreload and jurigged.

    pip install ipython jurigged          # for this script only; not project dependencies
    python3 benchmarks/hotreload_compare.py --out docs/reload-comparison.md

Each scenario writes a small package, imports it, takes references the way a
server holds them (`from x import f` copies, registries, bound methods, live
instances, kernel objects), edits the files, lets the tool reload, and then
checks behaviour through those old references. A tool without a notion a
scenario needs (transactions, reloadable packages, forced modules) gets n/a.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import io
import itertools
import os
import platform
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TRITON = "import torch\nimport triton\nimport triton.language as tl\n"


@dataclass
class Scenario:
    name: str
    files: dict[str, str]  # rel path (no .py) -> source, {p} = package name
    edits: dict[str, str]  # files rewritten (in this order) before the reload
    setup: str  # run after import: take references
    check: str  # expression over those references, after the reload
    needs: set[str] = field(default_factory=set)  # "transaction", "packages", "forced", "triton"
    packages: list[str] | None = None  # reloadable packages (rel), default the whole package
    forced: list[str] | None = None


def S(name, files, edits, setup, check, **kw) -> Scenario:
    d = lambda m: {k: textwrap.dedent(v).lstrip("\n") for k, v in m.items()}  # noqa: E731
    return Scenario(name, d(files), d(edits), textwrap.dedent(setup), check, **kw)


CLS = "class A:\n    def f(self):\n        return {}\n"
DECO = """
import functools
def twice(fn):
    @functools.wraps(fn)
    def wrapper(*a):
        return 2 * fn(*a)
    return wrapper
"""
KERNEL = TRITON + """
@triton.jit
def helper(x):
    return x + 1

@triton.jit
def kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, helper(tl.load(x_ptr + offs)) * SCALE)

SCALE = tl.constexpr(1)
"""
LAUNCH = """
from {p}.k import kernel, torch
def launch():  # through the kernel object taken before the reload, as a kernel plan holds it
    x, out = torch.arange(4.0), torch.empty(4)
    kernel[(1,)](x, out, BLOCK=4)
    return out.tolist()
assert launch() == [1, 2, 3, 4]  # warm: a running server has launched (and cached) it already
"""
NORM = """
class Norm:
    def __init__(self, dim):
        self.dim = dim
    def forward(self, x):
        return x * self.dim
"""
PARTIAL = "import functools\ndef scale(x, k):\n    return x * k\ndouble = functools.partial(scale, k=2)\n"


AUTOTUNE = TRITON + """
def bench(call, quantiles):
    call()
    return [1.0, 1.0, 1.0]

@triton.autotune(configs=[triton.Config({"BLOCK": B})], key=[], do_bench=bench)
@triton.jit
def kernel(out_ptr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, 1), tl.full((1,), BLOCK, tl.float32))
"""

SCENARIOS = [
    S("function body", {"a": "def f():\n    return 1\n"}, {"a": "def f():\n    return 2\n"},
      "from {p}.a import f", "f() == 2"),
    S("method body, live instance", {"a": CLS.format(1)}, {"a": CLS.format(2)},
      "from {p}.a import A; a = A()", "a.f() == 2"),
    S("`from x import f` copy and a registry holding f",
      {"a": "def f():\n    return 1\n", "b": "from .a import f\nREG = {'f': f}\n"},
      {"a": "def f():\n    return 2\n"},
      "from {p}.b import f, REG", "f() == 2 and REG['f']() == 2"),
    S("bound method stored before the reload", {"a": CLS.format(1)}, {"a": CLS.format(2)},
      "from {p}.a import A; hook = A().f", "hook() == 2"),
    S("closure free variable value changed",
      {"a": "def make(k):\n    def f(x):\n        return x * k\n    return f\nf = make(2)\n"},
      {"a": "def make(k):\n    def f(x):\n        return x * k\n    return f\nf = make(3)\n"},
      "from {p}.a import f", "f(1) == 3"),
    S("closure shape changed",
      {"a": "def make(k):\n    def f(x):\n        return x * k\n    return f\nf = make(2)\n"},
      {"a": "def make(k, b=1):\n    def f(x):\n        return x * k + b\n    return f\nf = make(2)\n"},
      "from {p}.a import f", "f(1) == 3"),
    S("super() added",
      {"a": "class B:\n    def f(self):\n        return 1\nclass C(B):\n    def f(self):\n        return 10\n"},
      {"a": "class B:\n    def f(self):\n        return 1\nclass C(B):\n"
            "    def f(self):\n        return super().f() + 100\n"},
      "from {p}.a import C; c = C()", "c.f() == 101"),
    S("decorator added", {"deco": DECO, "a": "def f(x):\n    return x\n"},
      {"a": "from .deco import twice\n@twice\ndef f(x):\n    return x + 1\n"},
      "from {p}.a import f", "f(1) == 4"),
    S("decorator removed", {"deco": DECO, "a": "from .deco import twice\n@twice\ndef f(x):\n    return x\n"},
      {"a": "def f(x):\n    return x - 1\n"},
      "from {p}.a import f", "f(3) == 2"),
    S("decorator changed", {"deco": DECO + "def plus(fn):\n    return lambda *a: fn(*a) + 5\n",
                            "a": "from .deco import twice, plus\n@twice\ndef f(x):\n    return x\n"},
      {"a": "from .deco import twice, plus\n@plus\ndef f(x):\n    return x\n"},
      "from {p}.a import f", "f(1) == 6"),
    S("method added", {"a": CLS.format(1)}, {"a": CLS.format("self.g()") + "    def g(self):\n        return 7\n"},
      "from {p}.a import A; a = A()", "a.f() == 7 and a.g() == 7"),
    S("method deleted (falls back to base)",
      {"a": "class B:\n    def f(self):\n        return 'base'\nclass C(B):\n    def f(self):\n        return 'c'\n"},
      {"a": "class B:\n    def f(self):\n        return 'base'\nclass C(B):\n    pass\n"},
      "from {p}.a import C; c = C()", "c.f() == 'base'"),
    S("property body", {"a": "class A:\n    @property\n    def v(self):\n        return 1\n"},
      {"a": "class A:\n    @property\n    def v(self):\n        return 2\n"},
      "from {p}.a import A; a = A()", "a.v == 2"),
    S("classmethod / staticmethod",
      {"a": "class A:\n    @classmethod\n    def c(cls):\n        return 1\n"
            "    @staticmethod\n    def s():\n        return 1\n"},
      {"a": "class A:\n    @classmethod\n    def c(cls):\n        return 2\n"
            "    @staticmethod\n    def s():\n        return 2\n"},
      "from {p}.a import A; c, s = A.c, A.s", "c() == 2 and s() == 2 and A.c() == 2"),
    S("base class changed",
      {"a": "class X:\n    def f(self):\n        return 'x'\nclass Y:\n    def f(self):\n        return 'y'\n"
            "class C(X):\n    pass\n"},
      {"a": "class X:\n    def f(self):\n        return 'x'\nclass Y:\n    def f(self):\n        return 'y'\n"
            "class C(Y):\n    pass\n"},
      "from {p}.a import C; c = C()", "c.f() == 'y'"),
    S("constant used by a dependent via `from x import C`",
      {"a": "SIZE = 4\n", "b": "from .a import SIZE\ndef size():\n    return SIZE\n"}, {"a": "SIZE = 8\n"},
      "from {p}.b import size", "size() == 8"),
    S("new name imported by another module",
      {"a": "def f():\n    return 1\n", "b": "from .a import f\ndef g():\n    return f()\n"},
      {"a": "def f():\n    return 1\ndef h():\n    return 41\n",
       "b": "from .a import f, h\ndef g():\n    return f() + h()\n"},
      "from {p}.b import g", "g() == 42"),
    S("dependents re-executed in provider order",
      {"log": "ORDER = []\n", "a": "from . import log\nA = 1\nlog.ORDER.append('a')\n",
       "b": "from . import log\nfrom .a import A\nB = A + 1\nlog.ORDER.append('b')\n",
       "c": "from . import log\nfrom .b import B\nC = B + 1\nlog.ORDER.append('c')\n"},
      {"a": "from . import log\nA = 10\nlog.ORDER.append('a')\n"},
      "import {p}.c as c, {p}.log as log; log.ORDER.clear()", "c.C == 12 and log.ORDER == ['a', 'b', 'c']"),
    S("import cycle",
      {"a": "from . import b\ndef fa():\n    return 'a1' + b.fb()\n",
       "b": "from . import a\ndef fb():\n    return 'b1'\n"},
      {"a": "from . import b\ndef fa():\n    return 'a2' + b.fb()\n",
       "b": "from . import a\ndef fb():\n    return 'b2'\n"},
      "from {p}.a import fa", "fa() == 'a2b2'"),
    S("syntax error: nothing changes",
      {"a": "def f():\n    return 1\n", "b": "def g():\n    return 1\n"},
      {"b": "def g():\n    return 2\n", "a": "def f():\n    return 2\ndef broken(:\n    pass\n"},
      "from {p}.a import f; from {p}.b import g", "f() == 1 and g() == 1"),
    S("exception in top-level code of the 2nd of 3 modules: all revert",
      {"a": "def fa():\n    return 1\n", "b": "from .a import fa\ndef fb():\n    return 1\n",
       "c": "from .b import fb\ndef fc():\n    return 1\n"},
      {"a": "def fa():\n    return 2\n",
       "b": "from .a import fa\ndef fb():\n    return 2\nraise RuntimeError('boom')\n",
       "c": "from .b import fb\ndef fc():\n    return 2\n"},
      "from {p}.a import fa; from {p}.b import fb; from {p}.c import fc", "(fa(), fb(), fc()) == (1, 1, 1)"),
    S("failure injected after patching: all revert", {"a": CLS.format(1) + "X = 1\n"},
      {"a": CLS.format(2) + "X = 2\n"},
      "import {p}.a as m; a = m.A()", "a.f() == 1 and m.X == 1", needs={"transaction"}),
    S("lru_cache function", {"a": "import functools\n@functools.lru_cache\ndef t(n):\n    return n\n"},
      {"a": "import functools\n@functools.lru_cache\ndef t(n):\n    return 2 * n\n"},
      "from {p}.a import t; t(3)", "t(3) == 6"),
    S("dataclass field added: reported stale, not silently wrong",
      {"a": "import dataclasses\n@dataclasses.dataclass\nclass Cfg:\n    a: int = 1\n"},
      {"a": "import dataclasses\n@dataclasses.dataclass\nclass Cfg:\n    a: int = 1\n    b: int = 2\n"},
      "import {p}.a as m; cfg = m.Cfg()", "m.Cfg().b == 2 and cfg.a == 1 and reported('Cfg')"),
    S("enum member added", {"a": "import enum\nclass M(enum.Enum):\n    A = 1\n"},
      {"a": "import enum\nclass M(enum.Enum):\n    A = 1\n    B = 2\n"},
      "from {p}.a import M; a = M.A", "M(2) is M.B and M.A is a and len(M) == 2"),
    S("Triton kernel body edit", {"k": KERNEL}, {"k": KERNEL.replace("* SCALE)", "* SCALE + 10)")},
      LAUNCH, "launch() == [11, 12, 13, 14]", needs={"triton"}),
    S("Triton helper edit seen by its caller", {"k": KERNEL}, {"k": KERNEL.replace("x + 1", "x + 5")},
      LAUNCH, "launch() == [5, 6, 7, 8]", needs={"triton"}),
    S("`tl.constexpr` global changed", {"k": KERNEL}, {"k": KERNEL.replace("tl.constexpr(1)", "tl.constexpr(3)")},
      LAUNCH, "launch() == [3, 6, 9, 12]", needs={"triton"}),
    S("autotune config change", {"k": AUTOTUNE.replace("B}", "16}")}, {"k": AUTOTUNE.replace("B}", "32}")},
      "from {p}.k import kernel, torch\nout = torch.zeros(1); kernel[(1,)](out)",
      "(kernel[(1,)](out), out.item())[1] == 32", needs={"triton"}),
    S("module outside the packages: needs restart",
      {"layers": "def f():\n    return 1\n", "engine": "def run():\n    return 1\n"},
      {"engine": "def run():\n    return 2\n"},
      "from {p}.engine import run; import {p}.layers", "run() == 1 and reported('engine')",
      needs={"packages"}, packages=["layers"]),
    S("forced module list (module-level cache emptied)",
      {"a": "CACHE = {}\n"}, {}, "import {p}.a as m; m.CACHE[1] = 1", "m.CACHE == {}", needs={"forced"}, forced=["a"]),
    # issue 16.5: what keeps running old code is fixed, or reported (never silently wrong)
    S("`__init__` sets a new attribute the new method reads, live instance: migrated or reported stale",
      {"a": NORM, "engine": "MODEL = []\n"},
      {"a": NORM.replace("self.dim = dim", "self.dim = dim\n        self.eps = 1")
                .replace("x * self.dim", "x * self.dim + self.eps")},
      "import {p}.a as m, {p}.engine as e; e.MODEL.append(m.Norm(2)); n = e.MODEL[0]",
      "hasattr(n, 'eps') and n.forward(1) == 3 or (not hasattr(n, 'eps') and reported('Norm'))", packages=["a"]),
    S("lambda held in another module's registry: patched or reported stale",
      {"ops": "OPS = {'act': lambda x: x + 1}\n", "reg": "REG = {}\n"}, {"ops": "OPS = {'act': lambda x: x + 100}\n"},
      "import {p}.ops as o, {p}.reg as r; r.REG.update(o.OPS); held = r.REG['act']",
      "held(1) == 101 or (held(1) == 2 and reported('<lambda>'))", packages=["ops"]),
    S("functools.partial of an edited function, arguments changed",
      {"a": PARTIAL, "reg": "OPS = []\n"}, {"a": PARTIAL.replace("x * k", "x * k + 1").replace("k=2", "k=3")},
      "import {p}.a as a, {p}.reg as r; r.OPS.append(a.double); held = r.OPS[0]",
      "held(1) == 4", packages=["a"]),
    S("decorator's wrapper body edited, a wrapper held elsewhere: patched or reported stale",
      {"deco": DECO, "reg": "OPS = []\n",
       "a": "from .deco import twice\nfrom . import reg\nreg.OPS.append(twice(lambda x: x))\n"},
      {"deco": DECO.replace("2 * fn(*a)", "3 * fn(*a)")},
      "import {p}.a, {p}.reg as r; held = r.OPS[0]",
      "held(1) == 3 or (held(1) == 2 and reported('wrapper'))", packages=["a", "deco"]),
    S("function that became a class: reported stale",
      {"a": "def Norm(x):\n    return x\n", "reg": "from .a import Norm\nOPS = [Norm]\n"},
      {"a": "class Norm:\n    def __init__(self, x):\n        self.x = x\n"},
      "import {p}.a as m, {p}.reg as reg; ops = reg.OPS",
      "isinstance(m.Norm, type) and ops[0](1) == 1 and reported('Norm')"),
]


# -- tools -----------------------------------------------------------------------------------------
class Tool:
    name = ""
    supports: set[str] = set()

    def prepare(self, pkg: str, scenario: Scenario) -> None: ...
    def reload(self, pkg: str, scenario: Scenario, changed: list[str]) -> None: ...
    def reported(self, name: str) -> bool:
        return False


class Tsdev(Tool):
    name = "tsdev"
    supports = {"transaction", "packages", "forced", "triton"}

    def prepare(self, pkg, scenario):
        from tsdev.hotreload import Reloader
        packages = [f"{pkg}.{p}" for p in scenario.packages] if scenario.packages else [pkg]
        self.reloader = Reloader(packages)

    def reload(self, pkg, scenario, changed):
        tx = self.reloader.reload(modules=[f"{pkg}.{m}" for m in scenario.forced or []])
        self.report = tx.report
        if "transaction" in scenario.needs and tx.report.ok:
            tx.rollback("injected failure")
        elif tx.report.ok:
            tx.commit()

    def reported(self, name):
        return any(name in s["name"] for s in self.report.stale) or any(name in m for m in self.report.needs_restart)


class IPythonAutoreload(Tool):
    """`%autoreload 2`: ModuleReloader.check() superreloads every module whose mtime changed."""
    name = "IPython autoreload"
    supports = {"forced", "triton"}

    def prepare(self, pkg, scenario):
        from IPython.extensions.autoreload import ModuleReloader
        self.reloader = ModuleReloader()
        self.reloader.enabled, self.reloader.check_all = True, True

    def reload(self, pkg, scenario, changed):
        from IPython.extensions.autoreload import superreload
        with contextlib.redirect_stderr(io.StringIO()):  # it prints failed reloads there
            self.reloader.check()
            for m in scenario.forced or []:
                superreload(sys.modules[f"{pkg}.{m}"], importlib.reload, self.reloader.old_objects)


class Jurigged(Tool):
    """jurigged's live patching: each changed file is diffed and its definitions patched."""
    name = "jurigged"
    supports = {"triton"}

    def prepare(self, pkg, scenario):
        from jurigged.register import Registry
        self.registry = Registry()
        self.registry.set_logger(lambda *a, **k: None)
        for name in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
            self.registry.prepare(name)

    def reload(self, pkg, scenario, changed):
        for path in changed:
            codefile = self.registry.get(path)
            if codefile is not None:
                codefile.refresh()


# -- runner ----------------------------------------------------------------------------------------
_ids = itertools.count()


def run(tool: Tool, scenario: Scenario, root: str) -> str:
    """One cell of the table: ✓, ✗ with why, or n/a."""
    if scenario.needs - {"triton"} - tool.supports:
        return "n/a"
    pkg = f"cmp{next(_ids)}"
    write(root, pkg, {"__init__": "", **scenario.files})
    ns = {"reported": tool.reported}
    try:
        exec(scenario.setup.format(p=pkg), ns)
        tool.prepare(pkg, scenario)
        changed = write(root, pkg, scenario.edits, bump=True)
        try:
            tool.reload(pkg, scenario, changed)
        except Exception as e:
            ns["_reload_error"] = e
        ok = eval(scenario.check, ns)
        return "✓" if ok else "✗ " + (f"reload raised {type(ns['_reload_error']).__name__}"
                                      if "_reload_error" in ns else "wrong result")
    except Exception as e:
        return f"✗ {type(e).__name__}"
    finally:
        for m in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
            del sys.modules[m]


def write(root: str, pkg: str, files: dict[str, str], bump: bool = False) -> list[str]:
    paths = []
    for rel, src in files.items():
        path = os.path.join(root, pkg, rel + ".py")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(src.format(p=pkg) if "{p}" in src else src)
        if bump:  # mtime-based tools must see the change even within one clock tick
            st = os.stat(path)
            os.utime(path, (st.st_atime + 2, st.st_mtime + 2))
        paths.append(path)
    importlib.invalidate_caches()
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown table here (e.g. docs/reload-comparison.md)")
    args = parser.parse_args()
    tools: list[Tool] = [Tsdev()]
    versions = {}
    for cls, module in ((IPythonAutoreload, "IPython"), (Jurigged, "jurigged")):
        try:
            versions[cls.name] = importlib.import_module(module).__version__
            tools.append(cls())
        except ImportError:
            print(f"{module} is not installed: pip install {module.lower()}", file=sys.stderr)
    try:
        import triton
        versions["triton"] = triton.__version__
    except ImportError:
        triton = None
    root = tempfile.mkdtemp(prefix="tsdev_compare_")
    sys.path.insert(0, root)
    rows = []
    for scenario in SCENARIOS:
        if "triton" in scenario.needs and triton is None:
            rows.append([scenario.name] + ["skipped (no triton)"] * len(tools))
            continue
        rows.append([scenario.name] + [run(tool, scenario, root) for tool in tools])
        print(" | ".join(rows[-1]), flush=True)
    table = render(rows, tools, versions)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    print(table)


def render(rows, tools, versions) -> str:
    passed = {t.name: sum(r[i + 1] == "✓" for r in rows) for i, t in enumerate(tools)}
    applicable = {t.name: sum(r[i + 1] != "n/a" for r in rows) for i, t in enumerate(tools)}
    lines = [
        "# Hot reload: tsdev vs IPython autoreload vs jurigged",
        "",
        f"Generated {datetime.date.today()} on {platform.python_implementation()} {platform.python_version()}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + ", Triton kernels under `TRITON_INTERPRET=1`, by",
        "",
        "    python3 benchmarks/hotreload_compare.py --out docs/reload-comparison.md",
        "",
        "Each scenario imports a small package, takes references the way a server holds them",
        "(`from x import f` copies, registries, bound methods, live instances, kernel objects),",
        "edits the files, reloads with the tool, and checks behaviour through the old references.",
        "n/a: the tool has no such notion (transactions, reloadable packages, forced modules).",
        "IPython runs as `%autoreload 2` (every module whose mtime changed is superreloaded);",
        "jurigged diffs and patches each changed file, as its watcher does.",
        "",
        "| scenario | " + " | ".join(t.name for t in tools) + " |",
        "|---|" + "---|" * len(tools),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["| **passed** | " + " | ".join(f"**{passed[t.name]}/{applicable[t.name]}**" for t in tools) + " |", ""]
    lines += [
        "## What tsdev does not support",
        "",
        "* Instance layout changes are not migrated: a dataclass/`__slots__`/namedtuple whose fields change,",
        "  a changed metaclass, or a base-class change Python refuses (`__bases__` layout error) is reported",
        "  as `stale` (with who still holds the old class); live instances keep the old class, new code gets the",
        "  new one. Likewise a definition whose kind changed (function -> class).",
        "* Values computed at import time *outside* the re-executed modules (e.g. a table another, non-reloadable",
        "  module built from a reloaded constant) keep their old values; module-level containers in the",
        "  reloaded modules are rebuilt. Instances created by non-reloaded code are never re-created.",
        "* Live objects that keep running old code though nothing names them are reported in `stale`, with",
        "  who holds them, not fixed: instances of a class whose `__init__` changed (their attributes were set",
        "  by the old code; the entry names the attributes the new `__init__` adds), and lambdas or nested",
        "  functions (a decorator's wrapper, a factory's closure) whose code changed and that something outside",
        "  the re-executed modules still holds. The reload stays ok: the server's warm-up runs the new code.",
        "  Objects held only by a running function's locals are invisible to the scan (frames are not tracked",
        "  objects); a quiescent server holds its model in objects, so they are found.",
        "* Enum member *values* changing, or members of a `Flag` changing, is reported stale (added/removed",
        "  members of a plain `Enum` are applied in place).",
        "* A removed function/class is not reported; references to it keep the old code.",
        "* Triton: kernels defined inside functions (factories) are not tracked; `lru_cache` contents",
        "  dropped by a reload stay dropped after a rollback (they are recomputed).",
        "* Changes outside the reloadable packages are reported as `needs_restart`, never executed.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
