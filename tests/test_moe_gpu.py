"""The fused MoE on the H200 (`pytest -m gpu`): the Triton layer against its torch reference at Qwen3-30B-A3B's layer
shape in bf16 on fresh random routings (the GEMV path of a few tokens and the aligned GEMMs; bf16 and FP8 experts),
the same inside a CUDA graph, and MoE models served with graphs: the transformers-written tiny Qwen3-MoE equal to
transformers in float32, the embedded default-moe graphed equal eager, and its FP8 weights drill (10 rounds of
sleep(2) -> wake -> reload_weights with graphs) with the negative control that rebuilds the kernel configuration."""
import pytest
import torch
from test_model_families import hf_greedy, hf_model

from tsdev_kernels.ops import fp8, moe
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.engine.weights_drill import DrillFailed, drill
from tsdev_runtime.weights.processing import DEBUG_DERIVED_ENV

pytestmark = pytest.mark.gpu
E, K, I, H = 128, 8, 768, 2048


def layer_inputs(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") * I**-0.5).bfloat16()
    weights, ids = torch.randn(tokens, E, generator=g, device="cuda").softmax(-1).topk(K, dim=-1)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).float(), ids.int()


def assert_close_in_bf16(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.isfinite().all() and ref.abs().max() > 0.1
    # bf16 operands, float32 accumulation in both: the two round after each GEMM at the same points, and differ
    # by the summation order of the GEMMs (a few bf16 ulps of a value)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("tokens", [1, 2, 4, 5, 16, 64, 256, 1000])
def test_the_triton_layer_equals_the_reference_in_bf16(tokens):
    args = layer_inputs(tokens, tokens)
    assert_close_in_bf16(moe.fused_moe_triton(*args), moe.fused_moe_ref(*args))
    if tokens <= moe.GEMV_MAX_TOKENS:  # the aligned GEMMs too, which more tokens take
        config = moe.moe_config(E, I, H, torch.bfloat16, tokens)
        assert_close_in_bf16(moe.fused_moe_triton(*args, config=config), moe.fused_moe_ref(*args))


@pytest.mark.parametrize("tokens", [1, 3, 16, 256])
def test_fp8_experts_equal_their_reference_in_bf16(tokens):
    x, w13, w2, weights, ids = layer_inputs(tokens, 100 + tokens)
    (q13, s13), (q2, s2) = fp8.quantize_fp8_rows(w13), fp8.quantize_fp8_rows(w2)
    args, scales = (x, q13, q2, weights, ids), dict(w13_scale=s13.squeeze(-1), w2_scale=s2.squeeze(-1))
    ref = moe.fused_moe_ref(*args, **scales)
    assert_close_in_bf16(moe.fused_moe_triton(*args, **scales), ref)
    assert (ref.float() - moe.fused_moe_ref(x, w13, w2, weights, ids).float()).abs().max() > 0  # quantized


@pytest.mark.parametrize("block_m", [16, 64], ids=["mma", "wgmma"])
@pytest.mark.parametrize("tokens", [64, 256])
def test_w8a8_experts_keep_a_float32_sum_on_the_fp8_tensor_cores(tokens, block_m):
    """The aligned GEMMs multiply e4m3 tiles; Hopper's FP8 wgmma (BLOCK_M 64) sums with reduced precision unless each
    tile is converted to bf16 first (exact): 2e-2 relative error before, a bf16 rounding's
    few 1e-3 now (the bf16 layer's own error against its reference: 2-3e-3)."""
    x, w13, w2, weights, ids = layer_inputs(tokens, 7 + tokens)
    (q13, s13), (q2, s2) = fp8.quantize_fp8_rows(w13), fp8.quantize_fp8_rows(w2)
    scales = dict(w13_scale=s13.squeeze(-1), w2_scale=s2.squeeze(-1))
    config = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    ours = moe.fused_moe_triton(x, q13, q2, weights, ids, config=config, **scales).float()
    ref = moe.fused_moe_ref(x, q13, q2, weights, ids, **scales, w8a8=True).float()
    assert (ours - ref).abs().max() / ref.abs().max() < 6e-3


def test_the_row_quantizer_kernel_is_torchs_bit_for_bit():
    """W8A8's activation rows (x per token, the SiLU's output per slot): one launch, torch's arithmetic exactly."""
    g = torch.Generator(device="cuda").manual_seed(3)
    for rows, k in ((1, 2048), (64, 768), (300, 7168)):
        t = (torch.randn(rows, k, generator=g, device="cuda") * 5).bfloat16()
        t[0] = 0
        q, scales = fp8.quantize_fp8_rows_triton(t)
        want_q, want_scales = fp8.quantize_fp8_rows(t)
        assert torch.equal(scales, want_scales.squeeze(-1)) and scales[0] == 1
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("tokens", [1, 16])
def test_the_layer_replays_from_a_cuda_graph_with_new_inputs(tokens):
    x, w13, w2, weights, ids = layer_inputs(tokens, 0)
    moe.fused_moe_triton(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe_triton(x, w13, w2, weights, ids)
    for seed in (1, 2):
        nx, _, _, nweights, nids = layer_inputs(tokens, seed)
        x.copy_(nx), weights.copy_(nweights), ids.copy_(nids)
        graph.replay()
        assert torch.equal(out, moe.fused_moe_triton(x, w13, w2, weights, ids))


def test_a_transformers_written_qwen3_moe_serves_transformers_greedy_tokens_with_graphs(hf_qwen3_moe_dir):

    prompts = [[5, 17, 300, 42, 9, 77, 123, 4], [200, 201, 202], [(13 * j + 1) % 1000 + 3 for j in range(40)]]
    model = hf_model(hf_qwen3_moe_dir).cuda()
    want = [hf_greedy(model, p, 12) for p in prompts]
    engine = LLMEngine(EngineConfig(model=str(hf_qwen3_moe_dir), device="cuda", dtype="float32", kv_pages=256,
                                    cudagraph_capture_sizes=[1, 2, 4]))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert engine.runner.decode_graphs is not None
    assert [r["token_ids"] for r in engine.generate(prompts, params)] == want


def test_the_embedded_moe_default_graphed_generates_what_it_generates_eagerly():
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 300, 42, 9, 77, 123, 4], list(range(100, 160))]
    out = {}
    for eager in (False, True):
        engine = LLMEngine(EngineConfig(model="default-moe", device="cuda", kv_pages=256, max_model_len=1024,
                                        max_running=8, enforce_eager=eager))
        out[eager] = [r["token_ids"] for r in engine.generate(prompts, params)]
        del engine
        torch.cuda.empty_cache()
    assert out[False] == out[True] and len(set(out[False][0])) > 2


def test_the_fp8_moe_drill_holds_ten_rounds_with_graphs_and_catches_a_rebuilt_configuration(monkeypatch):
    """Issue 30's failure, reproduced and ruled out: after sleep(2) + reload_weights an FP8 MoE whose kernel
    configuration was rebuilt (not refreshed) serves graphs reading the old tensors. Ten rounds with every tensor
    (the experts' e4m3 weights and scales too) equal to the fresh load and greedy output unchanged; then the same
    drill with TSDEV_DEBUG_DERIVED=rebuild must fail."""
    def fp8_moe() -> LLMEngine:
        return LLMEngine(EngineConfig(model="default-moe", device="cuda", kv_pages=1024, max_model_len=1024,
                                      max_running=16, quantization="fp8"))

    engine = fp8_moe()
    assert engine.runner.decode_graphs is not None and engine.runner.model.model.layers[0].mlp.experts.fp8 is not None
    weights_bytes = sum(t.numel() * t.element_size() for t in engine.runner.model.parameters())
    report = drill(engine, rounds=10)
    print(f"\n{report}")
    assert report.mode == "graphs" and all(len(times) == 10 for times in report.seconds.values())
    assert len(report.freed_bytes) == 10 and min(report.freed_bytes) >= weights_bytes  # each sleep freed the weights
    del engine
    monkeypatch.setenv(DEBUG_DERIVED_ENV, "rebuild")
    with pytest.raises(DrillFailed, match="fp8_w"):
        drill(fp8_moe(), rounds=1)
