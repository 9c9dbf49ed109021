"""Gluon kernels (`@gluon.jit`, triton.experimental.gluon) reload as Triton's do. Triton's interpreter does not run
them, so these tests never launch one: the bookkeeping (binaries dropped and kept, callers of an edited helper
invalidated, the dialect named, rollback) runs on stand-in binaries as in test_hotreload_triton.py, and the edited
source is compiled for the H200 (sm_90, through ptxas) with Gluon's own AST source. tests/test_gluon_watch_gpu.py
serves one on the GPU."""
import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

GLUON = """
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def scale(x):
    return x * 2.0


@gluon.jit
def uses_scale(X, N, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([BLOCK // 32], [32], [1], [0])
    offs = gl.arange(0, BLOCK, layout=layout)
    gl.store(X + offs, scale(gl.load(X + offs, mask=offs < N)), mask=offs < N)


@gluon.jit
def independent(X, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([BLOCK // 32], [32], [1], [0])
    offs = gl.arange(0, BLOCK, layout=layout)
    gl.store(X + offs, gl.load(X + offs) + 1.0)


@gluon.jit
def never_launched(X, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([BLOCK // 32], [32], [1], [0])
    offs = gl.arange(0, BLOCK, layout=layout)
    gl.store(X + offs, gl.load(X + offs) - 1.0)
"""
SIGNATURE, CONSTANTS = {"X": "*fp32", "N": "i32", "BLOCK": "constexpr"}, {(2,): 64}


def stand_in_binary(kernel) -> None:
    """What a launch leaves behind: a hash and a binary in device_caches."""
    kernel.cache_key
    kernel.device_caches[0] = ({"spec": "binary"}, {}, None, None, None)


PTX = """
import importlib, sys
from triton.backends.compiler import GPUTarget
import triton
from tsdev.hotreload.jit import ast_source
sys.path.insert(0, sys.argv[1])
kernel = getattr(importlib.import_module(sys.argv[2]), sys.argv[3])
source = ast_source(kernel)(kernel, {signature!r}, {constants!r}, {{}})
print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={{"num_warps": 1}}).asm["ptx"])
"""


def ptx(pkg, module: str, name: str) -> str:
    """The kernel as its file holds it now, compiled for sm_90 in a fresh process: Triton's interpreter leaves its
    builder patched into triton.language after a jit function is called directly, and a later compile in the same
    process (the suite's other tests run the interpreter) would fail with InterpreterBuilder."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", PTX.format(signature=SIGNATURE, constants=CONSTANTS),
                          os.path.dirname(pkg.root), f"{pkg.name}.{module}", name],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
def test_a_gluon_helper_edit_drops_its_callers_binaries_names_the_dialect_and_rolls_back(pkg, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", GLUON)
    kern = pkg.mod("kern")
    assert type(kern.scale).__name__ == "GluonJITFunction"
    for kernel in (kern.uses_scale, kern.independent):
        stand_in_binary(kernel)
    live, hashes, before = (kern.uses_scale, [kern.uses_scale.hash, kern.independent.hash],
                            ptx(pkg, "kern", "uses_scale"))
    r = pkg.reloader()
    pkg.edit("kern", GLUON.replace("return x * 2.0", "return x * 3.0"))
    tx = r.reload()
    assert tx.report.ok, tx.report.error
    assert kern.uses_scale is live and "x * 3.0" in kern.scale.src  # patched in place
    assert dict(live.device_caches) == {} and live.cache_key != hashes[0]  # the caller compiles again
    assert kern.independent.device_caches[0][0] == {"spec": "binary"} and kern.independent.hash == hashes[1]
    # the edited helper and its caller; not `never_launched` (no hash to compare, the same source)
    assert tx.report.kernels == {f"{pkg.name}.kern.scale": "gluon", f"{pkg.name}.kern.uses_scale": "gluon"}
    assert tx.report.jit_kernels == 1 and not tx.report.kernels_only  # stand-ins it cannot read: the warm-up runs
    edited = ptx(pkg, "kern", "uses_scale")
    assert edited != before and "0f40400000" in edited  # 3.0, compiled from Gluon's IR (no shared memory needed)
    tx.rollback()
    assert kern.uses_scale.hash == hashes[0] and live.device_caches[0][0] == {"spec": "binary"}
    assert "x * 2.0" in kern.scale.src  # the old helper serves again (the file keeps the edit)


def test_an_autotuned_gluon_kernel_is_named_gluon():
    from triton.experimental import gluon

    from tsdev.hotreload import jit

    def body(X):
        pass

    kernel = triton.autotune(configs=[triton.Config({}, num_warps=1)], key=[])(gluon.jit(body))
    assert jit.named_dialects([jit.Reset(kernel, None, True)]) == {f"{__name__}.{body.__qualname__}": "gluon"}
