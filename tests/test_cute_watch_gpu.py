"""The CuTe DSL silu_and_mul on the serving path (TSDEV_KERNELS=cute:activation) edited under `tsdev watch` on the
GPU: the edit reaches the served tokens, the reload line names the dialect, and the revert restores the golden
completion bit for bit. Needs the optional CuTe DSL package on the GPU machine (scripts/device-prep-cute.sh brings
its wheels); prints both reload lines (pause, save -> serving) for docs/benchmarks.md."""
import re

import pytest

from watch_gpu import edit_and_revert_under_watch, line_in_function

pytestmark = pytest.mark.gpu
pytest.importorskip("cutlass.cute", reason="the optional CuTe DSL package (tsdev[cute]) is not installed")
KERNEL = "kernels/tsdev_kernels/ops/activation_cute.py"


def test_a_cute_kernel_edit_reaches_the_served_tokens_and_its_revert_restores_them(tiny_model_dir, tmp_path):
    line = line_in_function(KERNEL, "_silu_and_mul_kernel", r"\bout\[.*\] = ")  # the output's store
    edited = re.sub(r"= \((.*)\)\.to\(", r"= (\1 * 1.5).to(", line, count=1)
    assert edited != line, line
    changed, reverted = edit_and_revert_under_watch(tiny_model_dir, tmp_path, "cute:activation", KERNEL, line, edited)
    assert " ok " in changed and "golden: output changed at token" in changed, changed
    assert "cute" in changed and re.search(r"silu_and_mul_cute: err \S+ FAILED", changed), changed
    assert re.search(r"\| save → serving \d+\.\d\d s ", changed) and re.search(r"\bpause \d+\.\d\d\b", changed)
    assert " ok " in reverted and "golden: same 24 tokens" in reverted, reverted
    assert re.search(r"silu_and_mul_cute: err \S+ ok", reverted), reverted
