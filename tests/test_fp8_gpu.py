"""--quantization fp8 on CUDA (compute capability >= 8.9; run on the H200: pytest -q -m gpu tests/test_fp8_gpu.py):
the Triton weight-only kernels (1-8 rows) and the torch._scaled_mm path (more rows) against their references on
the Qwen3-0.6B projection shapes, the quality gate on the default model's shape in bf16, and decode graphs
with fp8 (including a weight update after capture, which reprocesses into the captured storage)."""
import zlib

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tsdev_kernels.ops import fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (N, K) of q|k|v, o, gate|up, down in Qwen3-0.6B
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
BF16_TOL = dict(atol=1e-2, rtol=1.6e-2)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def fp8_weight(N, K):
    q, s = fp8.quantize_fp8_rows(torch.randn(N, K, device="cuda") / K**0.5 * torch.rand(N, 1, device="cuda").add(0.5))
    return q, s.view(-1)


def test_the_h200_runs_fp8():
    assert fp8.fp8_unsupported_reason("cuda") is None


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("rows", range(1, 9))
def test_weight_only_kernels_match_reference(N, K, rows):
    w, s = fp8_weight(N, K)
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    want = fp8.fp8_weight_only_ref(x, w, s)
    torch.testing.assert_close(fp8.fp8_linear(x, w, s), want, **BF16_TOL)
    kernel = fp8.fp8_gemv_triton if rows == 1 else fp8.fp8_skinny_triton
    torch.testing.assert_close(kernel(x, w, s), want, **BF16_TOL)
    x32 = x.float()
    torch.testing.assert_close(kernel(x32, w, s), fp8.fp8_weight_only_ref(x32, w, s), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("rows", [9, 16, 100, 256, 2048])
def test_scaled_mm_matches_reference(N, K, rows):
    w, s = fp8_weight(N, K)
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    got = fp8.fp8_linear(x, w, s)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
    torch.testing.assert_close(got, fp8.fp8_scaled_mm_ref(x, w, s), **BF16_TOL)
    torch.testing.assert_close(fp8.fp8_scaled_mm(x, w, s), got, atol=0, rtol=0)


def test_reference_families_env_sends_fp8_to_references(monkeypatch):
    monkeypatch.setenv("TSDEV_KERNELS", "ref:fp8")
    w, s = fp8_weight(1024, 1024)
    for rows, ref in ((1, fp8.fp8_weight_only_ref), (4, fp8.fp8_weight_only_ref), (32, fp8.fp8_scaled_mm_ref)):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(fp8.fp8_linear(x, w, s), ref(x, w, s))


def engine(model_dir, quantization, **kw):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(model_dir) if model_dir else None, device="cuda", kv_pages=256,
                                  max_running=16, quantization=quantization, **kw))


@pytest.fixture(scope="module")
def default_shape_dir(tmp_path_factory):
    from tsdev_runtime.weights.default_model import SHAPES as MODEL_SHAPES, write_checkpoint

    out = tmp_path_factory.mktemp("default-shape")
    write_checkpoint(out, {**MODEL_SHAPES["qwen3-0.6b"], "num_hidden_layers": 2, "vocab_size": 4096,
                           "max_position_embeddings": 1024}, seed=3)  # bfloat16
    return out


def test_quality_default_model_shape_bf16(default_shape_dir):
    """The CPU gate (tests/test_fp8.py) in bf16 against bf16: cosine >= 0.98 per position (bf16 rounding adds
    to fp8's; CPU float32 measured >= 0.991), top-1 equal at >= 5 of 7 positions. Eager, to see the kernels."""
    from test_fp8 import prefill_and_decode_logits

    prompt = [(37 * i + 11) % 4000 for i in range(24)]
    ours = prefill_and_decode_logits(engine(default_shape_dir, "fp8", enforce_eager=True), prompt, prompt[:6])
    full = prefill_and_decode_logits(engine(default_shape_dir, None, enforce_eager=True), prompt, prompt[:6])
    cos = F.cosine_similarity(ours.float(), full.float(), dim=-1)
    print("fp8 vs bf16 logits cosine per position:", cos.tolist())
    assert cos.min() >= 0.98, cos
    assert (ours.argmax(-1) == full.argmax(-1)).sum() >= 5


def test_default_model_generates_with_fp8():
    """The full 28-layer default model serves with fp8, graphs on (random weights: no quality bound here)."""
    from tsdev_runtime.engine.sequence import SamplingParams

    eng = engine(None, "fp8", max_model_len=2048)
    out = eng.generate([[5, 17, 300, 42], list(range(100, 141))], SamplingParams(max_tokens=16, temperature=0,
                                                                                  ignore_eos=True))
    assert [len(r["token_ids"]) for r in out] == [16, 16]


def test_decode_graphs_with_fp8_equal_eager_and_follow_weight_updates(tiny_model_dir):
    from batches import decode_batch

    eng = engine(tiny_model_dir, "fp8", dtype="float32", page_size=4, cudagraph_capture_sizes=[1, 4, 8, 16])
    assert set(eng.runner.decode_graphs.graphs) == {1, 4, 8, 16}

    def compare(lengths):
        batch = decode_batch(eng, lengths)
        eager = eng.runner.compute_logits(batch, use_graphs=False).clone()
        graphed = eng.runner.compute_logits(batch).clone()
        for seq in batch.seqs:
            eng.block_manager.free_pages(seq)
        # up to 8 rows: the same Triton kernels, row by row; 12 rows pad to 16: cuBLASLt may pick another
        # algorithm for M=16 than for M=12 (bf16 output of _scaled_mm)
        tol = dict(rtol=1e-4, atol=1e-4) if len(lengths) <= 8 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(graphed, eager, **tol)
        return graphed

    for lengths in ([7], [5, 9, 14], [3, 30, 17, 8, 2, 11], [4 + i for i in range(12)]):
        compare(lengths)
    before = compare([5, 9, 14])
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    tensors = {n: (t * 1.5 if "mlp.down_proj" in n else t) for n, t in tensors.items()}
    eng.runner.weights.load_tensors((n, t.cuda()) for n, t in tensors.items())
    after = compare([5, 9, 14])  # the graphs read the reprocessed weights: they equal eager on the new ones
    assert not torch.allclose(after, before, rtol=1e-3, atol=1e-3)
