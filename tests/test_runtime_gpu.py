"""The runtime on CUDA (run on the H200: `pytest -m gpu`)."""
import pytest
import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42, 9, 77, 123, 4, 8, 15, 16, 23, 42, 99, 512, 7, 3], [200, 201, 202], list(range(100, 141))]


def test_cuda_float32_gives_the_cpu_tokens(tiny_model_dir):
    cpu = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", kv_pages=256)).generate(PROMPTS, GREEDY)
    cuda = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32", kv_pages=256))
    assert [r["token_ids"] for r in cuda.generate(PROMPTS, GREEDY)] == [r["token_ids"] for r in cpu]


def test_default_model_on_cuda_has_the_qwen3_0_6b_shape_and_generates():
    engine = LLMEngine(EngineConfig(model=None, device="cuda", max_running=8, max_model_len=2048))
    c = engine.model_config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (28, 1024, 151936)
    assert engine.runner.dtype == torch.bfloat16
    out = engine.generate(PROMPTS, [GREEDY, SamplingParams(max_tokens=16, temperature=0.7, seed=3, ignore_eos=True),
                                    GREEDY])
    assert [len(r["token_ids"]) for r in out] == [16, 16, 16]
    assert all(0 <= t < c.vocab_size for r in out for t in r["token_ids"])
    assert engine.block_manager.num_used_pages == 0


def test_graph_replay_equals_eager_on_cuda(tiny_model_dir):
    from batches import decode_batch

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32", kv_pages=256,
                                    page_size=4, cudagraph_capture_sizes=[1, 4, 8]))
    assert set(engine.runner.decode_graphs.graphs) == {1, 4, 8}
    for lengths in ([7], [5, 9, 14], [3, 30, 17, 8, 2, 11]):
        batch = decode_batch(engine, lengths)
        eager = engine.runner.compute_logits(batch, use_graphs=False).clone()
        graphed = engine.runner.compute_logits(batch).clone()
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
        for seq in batch.seqs:
            engine.block_manager.free_pages(seq)


def test_decode_graphs_run_eagerly_under_other_kernel_settings(tiny_model_dir, monkeypatch):
    from batches import decode_batch

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32", kv_pages=256,
                                    cudagraph_capture_sizes=[1, 4]))
    batch = decode_batch(engine, [5, 9, 3])
    graphed = engine.runner.compute_logits(batch).clone()

    def replay():
        raise AssertionError("replayed a graph captured with the Triton kernels under TSDEV_KERNELS=ref")

    for graph in engine.runner.decode_graphs.graphs.values():
        monkeypatch.setattr(graph, "replay", replay)
    monkeypatch.setenv("TSDEV_KERNELS", "ref")
    torch.testing.assert_close(engine.runner.compute_logits(batch), graphed, rtol=1e-4, atol=1e-4)


def test_greedy_on_cuda_matches_transformers(tiny_model_dir):
    import transformers

    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    expected = []
    for prompt in PROMPTS:
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32", kv_pages=256))
    assert [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)] == expected


def test_no_sampling_kernel_compiles_while_serving():
    """The warm-up compiles every sampling kernel binary a request can pick (top-k's one per candidate block)."""
    from tsdev_kernels.ops import sampling

    def binaries():
        return {name: sum(len(cache[0]) for cache in kernel.device_caches.values())
                for name, kernel in vars(sampling).items() if hasattr(kernel, "device_caches")}

    engine = LLMEngine(EngineConfig(model=None, device="cuda", max_running=8, max_model_len=2048))
    compiled = binaries()
    assert compiled["_candidates_kernel"] == len(sampling.candidate_blocks(1024)) and compiled["_race_kernel"] >= 1
    filters = [(1, 1.0), (7, 1.0), (50, 0.95), (333, 1.0), (1000, 0.5), (0, 0.9), (0, 1.0), (20, 0.8)]
    params = [SamplingParams(max_tokens=4, temperature=0.8, top_k=k, top_p=p, seed=i, ignore_eos=True)
              for i, (k, p) in enumerate(filters)]
    out = engine.generate([PROMPTS[i % 3] for i in range(len(params))], params)
    assert [len(r["token_ids"]) for r in out] == [4] * len(params)
    assert binaries() == compiled


@pytest.mark.parametrize("rows", [4, 64])
def test_lm_head_float32_logits_for_many_rows_come_unrounded_from_cublas(rows):
    """Above the skinny kernel's rows, bf16 logits are written as float32 by the GEMM itself (no bf16 rounding
    in between): closer to a float32 reference than bf16 logits can be; at few rows they are bf16 converted."""
    from tsdev_runtime.context import Context, step_context
    from tsdev_runtime.layers.embedding import LMHead

    vocab, hidden_size = 151936, 1024
    head = LMHead(vocab, hidden_size).cuda().to(torch.bfloat16)
    head.weight.normal_(0, 0.05)
    hidden = torch.randn(rows + 3, hidden_size, device="cuda", dtype=torch.bfloat16)
    indices = torch.arange(3, rows + 3, device="cuda")
    with step_context(Context(None, None, None, None, indices, 1)):
        out = torch.full((rows, vocab), float("nan"), device="cuda")
        written = head(hidden, out=out)
        fresh = head(hidden)
    assert written.data_ptr() == out.data_ptr() and written.dtype == fresh.dtype == torch.float32
    torch.testing.assert_close(written, fresh, rtol=0, atol=0)
    reference = hidden[3:].float() @ head.weight.float().t()
    error = (written - reference).abs().max().item()
    rounded = (reference.bfloat16().float() - reference).abs().max().item()  # what bf16 logits cannot avoid
    if rows > 8:
        assert error < rounded / 4, (error, rounded)
    else:
        assert error <= rounded * 2, (error, rounded)
