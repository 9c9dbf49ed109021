"""A Gluon kernel on the serving path (TSDEV_KERNELS=gluon:norm) edited under `tsdev watch` on the GPU: the edit of
its `@gluon.jit` helper reaches the served tokens, the reload line names the dialect, and the revert restores the
golden completion bit for bit. Prints both reload lines (pause, save -> serving) for docs/benchmarks.md."""
import re

import pytest

from watch_gpu import edit_and_revert_under_watch, line_in_function

pytestmark = pytest.mark.gpu
NORM = "kernels/tsdev_kernels/ops/norm.py"


def test_a_gluon_kernel_edit_reaches_the_served_tokens_and_its_revert_restores_them(tiny_model_dir, tmp_path):
    helper = line_in_function(NORM, "rms_norm_values_gluon", r"^\s*return ")  # the normalized row
    changed, reverted = edit_and_revert_under_watch(tiny_model_dir, tmp_path, "gluon:norm", NORM, helper,
                                                    helper.replace("return ", "return 1.5 * ", 1))
    assert " ok " in changed and "golden: output changed at token" in changed, changed
    assert re.search(r"kernel\(s\) \(gluon \d+[,)]", changed), changed  # the dialect, named
    assert re.search(r"rms_norm_gluon: err \S+ FAILED", changed), changed  # its kernel check caught the edit
    for line in (changed, reverted):  # the compile workers built the new binaries while the old code served
        assert "compiling ahead failed" not in line and "compiled in the pause" not in line, line
    assert re.search(r"\| save → serving \d+\.\d\d s ", changed) and re.search(r"\bpause \d+\.\d\d\b", changed)
    assert " ok " in reverted and "golden: same 24 tokens" in reverted, reverted
    assert re.search(r"rms_norm_gluon: err \S+ ok", reverted), reverted
