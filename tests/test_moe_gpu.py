"""The fused MoE on the H200 (`pytest -m gpu`): the Triton layer against its torch reference at Qwen3-30B-A3B's layer
shape in bf16 on fresh random routings, the same inside a CUDA graph, and MoE models served with graphs: the
transformers-written tiny Qwen3-MoE equal to transformers in float32, the embedded default-moe graphed equal eager."""
import pytest
import torch

from kernels.ops import moe
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.sequence import SamplingParams

pytestmark = pytest.mark.gpu
E, K, I, H = 128, 8, 768, 2048


def layer_inputs(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") * I**-0.5).bfloat16()
    weights, ids = torch.randn(tokens, E, generator=g, device="cuda").softmax(-1).topk(K, dim=-1)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).float(), ids.int()


@pytest.mark.parametrize("tokens", [1, 5, 16, 64, 256, 1000])
def test_the_triton_layer_equals_the_reference_in_bf16(tokens):
    args = layer_inputs(tokens, tokens)
    ours, ref = moe.fused_moe_triton(*args).float(), moe.fused_moe_ref(*args).float()
    assert ours.isfinite().all() and ref.abs().max() > 0.1
    # bf16 operands, float32 accumulation in both: the two round after each GEMM at the same points, and differ
    # by the summation order of the GEMMs (a few bf16 ulps of a value)
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_the_layer_replays_from_a_cuda_graph_with_new_inputs():
    x, w13, w2, weights, ids = layer_inputs(16, 0)
    moe.fused_moe_triton(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe_triton(x, w13, w2, weights, ids)
    for seed in (1, 2):
        nx, _, _, nweights, nids = layer_inputs(16, seed)
        x.copy_(nx), weights.copy_(nweights), ids.copy_(nids)
        graph.replay()
        assert torch.equal(out, moe.fused_moe_triton(x, w13, w2, weights, ids))


def test_a_transformers_written_qwen3_moe_serves_transformers_greedy_tokens_with_graphs(hf_qwen3_moe_dir):
    import transformers

    prompts = [[5, 17, 300, 42, 9, 77, 123, 4], [200, 201, 202], [(13 * j + 1) % 1000 + 3 for j in range(40)]]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_qwen3_moe_dir, dtype=torch.float32).cuda().eval()
    want = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
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
        engine = LLMEngine(EngineConfig(model="default-moe", device="cuda", kv_pages=256, max_model_len=1024, max_running=8,
                                        enforce_eager=eager))
        out[eager] = [r["token_ids"] for r in engine.generate(prompts, params)]
        del engine
        torch.cuda.empty_cache()
    assert out[False] == out[True] and len(set(out[False][0])) > 2
