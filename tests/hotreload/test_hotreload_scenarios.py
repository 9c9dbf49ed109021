"""The edit scenarios of issue 3: each edits a throwaway package and checks, through
references taken *before* the reload, that the new code runs (or that the report says why not)."""
import inspect
import json

import pytest


def test_function_body(pkg):
    pkg.write("a", "def f():\n    return 1\n")
    f = pkg.mod("a").f
    r = pkg.reloader()
    pkg.edit("a", "def f():\n    return 2\n")
    report = pkg.reload(r)
    assert f() == 2 and pkg.mod("a").f is f
    assert report.reloaded == pkg.full("a") and report.patched >= 1


COUNTER = """
class Counter:
    def __init__(self):
        self.n = 5
    def bump(self):
        self.n += 1
        return self.n
"""


def test_method_body_with_live_instances(pkg):
    pkg.write("a", COUNTER)
    Counter = pkg.mod("a").Counter
    c = Counter()
    r = pkg.reloader()
    pkg.edit("a", COUNTER.replace("self.n += 1", "self.n += 10"))
    pkg.reload(r)
    assert c.bump() == 15  # state kept, new code
    assert isinstance(c, pkg.mod("a").Counter) and pkg.mod("a").Counter is Counter


def test_from_import_copies_and_registry(pkg):
    pkg.write("a", "def f():\n    return 'old'\n")
    pkg.write("b", "from .a import f\nREGISTRY = {'f': f}\n")
    f_copy = pkg.mod("b").f
    registry = pkg.mod("b").REGISTRY
    r = pkg.reloader()
    pkg.edit("a", "def f():\n    return 'new'\n")
    report = pkg.reload(r)
    assert report.dependents == pkg.full("b")
    assert f_copy() == "new" and registry["f"]() == "new"
    assert pkg.mod("b").REGISTRY["f"] is f_copy  # the rebuilt registry holds the live object


def test_bound_method_stored_before_reload(pkg):
    src = "class Layer:\n    def forward(self, x):\n        return x + 1\nlayer = Layer()\nHOOK = layer.forward\n"
    pkg.write("a", src)
    hook = pkg.mod("a").HOOK
    r = pkg.reloader()
    pkg.edit("a", src.replace("x + 1", "x * 100"))
    pkg.reload(r)
    assert hook(2) == 200


MAKE_SCALE = """
def make(k, bias=0):
    def scale(x):
        return x * k
    return scale
scale = make(2)
"""


def test_closure_value_changed(pkg):
    pkg.write("a", MAKE_SCALE)
    scale = pkg.mod("a").scale
    r = pkg.reloader()
    pkg.edit("a", MAKE_SCALE.replace("make(2)", "make(3)"))
    pkg.reload(r)
    assert scale(2) == 6


def test_closure_shape_changed_is_redirected(pkg):
    pkg.write("a", MAKE_SCALE)
    scale = pkg.mod("a").scale
    r = pkg.reloader()
    pkg.edit("a", MAKE_SCALE.replace("make(2)", "make(2, bias=1)").replace("x * k", "x * k + bias"))
    report = pkg.reload(r)
    assert scale(2) == 5 and not report.stale
    assert list(inspect.signature(scale).parameters) == ["x"]  # redirect keeps a useful signature


BASE_CHILD = """
class Base:
    def f(self):
        return "base"
class Child(Base):
    def f(self):
        return "child"
    def extra(self):
        return 1
"""


def test_super_added(pkg):
    pkg.write("a", BASE_CHILD)
    child = pkg.mod("a").Child()
    f = child.f
    r = pkg.reloader()
    pkg.edit("a", BASE_CHILD.replace('return "child"', 'return super().f() + "+child"'))
    pkg.reload(r)
    assert child.f() == "base+child" and f() == "base+child"


TWICE = """
import functools
def twice(fn):
    @functools.wraps(fn)
    def wrapper(*a):
        return 2 * fn(*a)
    return wrapper
"""


def test_decorator_added(pkg):
    pkg.write("deco", TWICE)
    pkg.write("a", "from .deco import twice\ndef f(x):\n    return x\n")
    f = pkg.mod("a").f
    r = pkg.reloader()
    pkg.edit("a", "from .deco import twice\n@twice\ndef f(x):\n    return x + 1\n")
    pkg.reload(r)
    assert f(1) == 4


def test_decorator_removed(pkg):
    pkg.write("deco", TWICE)
    pkg.write("a", "from .deco import twice\n@twice\ndef f(x):\n    return x\n")
    f = pkg.mod("a").f
    assert f(3) == 6
    r = pkg.reloader()
    pkg.edit("a", "def f(x):\n    return x - 1\n")
    pkg.reload(r)
    assert f(3) == 2


def test_decorator_changed(pkg):
    pkg.write("deco", """
        import functools
        def times(k):
            def deco(fn):
                @functools.wraps(fn)
                def wrapper(*a):
                    return k * fn(*a)
                return wrapper
            return deco
        def plus(k):
            def deco(fn):
                def wrapper(*a):
                    return k + fn(*a)
                return wrapper
            return deco
    """)
    pkg.write("a", "from .deco import times, plus\n@times(2)\ndef f(x):\n    return x\n"
                   "@times(2)\ndef g(x):\n    return x\n")
    f, g = pkg.mod("a").f, pkg.mod("a").g
    r = pkg.reloader()
    pkg.edit("a", "from .deco import times, plus\n@times(5)\ndef f(x):\n    return x\n"
                  "@plus(5)\ndef g(x):\n    return x\n")
    pkg.reload(r)
    assert f(1) == 5  # same decorator, new argument: patched in place
    assert g(1) == 6  # another decorator: redirected


def test_method_added(pkg):
    pkg.write("a", "class A:\n    def f(self):\n        return 1\n")
    a = pkg.mod("a").A()
    r = pkg.reloader()
    pkg.edit("a", "class A:\n    def f(self):\n        return self.g()\n    def g(self):\n        return 7\n")
    pkg.reload(r)
    assert a.g() == 7 and a.f() == 7


def test_method_deleted_falls_back_to_base(pkg):
    pkg.write("a", BASE_CHILD)
    c = pkg.mod("a").Child()
    r = pkg.reloader()
    pkg.edit("a", BASE_CHILD.split("    def f(self):\n        return \"child\"")[0] + "    pass\n")
    pkg.reload(r)
    assert c.f() == "base" and not hasattr(c, "extra")


def test_property_body(pkg):
    pkg.write("a", "class A:\n    @property\n    def v(self):\n        return 1\n")
    a = pkg.mod("a").A()
    getter = type(a).v.fget
    r = pkg.reloader()
    pkg.edit("a", "class A:\n    @property\n    def v(self):\n        return 2\n"
                  "    @v.setter\n    def v(self, x):\n        self.x = x\n")
    pkg.reload(r)
    assert a.v == 2 and getter(a) == 2
    a.v = 9
    assert a.x == 9


def test_classmethod_and_staticmethod(pkg):
    src = """
        class A:
            @classmethod
            def make(cls):
                return (cls.__name__, 1)
            @staticmethod
            def size():
                return 1
    """
    pkg.write("a", src)
    A = pkg.mod("a").A
    make, size = A.make, A.size
    r = pkg.reloader()
    pkg.edit("a", src.replace("1", "2"))
    pkg.reload(r)
    assert make() == ("A", 2) and size() == 2 and A.make() == ("A", 2) and A.size() == 2


def test_base_class_changed(pkg):
    src = """
        class Relu:
            def act(self, x):
                return max(x, 0)
        class Identity:
            def act(self, x):
                return x
        class Layer(Relu):
            pass
    """
    pkg.write("a", src)
    m = pkg.mod("a")
    layer = m.Layer()
    assert layer.act(-1) == 0
    r = pkg.reloader()
    pkg.edit("a", src.replace("class Layer(Relu)", "class Layer(Identity)"))
    pkg.reload(r)
    assert layer.act(-1) == -1 and isinstance(layer, m.Identity) and not isinstance(layer, m.Relu)


def test_constant_used_by_dependent_via_from_import(pkg):
    pkg.write("a", "SIZE = 4\n")
    pkg.write("b", "from .a import SIZE\ndef size():\n    return SIZE\n")
    size = pkg.mod("b").size
    r = pkg.reloader()
    pkg.edit("a", "SIZE = 8\n")
    report = pkg.reload(r)
    assert size() == 8 and report.dependents == pkg.full("b")


def test_a_reloader_that_compiles_later_plans_and_reloads_as_one_that_compiled_at_once(pkg):
    """A server's Reloader compiles the modules' graph on a thread once the server listens; the sources it records
    are those that ran (read at once), and a method called meanwhile waits for the thread."""
    import threading

    from tsdev.hotreload import Reloader

    pkg.write("a", "SIZE = 4\n")
    pkg.write("b", "from .a import SIZE\ndef size():\n    return SIZE\n")
    size = pkg.mod("b").size
    r = Reloader([pkg.name], compile_later=True)
    r.compile_in_background()
    pkg.edit("a", "SIZE = 8\n")  # saved while the thread may still compile what ran
    plan = r.plan()
    assert not [t for t in threading.enumerate() if t.name == "reloader-compile"]
    assert plan.reloaded == pkg.full("a") and plan.dependents == pkg.full("b")
    report = pkg.reload(r)
    assert size() == 8 and report.dependents == pkg.full("b")


def test_new_name_imported_by_another_module(pkg):
    pkg.write("a", "def f():\n    return 1\n")
    pkg.write("b", "from .a import f\ndef g():\n    return f()\n")
    g = pkg.mod("b").g
    r = pkg.reloader()
    pkg.edit("a", "def f():\n    return 1\ndef h():\n    return 41\n")
    pkg.edit("b", "from .a import f, h\ndef g():\n    return f() + h()\n")
    report = pkg.reload(r)
    assert g() == 42 and report.reloaded == pkg.full("a", "b")


def test_dependents_run_in_provider_order(pkg):
    pkg.write("log", "ORDER = []\n")
    pkg.write("c", "from . import log\nfrom .b import B\nlog.ORDER.append('c')\n")
    pkg.write("b", "from . import log\nfrom .a import A\nB = A + 1\nlog.ORDER.append('b')\n")
    pkg.write("a", "from . import log\nA = 1\nlog.ORDER.append('a')\n")
    pkg.write("d", "from . import log\nfrom .c import *\nlog.ORDER.append('d')\n")
    pkg.mod("d")
    log = pkg.mod("log")
    r = pkg.reloader()
    plan = r.plan()
    assert plan.order == [] and plan.needs_restart == []
    pkg.edit("a", "from . import log\nA = 10\nlog.ORDER.append('a')\n")
    plan = r.plan()
    assert plan.reloaded == pkg.full("a") and plan.dependents == pkg.full("b", "c", "d")
    log.ORDER.clear()
    report = pkg.reload(r)
    assert log.ORDER == ["a", "b", "c", "d"] and pkg.mod("b").B == 11
    assert report.dependents == pkg.full("b", "c", "d")


def test_import_cycle(pkg):
    pkg.write("a", "from . import b\ndef fa():\n    return 'a1' + b.fb()\n")
    pkg.write("b", "from . import a\ndef fb():\n    return 'b1'\ndef call_a():\n    return a.fa()\n")
    fa, call_a = pkg.mod("a").fa, pkg.mod("b").call_a
    r = pkg.reloader()
    pkg.edit("a", "from . import b\ndef fa():\n    return 'a2' + b.fb()\n")
    pkg.edit("b", "from . import a\ndef fb():\n    return 'b2'\ndef call_a():\n    return a.fa()\n")
    report = pkg.reload(r)
    assert sorted(report.reloaded) == pkg.full("a", "b")
    assert fa() == "a2b2" and call_a() == "a2b2"


def test_syntax_error_changes_nothing(pkg):
    pkg.write("a", "X = 1\ndef f():\n    return 1\n")
    pkg.write("b", "def g():\n    return 1\n")
    m = pkg.mod("a")
    f, g = m.f, pkg.mod("b").g
    r = pkg.reloader()
    pkg.edit("b", "def g():\n    return 2\n")
    pkg.edit("a", "X = 2\ndef f():\n    return 2\ndef broken(:\n    pass\n")
    tx = r.reload()
    assert not tx.report.ok and tx.state == "rolled back"
    assert tx.report.error.startswith(f"{pkg.path('a')}:4: SyntaxError")
    assert f() == 1 and g() == 1 and m.X == 1
    pkg.edit("a", "X = 2\ndef f():\n    return 2\n")  # fixed: the next reload applies both edits
    pkg.reload(r)
    assert f() == 2 and g() == 2


def test_exception_in_second_of_three_modules_reverts_all(pkg):
    pkg.write("a", "def fa():\n    return 'a1'\n")
    pkg.write("b", "from .a import fa\ndef fb():\n    return 'b1'\n")
    pkg.write("c", "from .b import fb\nclass C:\n    def f(self):\n        return 'c1'\n")
    fa, fb, c = pkg.mod("a").fa, pkg.mod("b").fb, pkg.mod("c").C()
    C = type(c)
    r = pkg.reloader()
    pkg.edit("a", "def fa():\n    return 'a2'\n")
    pkg.edit("b", "from .a import fa\ndef fb():\n    return 'b2'\nraise RuntimeError('boom')\n")
    pkg.edit("c", "from .b import fb\nclass C:\n    def f(self):\n        return 'c2'\n")
    tx = r.reload()
    assert not tx.report.ok
    assert tx.report.error == f"{pkg.path('b')}:4: RuntimeError: boom"
    assert (fa(), fb(), c.f()) == ("a1", "b1", "c1")
    assert pkg.mod("a").fa is fa and pkg.mod("c").C is C
    assert "fb" in vars(pkg.mod("b")) and pkg.mod("b").fb is fb


def test_failure_after_patching_rolls_back(pkg):
    pkg.write("a", """
        LIMIT = 1
        class Layer:
            def forward(self):
                return 'old'
            def gone(self):
                return 'still here'
        def helper():
            return 'old'
    """)
    m = pkg.mod("a")
    layer, helper, Layer = m.Layer(), m.helper, m.Layer
    r = pkg.reloader()
    pkg.edit("a", """
        LIMIT = 2
        class Layer:
            def forward(self):
                return 'new'
            def added(self):
                return 1
        def helper(x=1):
            return 'new'
    """)
    tx = r.reload()
    assert tx.report.ok and layer.forward() == "new" and helper() == "new" and m.LIMIT == 2
    tx.rollback("warm-up failed: CUDA error")  # what the server does when warm-up/capture fails
    assert not tx.report.ok and tx.report.error == "warm-up failed: CUDA error"
    assert layer.forward() == "old" and layer.gone() == "still here" and not hasattr(layer, "added")
    assert helper() == "old" and m.LIMIT == 1 and m.Layer is Layer and m.helper is helper
    assert r.plan().reloaded == pkg.full("a")  # still pending: the edit is not the baseline


def test_lru_cache_function(pkg):
    pkg.write("a", "import functools\n@functools.lru_cache\ndef table(n):\n    return n * 1\n")
    table = pkg.mod("a").table
    assert table(3) == 3
    r = pkg.reloader()
    pkg.edit("a", "import functools\n@functools.lru_cache\ndef table(n):\n    return n * 2\n")
    pkg.reload(r)
    assert table(3) == 6 and pkg.mod("a").table is table


def test_dataclass_field_added_is_stale(pkg):
    pkg.write("a", "import dataclasses\n@dataclasses.dataclass\nclass Cfg:\n    a: int = 1\n")
    pkg.write("b", "from .a import Cfg\nDEFAULTS = {'cfg': Cfg}\n")
    Cfg = pkg.mod("a").Cfg
    cfg = Cfg()
    r = pkg.reloader()
    pkg.edit("a", "import dataclasses\n@dataclasses.dataclass\nclass Cfg:\n    a: int = 1\n    b: int = 2\n")
    report = pkg.reload(r)
    [stale] = report.stale
    assert stale["name"] == f"{pkg.name}.a.Cfg" and "dataclass fields changed" in stale["reason"]
    assert stale["where"] == f"{pkg.path('a')}:2"  # where the definition starts: its first decorator
    assert not hasattr(cfg, "b") and "b" not in {f for f in Cfg.__dataclass_fields__}  # old class untouched
    assert pkg.mod("a").Cfg().b == 2  # new code gets the new class


def test_enum_member_added(pkg):
    pkg.write("a", "import enum\nclass Mode(enum.Enum):\n    PREFILL = 1\n    DECODE = 2\n")
    Mode = pkg.mod("a").Mode
    decode = Mode.DECODE
    r = pkg.reloader()
    pkg.edit("a", "import enum\nclass Mode(enum.Enum):\n    PREFILL = 1\n    DECODE = 2\n    MIXED = 3\n"
                  "    def short(self):\n        return self.name[0]\n")
    report = pkg.reload(r)
    assert not report.stale and pkg.mod("a").Mode is Mode
    assert Mode.MIXED.value == 3 and Mode(3) is Mode.MIXED and list(Mode)[-1] is Mode.MIXED
    assert Mode.DECODE is decode and Mode["MIXED"].short() == "M" and isinstance(Mode.MIXED, Mode)


def test_module_outside_packages_needs_restart(pkg):
    pkg.write("layers", "def f():\n    return 1\n")
    pkg.write("engine", "def run():\n    return 1\n")
    run = pkg.mod("engine").run
    pkg.mod("layers")
    r = pkg.reloader("layers")
    pkg.edit("engine", "def run():\n    return 2\n")
    pkg.edit("layers", "def f():\n    return 2\n")
    plan = r.plan()
    assert plan.needs_restart == pkg.full("engine") and plan.reloaded == pkg.full("layers")
    report = pkg.reload(r)
    assert report.needs_restart == pkg.full("engine") and report.reloaded == pkg.full("layers")
    assert run() == 1 and pkg.mod("layers").f() == 2
    assert r.plan().needs_restart == pkg.full("engine")  # until the process restarts


def test_forced_module_list(pkg):
    pkg.write("a", "CACHE = {}\ndef get(k):\n    return CACHE.setdefault(k, object())\n")
    pkg.write("b", "from .a import get\n")
    m = pkg.mod("a")
    pkg.mod("b")
    m.get("x")
    r = pkg.reloader()
    noop = r.reload()
    assert noop.report.reloaded == []  # nothing changed: nothing runs
    noop.commit()
    report = pkg.reload(r, modules=pkg.full("a"))
    assert report.reloaded == pkg.full("a") and report.dependents == pkg.full("b")
    assert m.CACHE == {}  # module-level caches start empty
    tx = r.reload(modules=[f"{pkg.name}.nope"])
    assert not tx.report.ok and tx.report.error.startswith(f"cannot reload {pkg.name}.nope")


def test_function_became_class_is_stale(pkg):
    pkg.write("a", "def Norm(x):\n    return x\n")
    pkg.write("reg", "from .a import Norm\nOPS = [Norm]\n")
    Norm = pkg.mod("a").Norm
    ops = pkg.mod("reg").OPS
    r = pkg.reloader("a")
    pkg.edit("a", "class Norm:\n    def __init__(self, x):\n        self.x = x\n")
    report = pkg.reload(r)
    [stale] = report.stale
    assert stale["reason"] == "function became class"
    assert stale["where"] == f"{pkg.path('a')}:1"
    assert f"{pkg.name}.reg.Norm" in stale["referrers"] and "a list" in stale["referrers"]
    assert Norm(3) == 3 and ops[0] is Norm and isinstance(pkg.mod("a").Norm, type)


def test_module_level_instances_keep_isinstance(pkg):
    pkg.write("a", """
        class Config:
            def size(self):
                return 1
        DEFAULT = Config()
        BY_NAME = {'config': Config}
    """)
    Config = pkg.mod("a").Config
    r = pkg.reloader()
    pkg.edit("a", """
        class Config:
            def size(self):
                return 2
        DEFAULT = Config()
        BY_NAME = {'config': Config}
    """)
    pkg.reload(r)
    m = pkg.mod("a")
    assert isinstance(m.DEFAULT, Config) and m.BY_NAME["config"] is Config and m.DEFAULT.size() == 2


def test_defaults_and_annotations(pkg):
    pkg.write("a", "def f(x, k=1, *, scale=1) -> int:\n    return x * k * scale\n")
    f = pkg.mod("a").f
    r = pkg.reloader()
    pkg.edit("a", "def f(x, k=2, *, scale=10) -> float:\n    return x * k * scale\n")
    pkg.reload(r)
    assert f(1) == 20 and f.__annotations__["return"] is float


def test_defaults_that_are_module_classes_name_the_live_class(pkg):
    src = "class C:\n    pass\n\ndef f(d=C, *, k=C):\n    return d is C, k is C\n"
    pkg.write("a", src)
    f = pkg.mod("a").f
    r = pkg.reloader()
    pkg.edit("a", src.replace("pass", "X = 1"))
    pkg.reload(r)
    assert f() == (True, True)  # positional and keyword-only defaults alike


def test_error_in_dependent_names_its_line(pkg):
    pkg.write("a", "def f():\n    return 1\n")
    pkg.write("b", "from .a import f\n")
    f = pkg.mod("a").f
    pkg.mod("b")
    r = pkg.reloader()
    pkg.edit("a", "def renamed():\n    return 2\n")
    tx = r.reload()
    assert not tx.report.ok and tx.report.error.startswith(f"{pkg.path('b')}:1: ImportError")
    assert f() == 1 and pkg.mod("a").f is f


def test_sources_snapshot_is_what_runs(pkg):
    """Multi-rank: rank 0 reads once, every rank runs those bytes (not its own disk)."""
    pkg.write("a", "def f():\n    return 1\n")
    f = pkg.mod("a").f
    r = pkg.reloader()
    sources = r.read_sources()
    assert sources == {pkg.name: b"", f"{pkg.name}.a": b"def f():\n    return 1\n"}
    sources[f"{pkg.name}.a"] = b"def f():\n    return 3\n"
    report = pkg.reload(r, sources=sources)
    assert f() == 3 and report.reloaded == pkg.full("a")
    assert inspect.getsource(f) == "def f():\n    return 3\n"  # tracebacks and Triton see the running code
    assert r.plan().reloaded == pkg.full("a")  # the disk still differs from what runs


def test_report_is_json_and_timed(pkg):
    pkg.write("a", "def f():\n    return 1\n")
    pkg.mod("a")
    r = pkg.reloader()
    pkg.edit("a", "def f():\n    return 2\n")
    tx = r.reload()
    data = json.loads(json.dumps(tx.report.to_dict()))
    assert set(data) == {"ok", "reloaded", "dependents", "patched", "stale", "needs_restart", "jit_kernels", "kernels",
                         "kernels_only", "graph_swaps", "compiled_in_pause", "timings", "error"}
    assert {"read", "plan", "compile", "execute", "patch", "kernels", "total"} <= set(data["timings"])
    assert 0 < data["timings"]["total"] < 5 and data["ok"] and data["patched"] == 1
    assert tx.report.summary().startswith(f"reloaded {pkg.full('a')[0]} and 0 dependent module(s), "
                                          "1 object(s) patched in ")
    with pytest.raises(RuntimeError, match="pending"):  # a second reload while one is pending is refused
        r.reload()
    tx.commit()
    assert r.reload().report.reloaded == []  # committed source is the new baseline


def test_new_submodule_imported_by_edit(pkg):
    pkg.write("a", "def f():\n    return 1\n")
    f = pkg.mod("a").f
    r = pkg.reloader()
    pkg.write("extra", "VALUE = 5\n")
    pkg.edit("a", "from .extra import VALUE\ndef f():\n    return VALUE\n")
    tx = r.reload()
    assert tx.report.ok and f() == 5
    tx.rollback()
    import sys
    assert f"{pkg.name}.extra" not in sys.modules and f() == 1
    pkg.reload(r)
    assert f() == 5 and f"{pkg.name}.extra" in r.read_sources()  # tracked once committed


def test_default_packages_from_pyproject(tmp_path):
    from tsdev.hotreload import DEFAULT_PACKAGES, default_packages
    (tmp_path / "pyproject.toml").write_text('[tool.tsdev]\nreload-packages = ["mylib.ops"]\n')
    (tmp_path / "sub").mkdir()
    assert default_packages(tmp_path / "sub") == ["mylib.ops"]
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert default_packages(tmp_path) == list(DEFAULT_PACKAGES)


def test_nn_module_forward_edit_keeps_weights(pkg):
    torch = pytest.importorskip("torch")
    pkg.write("layers", """
        import torch
        class Scale(torch.nn.Module):
            def __init__(self, n):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.full((n,), 2.0))
            def forward(self, x):
                return x * self.weight
    """)
    pkg.write("model", """
        import torch
        from .layers import Scale
        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = torch.nn.ModuleList([Scale(3), Scale(3)])
            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x
    """)
    model = pkg.mod("model").Model()
    weight = model.blocks[0].weight
    x = torch.ones(3)
    assert model(x).tolist() == [4.0, 4.0, 4.0]
    r = pkg.reloader()
    pkg.edit("layers", """
        import torch
        class Scale(torch.nn.Module):
            def __init__(self, n):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.full((n,), 2.0))
            def forward(self, x):
                return x * self.weight + 1
    """)
    report = pkg.reload(r)
    assert report.dependents == pkg.full("model")
    assert model(x).tolist() == [7.0, 7.0, 7.0] and model.blocks[0].weight is weight
    assert isinstance(model.blocks[1], pkg.mod("model").Scale)


# -- issue 16 point 5: what keeps running old code is reported in `stale`, with who holds it ------------
NORM = """
class Norm:
    def __init__(self, dim):
        self.dim = dim
    def forward(self, x):
        return x * self.dim
"""
NORM_EPS = NORM.replace("self.dim = dim", "self.dim = dim\n        self.eps = 0.5").replace(
    "x * self.dim", "x * self.dim + self.eps")


def test_init_changed_live_instances_are_stale(pkg):
    pkg.write("a", NORM)
    pkg.write("model", "from .a import Norm\nclass Model:\n    def __init__(self):\n        self.norm = Norm(2)\n"
                       "class Sub(Norm):\n    pass\n")
    pkg.write("engine", "MODEL = None\n")  # not re-executed: holds what the server built
    engine = pkg.mod("engine")
    engine.MODEL = pkg.mod("model").Model()
    sub = pkg.mod("model").Sub(3)  # inherits the edited __init__
    r = pkg.reloader()
    pkg.edit("a", NORM_EPS)
    report = pkg.reload(r)
    assert report.ok  # the library reports; the server's warm-up (or issue 16.4's rebuild) acts on it
    [stale] = report.stale
    assert stale["name"] == f"{pkg.name}.a.Norm" and stale["where"] == f"{pkg.path('a')}:1"
    assert stale["reason"] == (f"2 live instance(s) of {pkg.name}.a.Norm keep attributes set by the old __init__;"
                               " the new __init__ also sets eps")
    assert stale["referrers"] == [f"{pkg.name}.engine.MODEL.norm"]
    with pytest.raises(AttributeError, match="eps"):  # what the report warns about: the new forward needs eps
        engine.MODEL.norm.forward(1)
    with pytest.raises(AttributeError, match="eps"):
        sub.forward(1)
    assert pkg.mod("a").Norm(2).forward(1) == 2.5  # instances built now are right


def test_init_unchanged_no_scan_no_stale(pkg):
    pkg.write("a", NORM)
    norm = pkg.mod("a").Norm(2)
    r = pkg.reloader()
    pkg.edit("a", NORM.replace("x * self.dim", "x * self.dim + 1"))
    report = pkg.reload(r)
    assert not report.stale and norm.forward(1) == 3
    assert "stale" in report.timings and report.timings["stale"] < 0.001  # no heap scan on the common path


def test_a_default_that_is_a_class_of_the_rerun_module_is_no_init_change_and_costs_no_heap_scan(pkg, monkeypatch):
    """A causal LM's `decoder_layer=LlamaDecoderLayer`: re-running llama.py for an unrelated edit makes a new class
    object for the default; it is the same default (the new class merges into the old), so no heap scan."""
    import gc

    source = ("class Layer:\n    pass\n\n\nclass Model:\n    def __init__(self, layer=Layer, *, extra=Layer):\n"
              "        self.layer = layer()\n\n\ndef act(x):\n    return x + 1\n")
    pkg.write("a", source)
    model = pkg.mod("a").Model()
    r = pkg.reloader()
    scans, heap_scan = [], gc.get_referrers
    monkeypatch.setattr(gc, "get_referrers", lambda *objects: scans.append(objects) or heap_scan(*objects))
    pkg.edit("a", source.replace("x + 1", "x + 2"))
    report = pkg.reload(r)
    assert report.ok and not report.stale and not scans
    assert pkg.mod("a").act(1) == 3 and isinstance(model.layer, pkg.mod("a").Layer)


def test_init_changed_instances_only_in_the_old_namespace_are_not_stale(pkg):
    pkg.write("a", NORM + "NORM = Norm(2)\n")
    pkg.mod("a")
    r = pkg.reloader()
    pkg.edit("a", NORM_EPS + "NORM = Norm(2)\n")
    report = pkg.reload(r)
    assert not report.stale  # the module-level instance was rebuilt by the new code
    assert pkg.mod("a").NORM.forward(1) == 2.5 and isinstance(pkg.mod("a").NORM, pkg.mod("a").Norm)


LAMBDAS = "OPS = {'act': lambda x: x + 1, 'same': lambda x: x}\n"


def test_lambda_held_in_a_registry_is_stale(pkg):
    pkg.write("ops", LAMBDAS)
    pkg.write("reg", "REGISTRY = {}\n")  # not re-executed: another module's registry
    ops, reg = pkg.mod("ops"), pkg.mod("reg")
    reg.REGISTRY.update(ops.OPS)
    act = reg.REGISTRY["act"]
    r = pkg.reloader("ops")
    pkg.edit("ops", "\n" + LAMBDAS.replace("x + 1", "x + 100"))  # also moved a line: `same` did not change
    report = pkg.reload(r)
    assert act(1) == 2 and ops.OPS["act"](1) == 101  # the held lambda keeps running the old code...
    [stale] = report.stale  # ... and the report says so; the unchanged lambda is not reported
    assert stale["name"] == f"{pkg.name}.ops.<lambda>" and stale["where"] == f"{pkg.path('ops')}:1"
    assert stale["reason"].startswith("1 live lambda(s) created by the old code")
    assert stale["referrers"] == ["a dict at key 'act'"]


def test_lambda_only_in_the_reexecuted_module_is_not_stale(pkg):
    pkg.write("ops", LAMBDAS)
    pkg.write("user", "from .ops import OPS\ndef run(x):\n    return OPS['act'](x)\n")
    run = pkg.mod("user").run
    r = pkg.reloader()
    pkg.edit("ops", LAMBDAS.replace("x + 1", "x + 100"))
    report = pkg.reload(r)
    assert not report.stale and run(1) == 101  # the dependent re-executed: it holds the new registry


def test_lambda_bound_to_a_name_is_patched(pkg):
    pkg.write("a", "act = lambda x: x + 1\n")
    act = pkg.mod("a").act
    r = pkg.reloader()
    pkg.edit("a", "act = lambda x: x + 100\n")
    report = pkg.reload(r)
    assert act(1) == 101 and not report.stale


PARTIAL = "import functools\ndef scale(x, k):\n    return x * k\ndouble = functools.partial(scale, k=2)\n"


def test_partial_is_patched(pkg):
    pkg.write("a", PARTIAL)
    pkg.write("reg", "OPS = []\n")
    pkg.mod("reg").OPS.append(pkg.mod("a").double)
    held = pkg.mod("reg").OPS[0]
    r = pkg.reloader("a")
    pkg.edit("a", PARTIAL.replace("x * k", "x * k + 1").replace("k=2", "k=3"))
    report = pkg.reload(r)
    assert not report.stale and held(1) == 4  # wrapped function patched, arguments replaced in place
    assert pkg.mod("a").double is held


def test_partial_of_a_lambda_is_stale(pkg):
    pkg.write("a", "import functools\nPLUS = functools.partial(lambda x, k: x + k, k=1)\n")
    pkg.write("reg", "OPS = []\n")
    pkg.mod("reg").OPS.append(pkg.mod("a").PLUS.func)
    held = pkg.mod("reg").OPS[0]
    r = pkg.reloader("a")
    pkg.edit("a", "import functools\nPLUS = functools.partial(lambda x, k: x - k, k=1)\n")
    report = pkg.reload(r)
    assert held(1, 1) == 2  # old code
    [stale] = report.stale
    assert stale["name"] == f"{pkg.name}.a.<lambda>" and "a list" in stale["referrers"]


def test_decorator_wrapper_held_elsewhere_is_patched(pkg):
    pkg.write("deco", TWICE)
    pkg.write("a", "from .deco import twice\n@twice\ndef f(x):\n    return x\n")
    pkg.write("reg", "OPS = []\n")
    pkg.mod("reg").OPS.append(pkg.mod("a").f)
    held = pkg.mod("reg").OPS[0]
    r = pkg.reloader("a", "deco")
    pkg.edit("a", "from .deco import twice\n@twice\ndef f(x):\n    return x + 1\n")
    report = pkg.reload(r)
    assert held(1) == 4 and not report.stale and held.__wrapped__(1) == 2


def test_decorator_body_edit_with_wrapper_held_outside_is_stale(pkg):
    pkg.write("deco", TWICE)
    pkg.write("reg", "OPS = []\n")
    pkg.write("a", "from .deco import twice\nfrom . import reg\nreg.OPS.append(twice(lambda x: x))\n"
                   "@twice\ndef f(x):\n    return x\n")
    f, ops = pkg.mod("a").f, pkg.mod("reg").OPS
    held = ops[0]
    r = pkg.reloader("a", "deco")
    pkg.edit("deco", TWICE.replace("2 * fn(*a)", "3 * fn(*a)"))
    report = pkg.reload(r)
    assert f(1) == 3  # named: patched
    assert held(1) == 2  # the wrapper appended to another module's list before the reload: old code
    [stale] = report.stale
    assert stale["name"] == f"{pkg.name}.deco.twice.<locals>.wrapper" and stale["referrers"] == ["a list"]


def test_bound_method_captured_before_init_change(pkg):
    pkg.write("a", NORM + "HOOKS = []\n")
    norm = pkg.mod("a").Norm(2)
    hook = norm.forward
    r = pkg.reloader()
    pkg.edit("a", NORM.replace("x * self.dim", "x * self.dim * 10") + "HOOKS = []\n")
    report = pkg.reload(r)
    assert hook(1) == 20 and not report.stale  # the method is patched; __init__ unchanged: no stale
