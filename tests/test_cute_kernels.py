"""The CuTe DSL silu_and_mul (kernels/tsdev_kernels/ops/activation_cute.py, TSDEV_KERNELS=cute:activation). Without the
optional package (`pip install tsdev[cute]`, as in CI) the choice fails at startup with what to install; with it the
kernel compiles for the H200 on the CPU (CUTE_DSL_ARCH=sm_90a: nothing launches here) and an edit of the kernel changes
its check's fingerprint. tests/test_cute_watch_gpu.py serves it on the GPU."""
import importlib.util
import sys

import pytest
import torch

import tsdev_kernels.ops
from tsdev_kernels import checks

HAS_CUTE = importlib.util.find_spec("cutlass") is not None


def test_choosing_cute_kernels_without_the_package_fails_at_startup_saying_what_to_install(monkeypatch):
    monkeypatch.setenv("TSDEV_KERNELS", "cute:activation")
    assert tsdev_kernels.ops.use_cute("activation") and not tsdev_kernels.ops.use_cute("norm")
    monkeypatch.setitem(sys.modules, "cutlass", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "cutlass.cute", None)
    with pytest.raises(ValueError, match=r"pip install 'tsdev\[cute\]'"):
        tsdev_kernels.ops.check_kernel_choices()
    monkeypatch.setenv("TSDEV_KERNELS", "cute:norm")  # no CuTe DSL kernel for norm
    with pytest.raises(ValueError, match="cute for activation"):
        tsdev_kernels.ops.kernel_choices()


@pytest.mark.skipif(not HAS_CUTE, reason="the optional CuTe DSL package (tsdev[cute]) is not installed")
def test_the_cute_kernel_compiles_for_sm90_and_an_edit_changes_its_check(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    from tsdev_kernels.ops import activation_cute

    x, out = torch.randn(8, 64).bfloat16(), torch.empty(8, 32).bfloat16()
    monkeypatch.setattr(activation_cute, "_COMPILED", {})
    kernel = activation_cute.compiled(x, out)
    assert [name.startswith("kernel_cutlass__silu_and_mul_kernel_") for name in kernel.kernel_info] == [True]
    [check] = activation_cute.CHECKS
    check = checks.KernelCheck(**{**vars(check), "module": activation_cute.__name__})
    serving = checks.Serving(tokens=(1, 8), hidden=64, intermediate=32, dtype=torch.bfloat16, device="cpu")
    assert check.shapes(serving) == []  # GPU only
    before = checks.fingerprints([check])
    source = open(activation_cute.__file__).read().replace("(1.0 + cute.math.exp(-gate))",
                                                           "(2.0 + cute.math.exp(-gate))")
    scratch = {"__name__": activation_cute.__name__}
    exec(compile(source, activation_cute.__file__, "exec"), scratch)  # the edited kernel, as a reload would run it
    monkeypatch.setattr(activation_cute, "_silu_and_mul_kernel", scratch["_silu_and_mul_kernel"])
    assert checks.fingerprints([check]) != before  # reached from the host through the CuTe DSL wrapper
