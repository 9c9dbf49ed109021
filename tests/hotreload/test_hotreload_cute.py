"""CuTe DSL kernels (tsdev/hotreload/cute.py). With the package (`pip install tsdev[cute]`) the tests compile real
kernels for sm_90a on the CPU (nothing launches); without it, a stand-in package with the same shape: decorators that
return functions carrying `_dsl_cls` and `__wrapped__`, and `compile` returning a `JitCompiledFunction` that keeps the
code it was compiled from and the DSL's names."""
import functools
import importlib.util
import sys
import types

import pytest

REAL = importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("cutlass.cute") is not None

OPS = '''
import cutlass
import cutlass.cute as cute

_COMPILED = {}  # a module-level cache of compiled kernels


@cute.kernel
def double(a: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    a[tidx] = a[tidx] * 2.0


@cute.jit
def host(a: cute.Tensor):
    double(a).launch(grid=(1, 1, 1), block=(32, 1, 1))


def compiled(a):
    if "k" not in _COMPILED:
        _COMPILED["k"] = cute.compile(host, a)
    return _COMPILED["k"]


class Layer:
    def __init__(self, a):
        self.kernel = cute.compile(host, a)  # compiled once, kept: a reload cannot reach it
'''
ENGINE = '''
from .ops import Layer
from . import ops

LAYER = None


def build(a):
    global LAYER
    LAYER = Layer(a)
'''


def install_stand_in(monkeypatch) -> None:
    """`cutlass`, `cutlass.cute` and `cutlass.base_dsl.jit_executor` as far as these tests use them."""
    executor = types.ModuleType("cutlass.base_dsl.jit_executor")

    class JitCompiledFunction:
        def __init__(self, fn):
            self.function_name = f"cutlass_{fn.__name__}_Tensorgeneric"
            kernel = fn.__wrapped__.__code__.co_names  # the kernels it launches, by name
            self.kernel_info = {f"kernel_cutlass_{name}_tensor_0": None for name in kernel if name == "double"}
            self.ir_module = repr(fn.__wrapped__.__globals__["double"].__wrapped__.__code__.co_consts)

    def decorator(fn):
        fn._dsl_cls = object

        @functools.wraps(fn)  # as the DSL's decorators: the wrapper carries fn's names, __dict__ and __wrapped__
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    cute = types.ModuleType("cutlass.cute")
    cute.kernel = cute.jit = decorator
    cute.Tensor = object
    cute.compile = lambda fn, *args: JitCompiledFunction(fn)
    executor.JitCompiledFunction = JitCompiledFunction
    cutlass = types.ModuleType("cutlass")
    cutlass.cute = cute
    for name, module in {"cutlass": cutlass, "cutlass.cute": cute, "cutlass.base_dsl": types.ModuleType("b"),
                         "cutlass.base_dsl.jit_executor": executor}.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def argument(monkeypatch):
    if not REAL:
        install_stand_in(monkeypatch)
        return None
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # compile for the H200 without a GPU
    import torch
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(torch.zeros(32))


def ir(compiled) -> str:
    return str(compiled.ir_module)


def test_a_cute_kernel_edit_empties_the_module_cache_compiles_the_new_source_and_reports_kept_binaries(pkg, argument):
    pkg.write("ops", OPS)
    pkg.write("engine", ENGINE)  # outside the reloadable package: its Layer lives on
    ops, engine = pkg.mod("ops"), pkg.mod("engine")
    first = ir(ops.compiled(argument))  # (a local holding the kernel would keep it alive: it would count)
    engine.build(argument)
    old_cache = id(ops._COMPILED)  # (held here, the old cache would count as live)
    r = pkg.reloader("ops")
    pkg.edit("ops", OPS.replace("a[tidx] * 2.0", "a[tidx] * 3.0"))
    tx = r.reload()
    assert tx.report.ok, tx.report.error
    assert ops._COMPILED == {} and id(ops._COMPILED) != old_cache  # the module-level cache starts empty
    assert tx.report.kernels == {f"{pkg.name}.ops.double": "cute"}  # the dialect, named
    [stale] = [s for s in tx.report.stale if "CuTe DSL" in s["reason"]]
    # the Layer's kernel only: the one in the old cache goes with it at commit
    assert stale["name"] == f"{pkg.name}.ops.double" and stale["reason"].startswith("1 compiled CuTe DSL kernel")
    assert f"{pkg.name}.engine.LAYER.kernel" in stale["referrers"]
    edited = ops.compiled(argument)
    assert ir(edited) != first and ir(engine.LAYER.kernel) == first  # the edit compiled; the Layer's did not
    tx.rollback()
    assert id(ops._COMPILED) == old_cache and ir(ops._COMPILED["k"]) == first
    tx = r.reload()  # the edit again, then its revert: the original source compiles to the original kernel
    assert tx.report.ok
    tx.commit()
    pkg.edit("ops", OPS)
    tx = r.reload()
    assert tx.report.ok and tx.report.kernels == {f"{pkg.name}.ops.double": "cute"}
    tx.commit()
    assert ir(ops.compiled(argument)) == first


def test_a_reload_that_changes_no_cute_code_reports_no_cute_kernel(pkg, argument):
    pkg.write("ops", OPS + "\n\ndef unrelated():\n    return 1\n")
    ops = pkg.mod("ops")
    ops.compiled(argument)
    r = pkg.reloader("ops")
    pkg.edit("ops", OPS + "\n\ndef unrelated():\n    return 2\n")
    tx = r.reload()
    assert tx.report.ok and tx.report.kernels == {} and not [s for s in tx.report.stale if "CuTe" in s["reason"]]
    tx.commit()
