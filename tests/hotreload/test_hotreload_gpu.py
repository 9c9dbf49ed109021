"""Real compiled Triton kernels on CUDA: after a reload no stale binary may run.

Run on the GPU machine with `pytest -m gpu tests/hotreload`. Triton's in-memory cache is
keyed by argument specialisation, not by source, so each test launches the same kernel
with the same arguments before and after the edit: a stale binary would give the old result.
"""
import os
import random

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

HEADER = "import torch\nimport triton\nimport triton.language as tl\n"

OPS = HEADER + """
from .common import bump

SCALE = tl.constexpr(2)

@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * SCALE, mask=mask)

@triton.jit
def bump_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, bump(tl.load(x_ptr + offs, mask=mask)), mask=mask)

def launch(kernel, x):
    out = torch.empty_like(x)
    kernel[(1,)](x, out, x.numel(), BLOCK=128)
    return out.tolist()
"""
COMMON = HEADER + "@triton.jit\ndef bump(x):\n    return x + 1\n"
ENGINE = HEADER + """
from .common import bump

@triton.jit
def engine_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, bump(tl.load(x_ptr + offs, mask=mask)) * 10, mask=mask)
"""
AUTOTUNED = HEADER + """
@triton.autotune(configs=[CONFIGS], key=["n"])
@triton.jit
def tuned(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + ADD, mask=mask)

def run(x):
    out = torch.empty_like(x)
    tuned[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, out, x.numel())
    return out.tolist()
"""
TWO = "triton.Config({'BLOCK': 64}), triton.Config({'BLOCK': 128})"


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need CUDA")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("the gpu tests compile kernels: run them without TRITON_INTERPRET=1")
    return torch.arange(8, dtype=torch.float32, device="cuda")


def test_kernel_edit_recompiles(pkg, cuda):
    pkg.write("common", COMMON)
    pkg.write("ops", OPS)
    ops = pkg.mod("ops")
    kernel, launch = ops.scale_kernel, ops.launch
    assert type(kernel).__name__ == "JITFunction"
    assert launch(kernel, cuda) == [0, 2, 4, 6, 8, 10, 12, 14]
    launch(ops.bump_kernel, cuda)
    bump_binary = dict(next(iter(ops.bump_kernel.device_caches.values()))[0])
    r = pkg.reloader()
    pkg.edit("ops", OPS.replace("* SCALE, mask=mask)", "* SCALE + 1, mask=mask)"))
    tx = r.reload()
    assert tx.report.ok, tx.report.error
    assert tx.report.jit_kernels == 1  # scale_kernel; bump_kernel is unchanged and keeps its binary
    assert tx.report.kernels_only  # its new binary is loaded under the old key: the launch compiles nothing
    loaded = dict(next(iter(kernel.device_caches.values()))[0])
    assert len(loaded) == 1
    assert launch(kernel, cuda) == [1, 3, 5, 7, 9, 11, 13, 15]
    assert next(iter(kernel.device_caches.values()))[0] == loaded
    assert next(iter(ops.bump_kernel.device_caches.values()))[0] == bump_binary
    tx.rollback()
    assert launch(kernel, cuda) == [0, 2, 4, 6, 8, 10, 12, 14]  # the old binary, restored


def test_compile_ahead_works_for_binaries_loaded_from_the_disk_cache(pkg, cuda):
    pkg.write("common", COMMON)
    pkg.write("ops", OPS)
    ops = pkg.mod("ops")
    ops.launch(ops.scale_kernel, cuda)
    ops.scale_kernel.device_caches.clear()  # the next launch loads the binary back from Triton's disk cache
    assert ops.launch(ops.scale_kernel, cuda)[1] == 2
    r = pkg.reloader()
    offset = random.randrange(3, 1 << 20)  # an edit Triton's disk cache has never seen (a run before may have left one)
    pkg.edit("ops", OPS.replace("* SCALE, mask=mask)", f"* SCALE + {offset}, mask=mask)"))
    ahead = r.compile_ahead()
    assert ahead.binaries == 1 and ahead.on_disk == 0, ahead
    assert pkg.reload(r).ok
    assert ops.launch(ops.scale_kernel, cuda)[1] == 2 + offset
    pkg.edit("ops", OPS)  # the revert: its binary is on disk, neither compiled nor sent anywhere, and it serves
    ahead = r.compile_ahead()
    assert ahead.binaries == 0 and ahead.on_disk == 1, ahead
    assert pkg.reload(r).ok
    assert ops.launch(ops.scale_kernel, cuda)[1] == 2


def test_constexpr_global_change(pkg, cuda):
    pkg.write("common", COMMON)
    pkg.write("ops", OPS)
    ops = pkg.mod("ops")
    assert ops.launch(ops.scale_kernel, cuda)[1] == 2
    r = pkg.reloader()
    pkg.edit("ops", OPS.replace("tl.constexpr(2)", "tl.constexpr(5)"))
    pkg.reload(r)
    assert ops.launch(ops.scale_kernel, cuda)[1] == 5


def test_helper_edit_invalidates_callers_everywhere(pkg, cuda):
    pkg.write("common", COMMON)
    pkg.write("ops", OPS)
    pkg.write("engine", ENGINE)  # not reloadable: its kernel is never re-executed
    ops, engine = pkg.mod("ops"), pkg.mod("engine")
    assert ops.launch(ops.bump_kernel, cuda)[:2] == [1, 2]
    assert ops.launch(engine.engine_kernel, cuda)[:2] == [10, 20]
    r = pkg.reloader("common", "ops")
    pkg.edit("common", COMMON.replace("x + 1", "x + 100"))
    report = pkg.reload(r)
    assert report.dependents == pkg.full("ops") and report.jit_kernels == 2 and report.kernels_only
    assert ops.launch(ops.bump_kernel, cuda)[:2] == [100, 101]
    assert ops.launch(engine.engine_kernel, cuda)[:2] == [1000, 1010]


def test_autotune_edits(pkg, cuda):
    x = torch.arange(300, dtype=torch.float32, device="cuda")
    pkg.write("ops", AUTOTUNED.replace("CONFIGS", TWO).replace("ADD", "1"))
    ops = pkg.mod("ops")
    tuned, run = ops.tuned, ops.run
    assert run(x)[:3] == [1, 2, 3] and len(tuned.cache) == 1
    choice = dict(tuned.cache)
    r = pkg.reloader()
    pkg.edit("ops", AUTOTUNED.replace("CONFIGS", TWO).replace("ADD", "2"))
    report = pkg.reload(r)
    assert report.jit_kernels >= 1 and tuned.cache == choice  # body edit: tuning kept, binary rebuilt
    assert run(x)[:3] == [2, 3, 4] and run(x)[-1] == 301
    pkg.edit("ops", AUTOTUNED.replace("CONFIGS", "triton.Config({'BLOCK': 32})").replace("ADD", "2"))
    pkg.reload(r)
    assert tuned.cache == {} and tuned.configs[0].kwargs == {"BLOCK": 32}
    assert run(x)[-1] == 301 and ops.tuned is tuned
