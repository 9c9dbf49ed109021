"""An edit of the MLA Triton kernel through `tsdev watch` on the GPU, on the transformers-written tiny DeepSeek-V3:
the reload reaches the served tokens (its kernel check catches the edit), and the revert restores them. The same for
the Gluon decode kernel on Hopper, on default-mla (V3's attention shapes in bf16: what the Gluon kernel serves)."""
import re

import pytest
import torch

from watch_gpu import edit_and_revert_under_watch, line_in_function

pytestmark = pytest.mark.gpu
MLA = "kernels/tsdev_kernels/ops/mla.py"
MLA_GLUON = "kernels/tsdev_kernels/ops/mla_decode_gluon.py"


def test_an_mla_kernel_edit_reaches_the_served_tokens_and_its_revert_restores_them(hf_deepseek_v3_dir, tmp_path):
    line = line_in_function(MLA, "_mla_kernel", r"tl\.store\(O \+")  # the unsplit tiles' output: every prefill
    edited = re.sub(r"\bacc\b", "(acc * 1.5)", line, count=1)
    assert edited != line, line
    changed, reverted = edit_and_revert_under_watch(hf_deepseek_v3_dir, tmp_path, "triton", MLA, line, edited)
    assert " ok " in changed and "golden: output changed at token" in changed, changed
    assert re.search(r"mla_prefill: err \S+ FAILED", changed), changed  # its kernel check caught the edit
    assert re.search(r"\| save → serving \d+\.\d\d s ", changed) and re.search(r"\bpause \d+\.\d\d\b", changed)
    assert " ok " in reverted and "golden: same 24 tokens" in reverted, reverted


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon MLA decode kernel runs on sm_90 only")
def test_a_gluon_mla_decode_edit_reaches_the_served_tokens_and_its_revert_restores_them(tmp_path):
    # each split's partial output (default-mla's decode steps run split: 128 heads leave most SMs to the splits)
    line = line_in_function(MLA_GLUON, "_mla_decode_gluon_kernel", r"acc \* \(scale / gl\.maximum\(l_o")
    edited = line.replace("acc * (scale", "acc * 1.5 * (scale", 1)
    assert edited != line, line
    changed, reverted = edit_and_revert_under_watch("default-mla", tmp_path, "triton", MLA_GLUON, line, edited)
    assert " ok " in changed and "golden: output changed at token" in changed, changed
    assert re.search(r"mla_decode_gluon: err \S+ FAILED", changed), changed  # its kernel check caught the edit
    assert " ok " in reverted and "golden: same 24 tokens" in reverted, reverted
