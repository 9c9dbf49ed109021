"""The per-kernel check of a reload (kernels/tsdev_kernels/checks.py, runtime/tsdev_runtime/engine/kernel_checks.py) on
the CPU, under Triton's interpreter: a kernel against its reference on fresh random inputs (NaN never passes, a wrong
result is reported with its error), which ops an edit changed (through an inlined helper too), and a server whose reload
checks the changed ops: a harmless edit reports ok, a wrong one reports not ok, and under --kernel-check strict rolls
the reload back naming the op and the shape."""
import inspect
import math
import textwrap
import time
from dataclasses import replace

import httpx
import pytest
import torch

from tsdev_kernels import checks
from tsdev_kernels.ops import activation, attention, fp8_block, linear, moe, norm, rope, sampling  # noqa: F401
from tsdev_runtime.control_protocol import KernelCheckResult, ReloadReply, WorkerReport
from tsdev_runtime.engine.kernel_checks import serving_tokens
from serve_process import copy_project, serve
from tsdev.outcome import kernel_checks_text

SILU = next(c for c in checks.declared() if c.op == "silu_and_mul")
HELPER_LINE = "    return act * up\n"


def test_a_kernel_matches_its_reference_on_fresh_inputs_and_two_checks_draw_different_ones():
    first, second = (checks.run(SILU, (5, 96), torch.float32, "cpu") for _ in range(2))
    assert first.ok and second.ok and first.error is None
    assert 0 < first.max_abs <= 1e-5 and first.seed != second.seed
    inputs = [SILU.inputs((5, 96), torch.float32, "cpu", torch.Generator().manual_seed(r.seed))
              for r in (first, second)]
    assert not torch.equal(inputs[0][0], inputs[1][0]) and bool(inputs[0][0].abs().min() > 0)  # never zeros


def test_paged_attention_is_checked_on_pages_in_random_order_and_a_wrong_scale_fails():
    decode, prefill = (next(c for c in checks.declared() if c.op == op) for op in ("paged_decode", "paged_prefill"))
    shape = (3, 4, 2, 16, 16, 100)  # 3 sequences, 4 / 2 heads of 16, pages of 16, up to 100 tokens
    q, k_cache, _, cu, lens, table, *_ = decode.inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(1))
    used = torch.cat([table[i, :-(-int(n) // 16)] for i, n in enumerate(lens)])
    assert len(set(used.tolist())) == len(used) and not torch.equal(used.sort().values, used)  # scattered pages
    assert len(set(lens.tolist())) > 1 and cu.tolist() == [0, 1, 2, 3]  # mixed lengths, one decode row each
    assert checks.run(decode, shape, torch.float32, "cpu").ok and checks.run(prefill, (20, *shape[1:]), torch.float32,
                                                                               "cpu").ok
    wrong = replace(decode, kernel=lambda q, kc, vc, cu, lens, table, k, v, slots: attention.paged_decode_triton(
        q, kc, vc, cu, lens, table, q.shape[-1] ** -0.5 * 1.05, store=(k, v, slots)))
    assert not checks.run(wrong, shape, torch.float32, "cpu").ok


def test_an_fp8_pool_is_checked_in_e4m3_instead_and_a_wrong_v_scale_fails():
    decode, fp8_decode, fp8_prefill = (next(c for c in checks.declared() if c.op == op)
                                       for op in ("paged_decode", "paged_decode_fp8", "paged_prefill_fp8"))
    serving = checks.Serving(tokens=(3, 20), hidden=64, intermediate=128, dtype=torch.float32, q_heads=4, kv_heads=2,
                             head_dim=16, max_context=100, device="cpu")
    assert fp8_decode.shapes(serving) == [] and decode.shapes(serving)  # a bf16 pool: the plain checks
    served = replace(serving, kv_fp8=True)
    assert (decode.shapes(served) == []
            and fp8_decode.shapes(served) == [(3, 4, 2, 16, 16, 100), (20, 4, 2, 16, 16, 100)])
    _, k_cache, *_ = fp8_decode.inputs((3, 4, 2, 16, 16, 100), torch.float32, "cpu", torch.Generator().manual_seed(2))
    assert k_cache.dtype == attention.FP8_KV_DTYPE
    assert all(checks.run(c, c.shapes(served)[0], torch.float32, "cpu").ok for c in (fp8_decode, fp8_prefill))
    wrong = replace(fp8_decode, kernel=lambda q, kc, vc, cu, lens, table, k, v, slots, order, max_q_len:
                    attention.paged_decode_triton(q, kc, vc, cu, lens, table, q.shape[-1] ** -0.5, store=(k, v, slots),
                                                  kv_scales=(1.0, 1.1)))
    assert not checks.run(wrong, (3, 4, 2, 16, 16, 100), torch.float32, "cpu").ok


def test_the_fused_moe_is_checked_at_the_served_width_and_top_k_and_a_routing_slip_fails():
    fused = next(c for c in checks.declared() if c.op == "fused_moe")
    serving = checks.Serving(tokens=(1, 6), hidden=64, intermediate=192, dtype=torch.float32, experts=40, top_k=2,
                             moe_intermediate=32, device="cpu")
    assert fused.shapes(serving) == [(1, 64, 32, 16, 2), (6, 64, 32, 16, 2)]  # at most 16 experts drawn
    assert fused.shapes(replace(serving, experts=0)) == []  # a dense model
    assert all(checks.run(fused, shape, torch.float32, "cpu").ok for shape in fused.shapes(serving))  # GEMV, GEMMs
    slip = replace(fused, kernel=lambda x, w13, w2, w, ids: moe.fused_moe_triton(x, w13, w2, w.flip(-1), ids))
    assert not checks.run(slip, (6, 64, 32, 16, 2), torch.float32, "cpu").ok


def test_the_logits_ops_are_checked_over_the_vocab_and_a_halved_penalty_fails():
    logprobs, penalties = (next(c for c in checks.declared() if c.op == op) for op in ("token_logprobs",
                                                                                      "apply_penalties"))
    assert checks.run(logprobs, (3, 1024), torch.bfloat16, "cpu").ok  # float32 logits whatever the model's dtype
    assert checks.run(penalties, (5, 1024), torch.float32, "cpu").ok
    halved = replace(penalties, kernel=sampling._on_a_copy(
        lambda logits, slots, counts, params, *bias: sampling.apply_penalties_triton(logits, slots, counts,
                                                                                      params * 0.5, *bias)))
    assert not checks.run(halved, (5, 1024), torch.float32, "cpu").ok


@pytest.mark.slow
def test_the_samplers_are_checked_token_for_token_and_another_seed_fails():
    race, top_k = (next(c for c in checks.declared() if c.op == op) for op in ("sample", "sample_top_k"))
    assert race.tolerance[torch.bfloat16].atol == 0 == top_k.tolerance[torch.bfloat16].rtol  # token ids: exact
    assert checks.run(race, (7, 3000), torch.float32, "cpu").ok and checks.run(top_k, (7, 3000), torch.float32,
                                                                               "cpu").ok
    reseeded = replace(top_k, kernel=lambda logits, temps, ks, ps, seeds: sampling.sample_top_k_triton(
        logits, temps, ks, ps, seeds + 1, sampling.SAMPLE_TOP_K))
    # many rows: a few are greedy, or filtered down to one token, and draw the same whatever the seed
    assert not checks.run(reseeded, (64, 3000), torch.float32, "cpu").ok


def test_fp8_projections_are_checked_only_where_the_model_serves_them():
    gemv, skinny = (next(c for c in checks.declared() if c.op == op) for op in ("fp8_gemv", "fp8_skinny_linear"))
    serving = checks.Serving(tokens=(1, 8, 64), hidden=64, intermediate=128, dtype=torch.float32, device="cpu")
    assert gemv.shapes(serving) == [] == skinny.shapes(serving)  # bf16 weights
    fp8 = replace(serving, fp8=True)
    assert gemv.shapes(fp8) == [(1, 128, 64)] and skinny.shapes(fp8) == [(8, 128, 64)]
    x, weight, scale = gemv.inputs((1, 128, 64), torch.float32, "cpu", torch.Generator().manual_seed(3))
    assert weight.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    assert all(checks.run(c, c.shapes(fp8)[0], torch.float32, "cpu").ok for c in (gemv, skinny))
    unscaled = replace(gemv, kernel=lambda x, w, scale: linear.gemv_triton(x, w, weight_scale=scale * 1.02))
    assert not checks.run(unscaled, (1, 128, 64), torch.float32, "cpu").ok


def test_block_fp8_kernels_and_fp8_experts_are_checked_only_where_served_and_a_wrong_scale_fails():
    by_op = {c.op: c for c in checks.declared()}
    serving = checks.Serving(tokens=(1, 6), hidden=128, intermediate=320, dtype=torch.float32, experts=40, top_k=2,
                             moe_intermediate=128, device="cpu")
    fp8, blocks = replace(serving, fp8=True), replace(serving, fp8_blocks=True)
    new = ("fp8_token_groups", "fp8_block_linear", "fused_moe_fp8", "fused_moe_fp8_block")
    assert [op for op in new if by_op[op].shapes(serving)] == [] and by_op["fused_moe"].shapes(serving)
    assert [op for op in (*new, "fused_moe") if by_op[op].shapes(fp8)] == ["fused_moe_fp8"]  # its experts in e4m3
    assert [op for op in (*new, "fused_moe") if by_op[op].shapes(blocks)] == [op for op in new if op != "fused_moe_fp8"]
    assert by_op["fp8_block_linear"].shapes(blocks) == [(1, 320, 128), (6, 320, 128)]
    x, weight, scale_inv = by_op["fp8_block_linear"].inputs((6, 320, 128), torch.float32, "cpu",
                                                           torch.Generator().manual_seed(4))
    assert weight.dtype == torch.float8_e4m3fn and scale_inv.shape == (1, 3) and x.abs().max() > 1  # fresh values
    for op, served in (("fp8_token_groups", blocks), ("fp8_block_linear", blocks), ("fused_moe_fp8", fp8),
                       ("fused_moe_fp8_block", blocks)):
        assert all(checks.run(by_op[op], shape, torch.float32, "cpu").ok for shape in by_op[op].shapes(served)), op
    mis_scaled = replace(by_op["fp8_block_linear"], kernel=lambda x, w, s: fp8_block.fp8_block_linear_triton(
        x, w, s * 1.02))
    assert not any(checks.run(mis_scaled, shape, torch.float32, "cpu").ok for shape in ((1, 320, 128), (6, 320, 128)))
    swapped = replace(by_op["fp8_token_groups"], kernel=lambda x: fp8_block._as_floats(
        fp8_block.quantize_fp8_token_groups_triton(x.flip(-1))))
    assert not checks.run(swapped, (6, 128), torch.float32, "cpu").ok
    for op in ("fused_moe_fp8", "fused_moe_fp8_block"):
        check = by_op[op]
        down_off = replace(check, kernel=lambda x, w13, w2, w, ids, s13, s2, check=check: check.kernel(
            x, w13, w2, w, ids, s13, s2 * 1.02))
        assert not checks.run(down_off, (6, 128, 128, 16, 2), torch.float32, "cpu").ok, op


def test_a_wrong_kernel_is_reported_with_its_error_and_nan_never_passes():
    wrong = replace(SILU, kernel=lambda x: activation.silu_and_mul_triton(x) * 1.01)
    result = checks.run(wrong, (3, 64), torch.float32, "cpu")
    assert not result.ok and 1e-3 < result.max_rel < 0.02
    nan = replace(SILU, kernel=lambda x: activation.silu_and_mul_triton(x) * math.nan)
    result = checks.run(nan, (3, 64), torch.float32, "cpu")
    assert not result.ok and result.max_abs == math.inf
    wrong_shape = replace(SILU, kernel=lambda x: activation.silu_and_mul_triton(x)[:, :-1])
    result = checks.run(wrong_shape, (3, 64), torch.float32, "cpu")
    assert not result.ok and "output" in result.error


def test_an_edit_of_an_inlined_helper_changes_the_fingerprint_of_the_ops_whose_kernels_call_it():
    declared = checks.declared()
    before = checks.fingerprints(declared)
    kernel = activation._silu_and_mul_kernel
    helper = checks._python_function(activation.silu_and_mul_values)
    original = helper.__code__
    try:
        helper.__code__ = compile("def f(gate, up, dt):\n    return gate * up\n", "<edit>", "exec").co_consts[0]
        # the GEMV with the norm fused (its gated path) and the MoE's up kernel inline the helper too: their ops,
        # nothing else (the plain GEMV, fp8_gemv's too, is a kernel without it)
        assert sorted(c.op for c in checks.changed(before, declared)) == [
            "fused_moe", "fused_moe_fp8", "fused_moe_fp8_block", "gemv_norm_gate_up", "silu_and_mul"]
    finally:
        helper.__code__ = original
    assert checks.changed(before, declared) == [] and kernel is activation._silu_and_mul_kernel
    reached = {c.op: checks.modules_reached(c) for c in declared}  # what the old code's timing before an edit takes
    # wait_for_previous is in tsdev_kernels.ops
    assert reached["silu_and_mul"] == {"tsdev_kernels.ops.activation", "tsdev_kernels.ops"}
    assert ({"tsdev_kernels.ops.linear", "tsdev_kernels.ops.activation", "tsdev_kernels.ops.norm"}
            <= reached["gemv_norm_gate_up"])
    assert "tsdev_kernels.ops.activation" not in reached["rms_norm"]


def test_an_edit_of_a_launch_setting_changes_the_fingerprint_of_the_ops_it_launches():
    """num_warps, a block size, the grid: the launcher is the op as much as the kernel's body is (a kernel author's
    most common speed edit), so the reload checks and times it and the notebook records it."""
    declared = checks.declared()
    before = checks.fingerprints(declared)
    launcher = norm.rms_norm_triton
    original = launcher.__code__
    source = textwrap.dedent(inspect.getsource(launcher))
    assert "BLOCK // 256" in source
    edited = {}
    exec(compile(source.replace("BLOCK // 256", "BLOCK // 512"), norm.__file__, "exec"), vars(norm).copy(), edited)
    try:
        launcher.__code__ = edited["rms_norm_triton"].__code__
        changed = {c.op for c in checks.changed(before, declared)}
        assert {"rms_norm", "fused_add_rms_norm"} <= changed and "silu_and_mul" not in changed, changed
    finally:
        launcher.__code__ = original
    assert checks.changed(before, declared) == []
    assert "tsdev_kernels.ops.norm" in checks.modules_reached(next(c for c in declared if c.op == "rms_norm"))


def test_a_module_constant_a_launcher_reads_is_part_of_the_fingerprint():
    module = {"__name__": "tsdev_kernels.ops.planted", "WARPS": 4}
    exec("def launch(x):\n    return x * WARPS\n", module)
    check = replace(next(c for c in checks.declared() if c.op == "silu_and_mul"), kernel=module["launch"])
    before = checks.fingerprints([check])
    module["WARPS"] = 8
    assert checks.changed(before, [check]) == [check]
    assert "tsdev_kernels.ops.planted" in checks.modules_reached(check)


def test_inputs_drawn_ahead_are_used_only_while_the_code_drawing_them_is_unchanged():
    shape = (4, 64)
    ahead = checks.draw(SILU, shape, torch.float32, "cpu")
    result, = checks.run_all([(SILU, shape)], torch.float32, "cpu", {("silu_and_mul", shape): ahead})
    assert result.ok and result.seed == ahead.seed  # the kernel ran on the inputs drawn ahead
    other = checks.draw(SILU, shape, torch.float32, "cpu")
    assert other.seed != ahead.seed and not torch.equal(other.args[0], ahead.args[0])  # fresh each time
    doubled = replace(SILU, reference=lambda x: activation.silu_and_mul_ref(x) * 2)  # the reference was edited
    assert checks.drawing_digest(doubled) != ahead.digest
    result, = checks.run_all([(doubled, shape)], torch.float32, "cpu", {("silu_and_mul", shape): ahead})
    assert result.seed != ahead.seed and not result.ok  # drawn again: the edited reference is what is compared
    stale = replace(ahead, want=[w * 2 for w in ahead.want])  # had it been reused, the check would fail
    result, = checks.run_all([(SILU, (3, 64))], torch.float32, "cpu", {("silu_and_mul", shape): stale})
    assert result.ok and result.seed != ahead.seed  # another shape: drawn now


def test_serving_shapes_take_the_ends_and_middle_of_the_decode_graphs_and_every_prefill_bucket():
    assert serving_tokens([1, 2, 4, 8, 16, 32], [256, 1024, 2048], 64) == (1, 8, 32, 256, 1024, 2048)
    assert serving_tokens([], [], 16) == (1, 16)


def test_the_summary_gives_the_largest_error_and_the_median_times_per_op():
    def result(shape, err, before, after, ok=True):
        return KernelCheckResult(op="silu_and_mul", shape=shape, dtype="bfloat16", max_abs=err, max_rel=err, atol=1e-2,
                                 rtol=1.6e-2, ok=ok, seed=1, us_before=before, us_after=after, before_fresh=True)

    worker = WorkerReport(ok=True, kernel_checks=[result([1, 6144], 2e-3, 4.0, 3.6), result([8, 6144], 1e-3, 4.2, 3.6)])
    assert kernel_checks_text(worker) == ["silu_and_mul: err 2e-03 ok · 4.1 → 3.6 µs (-12%) at 2 shape(s)"]
    worker.kernel_checks[1].ok = False
    assert kernel_checks_text(worker)[0].startswith("silu_and_mul: err 2e-03 FAILED · 4.1") and \
        kernel_checks_text(worker)[0].endswith("at 1 of 2 shape(s)")
    worker.kernel_checks[0].timed = "eager"  # launch cost included: said, as it is not what a captured step pays
    assert "4.1 → 3.6 µs eager (-12%)" in kernel_checks_text(worker)[0]


# --- a server's reloads ------------------------------------------------------------------------------------------

PROMPT = {"prompt": [5, 17, 300, 42], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory, tiny_model_dir):
    project = copy_project(tmp_path_factory.mktemp("project"))
    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "256", "--max-running", "8",
            "--allow-reload-forward", "--kernel-check", "strict",
            "--cudagraph-capture-sizes", "1", "2", "4", "--prefill-graph-capture-sizes", "32", "64",
            "--max-batched-tokens", "128"]  # small shapes: the checks run interpreted
    with serve(args, project / "serve.log", cwd=project) as url:
        yield url, project


def reload(url: str, **request) -> ReloadReply:
    reply = httpx.post(url + "/v1/rl/engine/reload_forward", json={"id": f"k{time.monotonic_ns()}", **request},
                       timeout=300)
    assert reply.status_code == 200, reply.text
    return ReloadReply.model_validate_json(reply.content)


def save(project, old: str, new: str) -> None:
    file = project / "kernels/tsdev_kernels/ops/activation.py"
    source = file.read_text()
    assert old in source
    file.write_text(source.replace(old, new))


@pytest.mark.slow
def test_a_reload_checks_the_ops_it_changed_and_strict_rolls_a_wrong_edit_back(strict_server):
    url, project = strict_server
    save(project, HELPER_LINE, "    return up * act\n")  # harmless: the same product
    worker = reload(url).workers[0]
    assert worker.ok, worker.error
    info = httpx.get(url + "/server_info", timeout=30).json()
    tokens = serving_tokens(info["decode_graph_sizes"], info["prefill_graph_buckets"], info["max_running"])
    silu = [tuple(c.shape) for c in worker.kernel_checks if c.op == "silu_and_mul"]
    assert silu == [(t, 2 * 192) for t in tokens] and len(tokens) > 2  # the serving shapes
    # the GEMV with the norm fused inlines the helper (the gate_up projection): its op is checked too, nothing else
    # (not the plain GEMV's: a kernel of its own, which the edit does not build again)
    assert {c.op for c in worker.kernel_checks} == {"silu_and_mul", "gemv_norm_gate_up"}
    assert all(c.ok and c.max_abs is not None for c in worker.kernel_checks) and "kernel_check" in worker.timings
    save(project, "    return up * act\n", "    return up * act * 1.5\n")  # wrong
    failed = reload(url).workers[0]
    assert not failed.ok and f"kernel check failed: silu_and_mul at {tokens[0]}x384 float32" in failed.error
    assert not all(c.ok for c in failed.kernel_checks)
    nothing = reload(url).workers[0]  # rolled back: the wrong edit is still what is on disk, and fails again
    assert not nothing.ok and "silu_and_mul" in nothing.error
    reported = reload(url, kernel_check="report").workers[0]  # this reload only: checked once serving resumed
    assert reported.ok and not all(c.ok for c in reported.kernel_checks)
    assert reported.timings["kernel_check"] > 0 and "kernel check failed" not in str(reported.warnings)
    save(project, "    return up * act * 1.5\n", HELPER_LINE)
    restored = reload(url).workers[0]
    assert restored.ok and all(c.ok for c in restored.kernel_checks)
    save(project, HELPER_LINE, "    return up * act\n")
    unchecked = reload(url, kernel_check="off").workers[0]
    assert unchecked.ok and unchecked.kernel_checks == [] and "kernel_check" not in unchecked.timings
    save(project, "    return up * act\n", HELPER_LINE)
    assert reload(url, kernel_check="off").workers[0].ok
    untouched = reload(url).workers[0]  # nothing changed: no check
    assert untouched.ok and untouched.kernel_checks == []


@pytest.mark.slow
def test_tsdev_check_runs_every_declared_op_or_the_named_ones_and_names_the_ops_it_does_not_know(strict_server):
    from typer.testing import CliRunner

    from tsdev.cli import app

    url, _ = strict_server
    every = CliRunner().invoke(app, ["check", "--url", url])
    assert every.exit_code == 0, every.output
    assert {line.split(":")[0] for line in every.stdout.splitlines()[:-1]} == {  # the progress goes to stderr
        "silu_and_mul", "paged_decode", "paged_prefill", "gemv", "gemv_norm_gate_up", "skinny_linear", "rms_norm",
        "fused_add_rms_norm", "rope", "qk_norm_rope", "sample", "sample_top_k", "token_logprobs",
        "apply_penalties"}  # no fused_moe (a dense model), no fp8_* (bf16 weights and KV pool)
    assert "all ok" in every.output
    table = CliRunner().invoke(app, ["check", "rms_norm", "--shapes", "--url", url])
    assert table.exit_code == 0 and table.output.count("rms_norm ") >= 3 and "fused_add" not in table.output
    unknown = CliRunner().invoke(app, ["check", "nope", "--url", url])
    assert unknown.exit_code == 2 and "nope" in unknown.output and "silu_and_mul" in unknown.output


@pytest.mark.slow
def test_where_the_checks_cannot_run_report_says_so_and_strict_is_refused(tmp_path, tiny_model_dir, monkeypatch):
    """The CPU without Triton's interpreter: the startup log says the checks are off and why, a kernel edit reloads
    with that in its warnings (not a silent `kernel_checks: []`), a reload that asks for strict is refused, `tsdev
    check` says why, and no graph patch is attempted (there are no CUDA graphs)."""
    from typer.testing import CliRunner

    from tsdev.cli import app

    monkeypatch.delenv("TRITON_INTERPRET")
    project = copy_project(tmp_path / "project")
    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "256", "--allow-reload-forward"]
    with serve(args, project / "serve.log", cwd=project) as url:
        assert "kernel checks are off on cpu" in (project / "serve.log").read_text()
        save(project, "    return F.silu(gate) * up\n", "    return F.silu(gate) * up * 3\n")
        refused = reload(url, kernel_check="strict")
        assert not refused.ok and "strict, which cannot hold" in refused.workers[0].error
        assert "TRITON_INTERPRET=1" in refused.workers[0].error
        reported = reload(url).workers[0]
        assert reported.ok and reported.reloaded == ["tsdev_kernels.ops.activation"] and reported.kernel_checks == []
        assert [w for w in reported.warnings if w.startswith("kernel checks are off on cpu")], reported.warnings
        assert not [w for w in reported.warnings if "patching the graphs" in w], reported.warnings
        checked = CliRunner().invoke(app, ["check", "--url", url])
        assert checked.exit_code != 0 and "TRITON_INTERPRET=1" in checked.output, checked.output
