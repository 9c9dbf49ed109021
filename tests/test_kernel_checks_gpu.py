"""The kernel checks on the GPU, at the default models' real shapes in bf16: every declared op passes its stated
tolerance and is timed (`tsdev check`); a kernel edit's reload reports each changed op's error and its µs before
and after; under --kernel-check strict a wrong edit is rolled back and the served output is the old one.

Run on the H200: python3 -m pytest -q -m gpu tests/test_kernel_checks_gpu.py
"""
from dataclasses import replace

import httpx
import pytest
import torch
from typer.testing import CliRunner

from tsdev_kernels import checks
import tsdev_kernels.ops.fp8  # noqa: F401 (checks.declared() lists the loaded families: fp8, moe)
import tsdev_kernels.ops.moe  # noqa: F401
from tsdev_kernels.ops import fp8_block, linear
from tsdev_runtime.control_protocol import KERNEL_CHECK_ROUTE, KernelCheckReply
from serve_process import copy_project, serve
from test_reload_forward import complete, edited, new_id, reload
from tsdev.cli import app

pytestmark = pytest.mark.gpu
ACTIVATION = "kernels/tsdev_kernels/ops/activation.py"
HELPER = "    return act * up\n"


def checked(url: str, *ops: str) -> KernelCheckReply:
    reply = httpx.post(url + KERNEL_CHECK_ROUTE, json={"ops": list(ops) or None}, timeout=600)
    assert reply.status_code == 200, reply.text
    return KernelCheckReply.model_validate_json(reply.content)


def test_every_op_passes_at_the_served_shapes_and_a_reload_reports_error_and_time_before_and_after(tmp_path):
    project = copy_project(tmp_path / "project")
    args = ["--device", "cuda", "--allow-reload-forward", "--kernel-check", "strict"]
    with serve(args, tmp_path / "serve.log", cwd=project, timeout=300) as url:
        every = checked(url)
        failed = [c for c in every.checks if not c.ok]
        assert not failed, failed
        # a dense GQA model with bf16 weights: no MoE or MLA shapes, no fp8 projections or caches
        assert {c.op for c in every.checks} == set(every.ops) - {
            "fused_moe", "fp8_gemv", "fp8_skinny_linear", "paged_decode_fp8", "paged_prefill_fp8",
            "mla_decode", "mla_prefill", "mla_decode_fp8", "mla_prefill_fp8", "fp8_token_groups", "fp8_block_linear",
            "fused_moe_fp8", "fused_moe_fp8_block", "mla_decode_flash", "mla_decode_flash_fp8", "mla_decode_gluon",
            "mla_decode_gluon_fp8"}
        assert all(c.us_after and c.us_after > 0 for c in every.checks)  # idle: all timed
        assert all(c.timed == "graph" for c in every.checks), [(c.op, c.timed) for c in every.checks]  # device time
        assert CliRunner().invoke(app, ["check", "rms_norm", "--url", url]).exit_code == 0

        before = complete(url)["text"]
        with edited(project, ACTIVATION, HELPER, "    return up * act\n"):  # the same product
            worker = reload(url, new_id()).workers[0]
            assert worker.ok, worker.error
            ops = {c.op for c in worker.kernel_checks}
            assert {"silu_and_mul", "gemv_norm_gate_up"} <= ops and not {"rms_norm", "gemv"} & ops
            assert all(c.ok and c.us_before and c.us_after and c.before_fresh for c in worker.kernel_checks)
            print("\n".join(f"{c.op} {c.shape}: err {c.max_abs:.1e}, {c.us_before:.1f} -> {c.us_after:.1f} us, "
                            f"check step {worker.timings['kernel_check'] * 1e3:.1f} ms" for c in worker.kernel_checks))
        assert reload(url, new_id()).ok
        with edited(project, ACTIVATION, HELPER, "    return act * up * 1.05\n"):  # wrong: strict rolls it back
            worker = reload(url, new_id()).workers[0]
            assert not worker.ok and "kernel check failed: silu_and_mul" in worker.error
            assert complete(url)["text"] == before
        assert reload(url, new_id()).ok and complete(url)["text"] == before


def test_the_fused_moe_passes_at_the_default_moe_models_shapes(tmp_path):
    with serve(["default-moe", "--device", "cuda", "--allow-reload-forward"], tmp_path / "serve.log",
               timeout=300) as url:
        reply = checked(url, "fused_moe")
        assert reply.ok and reply.checks and all(c.us_after for c in reply.checks), reply


def test_the_mla_attention_passes_at_the_default_mla_models_shapes(tmp_path):
    with serve(["default-mla", "--device", "cuda", "--allow-reload-forward"], tmp_path / "serve.log",
               timeout=300) as url:
        reply = checked(url, "mla_decode", "mla_prefill")
        assert reply.ok and {c.op for c in reply.checks} == {"mla_decode", "mla_prefill"}, reply
        assert all(c.us_after for c in reply.checks), reply


def test_the_fp8_projections_pass_at_the_default_models_shapes_and_a_wrong_scale_fails():
    serving = checks.Serving(tokens=(1, 8, 64, 256), hidden=1024, intermediate=3072, dtype=torch.bfloat16, fp8=True)
    for op in ("fp8_gemv", "fp8_skinny_linear"):
        check = next(c for c in checks.declared() if c.op == op)
        results = [checks.run(check, shape, torch.bfloat16, "cuda") for shape in check.shapes(serving)]
        assert results and all(r.ok for r in results), results
    gemv = next(c for c in checks.declared() if c.op == "fp8_gemv")
    wrong = replace(gemv, kernel=lambda x, w, scale: linear.gemv_triton(x, w, weight_scale=scale * 1.03))
    assert not checks.run(wrong, (1, 3072, 1024), torch.bfloat16, "cuda").ok


def test_the_block_fp8_and_fp8_expert_checks_pass_on_random_values_and_a_wrong_scale_fails():
    """At Qwen3-8B's down projection (K 12288, N 4096) and Qwen3-30B-A3B's layer (16 of its 128 experts), bf16."""
    by_op = {c.op: c for c in checks.declared()}
    dense = checks.Serving(tokens=(1, 8, 64, 256), hidden=4096, intermediate=12288, dtype=torch.bfloat16,
                           fp8_blocks=True)
    moe = replace(dense, hidden=2048, experts=128, top_k=8, moe_intermediate=768)
    for op, serving in (("fp8_token_groups", dense), ("fp8_block_linear", dense), ("fused_moe_fp8_block", moe),
                        ("fused_moe_fp8", replace(moe, fp8=True, fp8_blocks=False))):
        results = [checks.run(by_op[op], shape, torch.bfloat16, "cuda") for shape in by_op[op].shapes(serving)]
        assert results and all(r.ok for r in results), results
    wrong = replace(by_op["fp8_block_linear"], kernel=lambda x, w, s: fp8_block.fp8_block_linear_triton(x, w, s * 1.03))
    assert not checks.run(wrong, (64, 12288, 4096), torch.bfloat16, "cuda").ok
