"""DeepSeek's multi-head latent attention on the H200 (`pytest -m gpu`): the MLA kernels against their torch reference
at DeepSeek-V3's shapes (128 heads, latent 512, rope 64) on fresh random pages, bf16 and an e4m3 cache, decode with
splits and a mixed prefill step, the same inside a CUDA graph, with each decode kernel (TSDEV_MLA_DECODE: tiles,
flash, gluon -- the last on Hopper only: auto serves it there); the transformers-written tiny DeepSeek-V2 and -V3
served with graphs equal to transformers in float32 (and to themselves eagerly; the tiles or the flash kernel: the
Gluon one takes bf16 and V3's latent widths), a 300-token prompt alone through the expanded form; the drill on V3 with
graphs, 10 rounds, W_UK / W_UV compared, and its negative control (the absorbed tensors rebuilt into new storage)
failing."""
import pytest
import torch
from test_model_families import hf_greedy, hf_model

from tsdev_kernels.ops import mla
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.engine.weights_drill import DrillFailed, drill
from tsdev_runtime.weights.processing import DEBUG_DERIVED_ENV

pytestmark = pytest.mark.gpu
HEADS, LATENT, ROPE = 128, 512, 64
# mla.MLA_DECODE's values: `_mla_kernel`'s decode tiles, mla_decode.py's kernel, mla_decode_gluon.py's (sm_90 only)
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DECODE_KERNELS = ["tiles", "flash", pytest.param("gluon", marks=pytest.mark.skipif(not HOPPER, reason="sm_90 only"))]
PROMPTS = [[5, 17, 300, 42, 9, 77, 123, 4], [200, 201, 202], [(13 * j + 1) % 1000 + 3 for j in range(40)],
           [(7 * j + 5) % 1000 + 3 for j in range(300)]]  # alone, 300 rows: the expanded form (>= 256)


def assert_close_in_bf16(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.isfinite().all() and ref.abs().max() > 0.1
    check = mla.MLA_TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(ours.float(), ref.float(), atol=check.atol, rtol=check.rtol)


def kernel_vs_reference(q_lens, cached, kv_dtype, seed, graph=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, cache, cu, lens, table, rows, slots, order, max_q_len, latent = mla.mla_batch(
        q_lens, cached, HEADS, LATENT, ROPE, 16, torch.bfloat16, "cuda", g, kv_dtype)
    scale = (128 + ROPE) ** -0.5
    ref_cache = cache.clone()
    mla.store_latent_ref(rows, ref_cache, slots)
    want = mla.mla_attention_ref(q, ref_cache, cu, lens, table, scale, latent)
    out = torch.empty_like(want)

    def call():
        mla.mla_attention(q, cache, cu, lens, table, scale, latent, max_q_len=max_q_len, out=out, store=(rows, slots),
                          order=order)
    call()
    if graph:  # captured once, replayed on other lengths as serving replays decode graphs
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            call()
        lens.sub_(torch.randint(0, 8, lens.shape, device="cuda", generator=g).int().clamp(max=lens - 1))
        ref_cache = cache.clone()
        want = mla.mla_attention_ref(q, ref_cache, cu, lens, table, scale, latent)
        captured.replay()
    assert torch.equal(cache.float(), ref_cache.float())
    assert_close_in_bf16(out, want)


@pytest.mark.parametrize("decode_kernel", DECODE_KERNELS)
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_decode_equals_the_reference_at_deepseek_v3_shapes(batch, kv_dtype, decode_kernel, monkeypatch):
    monkeypatch.setattr(mla, "MLA_DECODE", decode_kernel)
    g = torch.Generator().manual_seed(batch)
    kernel_vs_reference([1] * batch, torch.randint(0, 1024, (batch,), generator=g).tolist(), kv_dtype, batch)


@pytest.mark.parametrize("decode_kernel", DECODE_KERNELS)
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_a_mixed_prefill_step_equals_the_reference(kv_dtype, decode_kernel, monkeypatch):
    monkeypatch.setattr(mla, "MLA_DECODE", decode_kernel)
    kernel_vs_reference([300, 77, 1, 1], [500, 0, 90, 2000], kv_dtype, 5)


@pytest.mark.parametrize("decode_kernel", DECODE_KERNELS)
def test_decode_replayed_from_a_cuda_graph_on_other_lengths_equals_the_reference(decode_kernel, monkeypatch):
    monkeypatch.setattr(mla, "MLA_DECODE", decode_kernel)
    kernel_vs_reference([1] * 8, [100, 900, 3, 64, 2000, 17, 512, 33], None, 8, graph=True)


@pytest.mark.parametrize("decode_kernel", ["tiles", "flash"])
@pytest.mark.parametrize("fixture", ["hf_deepseek_v2_dir", "hf_deepseek_v3_dir"])
def test_transformers_written_deepseeks_serve_transformers_greedy_tokens_with_graphs(fixture, decode_kernel, request,
                                                                                     monkeypatch):
    monkeypatch.setattr(mla, "MLA_DECODE", decode_kernel)

    model_dir = request.getfixturevalue(fixture)
    model = hf_model(model_dir).cuda()
    want = [hf_greedy(model, p, 12) for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for eager in (False, True):
        engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", kv_pages=256,
                                        cudagraph_capture_sizes=[1, 2, 4], enforce_eager=eager))
        assert (engine.runner.decode_graphs is None) == eager
        assert [r["token_ids"] for r in engine.generate(PROMPTS, params)] == want, f"eager={eager}"
        assert engine.generate(PROMPTS[-1:], params)[0]["token_ids"] == want[-1]  # alone: expanded
        del engine


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel runs on sm_90 only")
def test_auto_serves_v3s_decode_steps_with_the_gluon_kernel_on_hopper(monkeypatch):
    """TSDEV_MLA_DECODE=auto (the default) takes the Gluon kernel for V3's bf16 and e4m3 decode steps, the Triton
    flash kernel for a float32 model and for 16 heads (a tensor-parallel rank of V3: most of a 64-row tile empty)."""
    monkeypatch.setattr(mla, "MLA_DECODE", "auto")
    for heads, dtype, kv_dtype, want in ((HEADS, torch.bfloat16, None, mla.mla_decode_gluon),
                                         (HEADS, torch.bfloat16, torch.float8_e4m3fn, mla.mla_decode_gluon),
                                         (HEADS, torch.float32, None, mla.mla_decode_triton),
                                         (16, torch.bfloat16, None, mla.mla_decode_triton)):
        q = torch.zeros(1, heads, LATENT + ROPE, dtype=dtype, device="cuda")
        cache = torch.zeros(1, 16, 1, LATENT + ROPE, dtype=kv_dtype or dtype, device="cuda")
        assert mla.decode_kernel(q, cache, LATENT) is want, (heads, dtype, kv_dtype)


def test_the_mla_drill_holds_ten_rounds_with_graphs_and_catches_rebuilt_absorbed_tensors(hf_deepseek_v3_dir,
                                                                                         monkeypatch):
    """The MLA half of the seed's post-sleep failure: W_UK / W_UV derived from kv_b_proj must be refreshed in the
    memory the captured graphs read. Ten rounds of sleep(2) -> wake -> reload_weights with graphs, every tensor equal
    to the fresh load and greedy output unchanged; then the reload that derives them into new storage must fail."""
    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(hf_deepseek_v3_dir), device="cuda", dtype="bfloat16", kv_pages=256,
                                      cudagraph_capture_sizes=[1, 2, 4]))

    served = engine()
    assert served.runner.decode_graphs is not None
    report = drill(served, rounds=10)
    print(f"\n{report}")
    assert report.mode == "graphs" and all(len(times) == 10 for times in report.seconds.values())
    del served
    monkeypatch.setenv(DEBUG_DERIVED_ENV, "rebuild")
    with pytest.raises(DrillFailed, match="w_uk"):
        drill(engine(), rounds=1)


def test_an_fp8_latent_cache_keeps_the_logits_within_cosine_099_of_bf16(hf_deepseek_v3_dir):
    """--kv-cache-dtype fp8 on a DeepSeek model: each latent row stored as e4m3 (scale 1), read by the MLA kernels."""
    import torch.nn.functional as F
    from test_model_families import teacher_forced_logits

    prompt, feed = [(13 * j + 1) % 1000 + 3 for j in range(200)], [5, 17, 300, 42, 9, 77, 123, 4]
    logits = {}
    for kv in ("auto", "fp8"):
        engine = LLMEngine(EngineConfig(model=str(hf_deepseek_v3_dir), device="cuda", dtype="bfloat16", kv_pages=256,
                                        kv_cache_dtype=kv, cudagraph_capture_sizes=[1, 2, 4]))
        assert (engine.runner.kv_cache.dtype == torch.float8_e4m3fn) == (kv == "fp8")
        logits[kv] = teacher_forced_logits(engine, prompt, feed).float()
        del engine
    cos = F.cosine_similarity(logits["fp8"], logits["auto"], dim=-1)
    print(f"\nfp8 vs bf16 latent cache: cosine min {cos.min():.4f} mean {cos.mean():.4f}")
    assert cos.min() >= 0.99, cos
