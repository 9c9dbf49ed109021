"""`tsdev tune` on the CPU (issue 65): the fast search against the full grid on recorded timings
(tests/fixtures/tune_timings.json), the order in which the kernels find tuned files, the block-FP8 projection's route
to torch._scaled_mm by M and its TSDEV_KERNELS override, the command's help, a stopped run resumed on a stub timer,
and the refusal without CUDA."""
import json
import logging
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tsdev.cli import app
from tsdev.tune import Job, jobs_for, resolve_model, tuned_dir
from tsdev.tune_search import GEMM_SPACE, fast_search, full_search, moe_space, seeds
from tsdev_kernels import ops
from tsdev_kernels.ops import fp8_block, moe

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "tune_timings.json").read_text())
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def recorded(tokens: str):
    keys, table = FIXTURE["keys"].split(","), FIXTURE["us"][tokens]
    return lambda config: table[",".join(str(config[k]) for k in keys)]


# --- the fast search ---------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", ["1", "64", "1024"])
def test_the_fast_search_finds_the_full_grids_best_within_3_percent_timing_a_fraction(tokens):
    e, _, _, topk = FIXTURE["shape"]
    rows, time = int(tokens) * topk / e, recorded(tokens)
    fast, full = fast_search(moe_space(False), rows, time), full_search(moe_space(False), rows, time)
    assert full.timed == len(moe_space(False).grid(rows)) == len(FIXTURE["us"][tokens])
    assert fast.us <= 1.03 * full.us, (fast, full)
    assert fast.timed <= full.timed // 2, (fast.timed, full.timed)
    # the landscape tells searches apart: its seeds' best alone, or the untuned default, misses by more at some bucket
    assert min(time(c) or float("inf") for c in seeds(moe_space(False), rows)) >= fast.us


def test_the_fixture_punishes_a_search_that_keeps_one_regime():
    """At one token the compute-bound tiles, at 1024 the narrowest streaming ones, are > 3 % off the best."""
    best = {t: min(v for v in FIXTURE["us"][t].values() if v) for t in ("1", "1024")}
    assert recorded("1")(dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=2)) > 1.03 * best["1"]
    assert recorded("1024")(dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)) > 1.03 * best["1024"]


def test_seeds_come_from_both_regimes_as_the_rows_allow():
    decode, prefill = seeds(moe_space(False), 1 * 8 / 128), seeds(moe_space(False), 1024 * 8 / 128)
    assert {c["BLOCK_M"] for c in decode} == {16}  # a 64-row tile at 0.06 rows per expert is all padding
    assert {c["BLOCK_K"] for c in decode} >= {128, 256} and max(c["num_stages"] for c in decode) == 4
    assert any(c["BLOCK_M"] == 128 and c["num_warps"] == 8 for c in prefill)  # wgmma tiles
    assert any(c["BLOCK_M"] == 16 for c in prefill)
    block = seeds(moe_space(True), 64.0)
    assert {c["BLOCK_K"] for c in block} == {128} and max(c["BLOCK_N"] for c in block) <= 128
    gemm = seeds(GEMM_SPACE, 1)
    assert {c["SPLIT_K"] for c in gemm} >= {4, 8} and {c["BLOCK_M"] for c in gemm} == {16}
    assert all(moe_space(False).allowed(c, 0.06) for c in decode)


# --- the shapes ----------------------------------------------------------------------------------


def test_a_models_shapes_come_from_its_config_per_tensor_parallel_rank():
    _, qwen = resolve_model("qwen3-30b-a3b")
    assert [j.shape for j in jobs_for(qwen, 2, ("bf16",))] == [(128, 384, 2048, 8)]
    _, dense = resolve_model("qwen3-8b")
    assert {j.label: j.shape for j in jobs_for(dense, 1, ("gemm",))} == {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
    _, v3 = resolve_model("deepseek-v3")
    shapes = {j.label: j.shape for j in jobs_for(v3, 8, ("gemm", "block-fp8"))}
    assert shapes["q_b"] == (128 // 8 * 192, 1536) and shapes["o"] == (7168, 2048) and shapes["kv_a"] == (576, 7168)
    assert shapes[""] == (256, 256, 7168, 8)  # the experts' layer, I 2048 / 8
    assert resolve_model("default-moe")[1]["moe_intermediate_size"] == 512  # the GPU shape, no checkpoint written
    job = Job("block-fp8", (256, 2048, 7168, 8))
    assert job.path(Path("/c"), H100).name == "E=256,I=2048,H=7168,dtype=float8_e4m3fn,block=128x128,device=" \
                                              "NVIDIA_H100_80GB_HBM3.json"


# --- the lookup order ----------------------------------------------------------------------------


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """An H100 as far as the kernels' lookups can tell; its shipped folders and the user's cache in tmp_path."""
    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(moe, "CONFIG_DIR", tmp_path / "shipped")
    monkeypatch.setattr(fp8_block, "GEMM_CONFIG_DIR", tmp_path / "shipped-gemm")
    for module in (moe, fp8_block):
        monkeypatch.setattr(module, "device_name", lambda device: None if str(device) == "cpu" else H100)

    def clear():
        for cached in (ops.tuned_configs, moe._moe_table, fp8_block._gemm_table, fp8_block._route_table):
            cached.cache_clear()
    clear()
    yield clear
    clear()


def write(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table))


def entry(block_m: int) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


def test_the_users_file_then_this_gpus_then_the_siblings_then_defaults_said_once(gpu, tmp_path, caplog):
    shape = (128, 384, 2048, torch.bfloat16)  # Qwen3-30B-A3B's layer at --tp 2
    user = moe.moe_config_path(*shape, H100, folder=tmp_path / "cache" / "tuned" / "moe_configs")
    assert user.parent == tuned_dir() / "moe_configs"  # where `tsdev tune` writes
    shipped, sibling = moe.moe_config_path(*shape, H100), moe.moe_config_path(*shape, H200)
    for path, block_m in ((user, 32), (shipped, 64), (sibling, 128)):
        write(path, {"1": entry(block_m)})
    said = []
    for block_m, gone in ((32, user), (64, shipped), (128, sibling)):
        gpu()
        with caplog.at_level(logging.INFO, logger=ops.tuned_log.name):
            for tokens in (1, 3, 700):  # asked per call: said once
                assert moe.moe_config(*shape, tokens)["BLOCK_M"] == block_m
        said.append([r.getMessage() for r in caplog.records])
        caplog.clear()
        gone.unlink()
    assert all(len(lines) == 1 for lines in said), said
    assert "(your tuned file)" in said[0][0] and str(user) in said[0][0]
    assert "(shipped for this GPU)" in said[1][0] and f"(shipped for the {H200})" in said[2][0]
    gpu()
    with caplog.at_level(logging.INFO, logger=ops.tuned_log.name):
        assert moe.moe_config(*shape, 1) == moe.default_moe_config(1)
    assert caplog.records[0].levelno == logging.WARNING and "tsdev tune --moe 128,384,2048" in caplog.messages[0]
    # another architecture has no sibling: an A100 never reads the H100's file
    write(moe.moe_config_path(*shape, H100), {"1": entry(64)})
    gpu()
    assert ops.find_tuned("moe_configs", moe.moe_config_stem(*shape), "NVIDIA A100-SXM4-80GB", moe.CONFIG_DIR) is None
    assert ops.find_tuned("moe_configs", moe.moe_config_stem(*shape), H200, moe.CONFIG_DIR).source.endswith(H100)


def test_the_block_gemm_reads_the_siblings_file_too(gpu, tmp_path):
    write(fp8_block.block_gemm_config_path(4096, 4096, H200), {"1": [16, 64, 4, 4], "256": [128, 128, 8]})
    assert fp8_block.block_gemm_config(300, 4096, 4096, "cuda") == (128, 128, 8)
    assert fp8_block.block_gemm_config(300, 4096, 4096, "cpu") == fp8_block.UNTUNED_GEMM


# --- the route to _scaled_mm ---------------------------------------------------------------------


def test_the_route_by_m_follows_the_crossover_else_the_rule_and_tsdev_kernels_forces_a_side(gpu, monkeypatch):
    cuda = torch.device("cuda", 0)
    available = [True]
    monkeypatch.setattr(fp8_block, "scaled_mm_available", lambda device: available[0])
    monkeypatch.setenv("TSDEV_KERNELS", "triton")
    rule = {m: fp8_block.uses_scaled_mm(m, 4096, 4096, cuda) for m in (1, 64, 255, 256, 2048)}
    assert rule == {1: False, 64: False, 255: False, 256: True, 2048: True}  # no crossover: SCALED_MM_MIN_ROWS
    write(fp8_block.block_gemm_config_path(4096, 4096, H100, route=True),
          {"1": dict(triton_us=9.0, scaled_mm_us=13.0), "64": dict(triton_us=20.0, scaled_mm_us=19.0),
           "2048": dict(triton_us=90.0, scaled_mm_us=60.0), "4096": dict(triton_us=150.0, scaled_mm_us=160.0)})
    gpu()
    got = {m: fp8_block.uses_scaled_mm(m, 4096, 4096, cuda) for m in (1, 16, 40, 64, 2048, 5000)}
    assert got == {1: False, 16: False, 40: True, 64: True, 2048: True, 5000: False}
    assert not any(fp8_block.quantizes_inside(m, 4096, 4096, cuda) for m in (1, 64, 2048))  # not measured: two launches
    write(fp8_block.block_gemm_config_path(4096, 4096, H100, route=True),
          {"64": dict(triton_us=20.0, scaled_mm_us=19.0, inside_us=15.0)})
    gpu()
    assert fp8_block.quantizes_inside(64, 4096, 4096, cuda) and not fp8_block.uses_scaled_mm(64, 4096, 4096, cuda)
    write(fp8_block.block_gemm_config_path(4096, 4096, H100, route=True),  # where _scaled_mm could not be timed
          {"64": dict(triton_us=20.0, inside_us=15.0), "2048": dict(triton_us=90.0, inside_us=95.0)})
    gpu()
    assert fp8_block.quantizes_inside(64, 4096, 4096, cuda) and not fp8_block.quantizes_inside(2048, 4096, 4096, cuda)
    assert not any(fp8_block.uses_scaled_mm(m, 4096, 4096, cuda) for m in (64, 2048))
    assert not fp8_block.uses_scaled_mm(2048, 576, 7168, cuda)  # not whole 128-blocks: Triton
    monkeypatch.setenv("TSDEV_KERNELS", "cublas:fp8")
    assert all(fp8_block.uses_scaled_mm(m, 4096, 4096, cuda) for m in (1, 16, 5000))
    monkeypatch.setenv("TSDEV_KERNELS", "triton:fp8")
    assert not any(fp8_block.uses_scaled_mm(m, 4096, 4096, cuda) for m in (64, 2048))
    monkeypatch.setenv("TSDEV_KERNELS", "cublas:fp8")
    available[0] = False  # a torch or GPU without block-scaled _scaled_mm: Triton even when forced
    assert not fp8_block.uses_scaled_mm(2048, 4096, 4096, cuda)
    assert ops.use_fused_triton(type("X", (), {"is_cuda": True})(), "norm", "fp8")  # the pick leaves fusions alone


def test_the_public_op_dispatches_by_the_route_and_keeps_the_reference_on_a_cpu(monkeypatch):
    weight, scale = fp8_block.quantize_fp8_blocks(torch.randn(256, 256))
    x = torch.randn(3, 256)
    monkeypatch.setenv("TSDEV_KERNELS", "triton")
    assert torch.equal(fp8_block.fp8_block_linear(x, weight, scale), fp8_block.fp8_block_linear_ref(x, weight, scale))
    called = []
    monkeypatch.setattr(fp8_block, "use_triton", lambda x, family: True)
    monkeypatch.setattr(fp8_block, "fp8_block_linear_scaled_mm", lambda *a: called.append("cublas"))
    monkeypatch.setattr(fp8_block, "fp8_block_linear_triton", lambda *a: called.append("triton"))
    for route in (True, False):
        monkeypatch.setattr(fp8_block, "uses_scaled_mm", lambda rows, n, k, device, route=route: route)
        fp8_block.fp8_block_linear(x, weight, scale)
        fp8_block.fp8_block_linear(x, weight, scale, bias=torch.zeros(256))  # a bias: Triton (cuBLAS adds none here)
    assert called == ["cublas", "triton", "triton", "triton"]


def test_scaled_mm_gets_the_layouts_cublaslt_checks_and_computes_the_block_gemm_reference(monkeypatch):
    """What PyTorch's ScaledBlas.cpp accepts as DeepSeek-style scales: the activations' [M, K/128] with stride
    (1, M) and M a multiple of 4; the weight's, seen from b.t() = W [N, K], [N/128, K/128] row-major. A fake
    _scaled_mm checks that and computes `fp8_block_gemm_ref`, the product the GPU test compares cuBLAS with."""
    def fake(a, b, scale_a, scale_b, out_dtype):
        m, k = a.shape
        assert m % 4 == 0 and scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)
        assert scale_b.t().shape == (b.shape[1] // 128, k // 128) and scale_b.t().stride() == (k // 128, 1)
        return fp8_block.fp8_block_gemm_ref(a, scale_a, b.t(), scale_b.t()).to(out_dtype)
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    weight, scale = fp8_block.quantize_fp8_blocks(torch.randn(256, 384))
    xq, x_scale = fp8_block.quantize_fp8_token_groups(torch.randn(5, 384))
    got = fp8_block.fp8_block_scaled_mm(xq, x_scale, weight, scale, torch.float32)
    assert got.shape == (5, 256)
    torch.testing.assert_close(got, fp8_block.fp8_block_gemm_ref(xq, x_scale, weight, scale))


# --- the command ---------------------------------------------------------------------------------


def test_tune_help_says_what_how_long_where_and_how_serve_finds_it():
    result = CliRunner().invoke(app, ["tune", "--help"], terminal_width=120)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for needle in ("fused MoE", "block-FP8", "3 minutes per shape", "<cache>/tuned/moe_configs", "--resume",
                   "H100 <-> H200", "says at startup which file serves", "--tp", "--dry-run"):
        assert needle in text, needle


class StubTimer:
    """A deterministic landscape; stops the run (as Ctrl-C does) at its `stop_at`-th timing."""
    gpu = H100

    def __init__(self, stop_at: int | None = None):
        self.calls, self.stop_at, self.buckets = 0, stop_at, []

    def prepare(self, job, tokens, configs):
        pass

    def time(self, job, tokens, config):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        if tokens not in self.buckets:
            self.buckets.append(tokens)
        stages = config.get("num_stages", 3)
        return 10.0 + abs(config["BLOCK_M"] - 8 * (1 + tokens // 64)) + stages / config["num_warps"]

    def crossover(self, job, tokens, config):
        return dict(triton_us=20.0, scaled_mm_us=10.0 + tokens / 100, inside_us=19.0 if tokens < 64 else 21.0)


def test_a_stopped_run_keeps_its_buckets_and_resume_times_only_the_rest(tmp_path, monkeypatch):
    out = tmp_path / "tuned"
    args = ["tune", "--moe", "128,768,2048", "--out", str(out)]
    first = StubTimer(stop_at=60)  # a few buckets in
    monkeypatch.setattr("tsdev.tune_cli.make_timer", lambda jobs, rep: first)
    stopped = CliRunner().invoke(app, args)
    assert stopped.exit_code != 0
    path = out / "moe_configs" / "E=128,I=768,H=2048,dtype=bfloat16,device=NVIDIA_H100_80GB_HBM3.json"
    kept = json.loads(path.read_text())
    assert 0 < len(kept) < 5 and list(kept) == [str(b) for b in first.buckets[:len(kept)]]
    second = StubTimer()
    monkeypatch.setattr("tsdev.tune_cli.make_timer", lambda jobs, rep: second)
    resumed = CliRunner().invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert second.buckets == [b for b in (1, 16, 64, 256, 1024) if str(b) not in kept]
    table = json.loads(path.read_text())
    assert list(table) == ["1", "16", "64", "256", "1024"] and {k: table[k] for k in kept} == kept
    log = [json.loads(line) for line in (out / "tune-log.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in log] == [1, 16, 64, 256, 1024] and all(0 < r["timed"] < r["grid"] for r in log)
    again = StubTimer()
    monkeypatch.setattr("tsdev.tune_cli.make_timer", lambda jobs, rep: again)
    assert CliRunner().invoke(app, [*args, "--resume"]).exit_code == 0 and again.calls == 0


def test_the_gemm_writes_its_configs_and_its_crossover(tmp_path, monkeypatch, gpu):
    monkeypatch.setattr("tsdev.tune_cli.make_timer", lambda jobs, rep: StubTimer())
    result = CliRunner().invoke(app, ["tune", "--gemm", "4096,4096"])  # into the user's cache: what the op reads
    assert result.exit_code == 0, result.output
    gpu()
    configs = json.loads(fp8_block.block_gemm_config_path(4096, 4096, H100, tuned_dir() / "gemm_configs").read_text())
    assert list(configs) == ["1", "4", "16", "64", "256", "1024", "2048", "4096"]
    assert all(len(c) in (3, 4) for c in configs.values())
    assert fp8_block.block_gemm_config(1000, 4096, 4096, "cuda") == tuple(configs["1024"])
    monkeypatch.setattr(fp8_block, "scaled_mm_available", lambda device: True)
    route = [fp8_block.uses_scaled_mm(m, 4096, 4096, torch.device("cuda")) for m in (1, 256, 4096)]
    assert route == [True, True, False]  # the stub's cuBLAS: 10 + M / 100 µs against 20
    inside = [fp8_block.quantizes_inside(m, 4096, 4096, torch.device("cuda")) for m in (16, 64, 1024)]
    assert inside == [True, False, False]  # the stub's GEMM quantizing inside: 19 µs under 64 tokens, else 21


def test_without_cuda_it_refuses_saying_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["tune", "--moe", "8,24,32", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "CUDA GPU" in result.output and "--dry-run" in result.output
    assert not (tmp_path / "moe_configs").exists()
    listed = CliRunner().invoke(app, ["tune", "--model", "qwen3-30b-a3b", "--tp", "2", "--dry-run", "--out",
                                      str(tmp_path)])
    assert listed.exit_code == 0 and "E=128,I=384,H=2048,dtype=bfloat16" in listed.output


def test_a_compile_worker_holds_few_gemm_rows_with_ns_divisibility_by_16():
    """Sixteen compile workers each holding DeepSeek-V3's gate_up weight (36864 x 7168) ran an H100 out of memory."""
    from tsdev.tune_gpu import compile_rows

    for n in (576, 1024, 1536, 7168, 24576, 36864, 1000, 4100):
        rows = compile_rows(n)
        assert rows <= max(n, 1040) and (rows % 16 == 0) == (n % 16 == 0), (n, rows)
    assert compile_rows(36864) * 7168 * 4 < 2**30 / 16


def test_timed_calls_cycle_through_operands_enough_to_miss_the_l2():
    """Serving runs each layer's projection once a step, reading its weights from memory: the timer cycles through
    enough copies (twice the L2) that no call finds them in the L2 the one before filled; one copy of a layer far
    larger than the L2; the bytes counted are the weights' and their scales'."""
    from tsdev.tune import Job
    from tsdev.tune_gpu import copies_past_l2, gemm_inputs, moe_inputs, operand_bytes

    h100_l2 = 50 * 2**20
    assert copies_past_l2(25 * 2**20, h100_l2) == 4  # Qwen3-8B's q|k|v in e4m3
    assert copies_past_l2(264 * 2**20, h100_l2) == 1  # DeepSeek-V3's gate|up
    assert copies_past_l2(1000, h100_l2) == 8  # at most 8
    g = torch.Generator().manual_seed(0)
    gemm = Job("gemm", (256, 384), "small")
    assert operand_bytes(gemm, gemm_inputs(gemm, 4, g)) == 256 * 384 + 2 * 3 * 4  # e4m3 values, float32 scales
    moe = Job("block-fp8", (4, 128, 256, 2), "small")
    want = 4 * (2 * 128 * 256 + 256 * 128) + 4 * 4 * (2 * 2 + 2 * 1)
    assert operand_bytes(moe, moe_inputs(moe, 3, g)) == want


def test_block_fp8_experts_keep_quantizing_inside_only_where_it_was_faster():
    """After the search, the best configuration is timed again with the GEMMs quantizing their own tiles; the file
    says `quantize_inside` only where that was faster (the served layer reads it; without it, two launches)."""
    from tsdev.tune import Job, search_bucket

    class Timer(StubTimer):
        def __init__(self, saves):
            super().__init__()
            self.saves = saves

        def time(self, job, tokens, config):
            return super().time(job, tokens, config) - (self.saves if config.get("quantize_inside") else 0.0)

    job = Job("block-fp8", (8, 256, 512, 2), "small")
    faster, _, _, _ = search_bucket(job, 16, Timer(saves=1.0))
    slower, _, _, _ = search_bucket(job, 16, Timer(saves=-1.0))
    assert faster.get("quantize_inside") is True and "quantize_inside" not in slower
    assert {k: v for k, v in faster.items() if k != "quantize_inside"} == slower
