"""--kv-cache-dtype fp8 on the H200 (pytest -q -m gpu tests/test_fp8_kv_gpu.py): the kernels' store rounds as
torch does, bit for bit; decode and prefill attention over an e4m3 pool match a reference that dequantizes the
same rows, at the default model's shapes in bf16; the default model's logits with an fp8 pool stay within cosine
0.99 of a bf16 pool's at every position of a 2048-token context (the greedy agreement is printed). The pool's
tokens per memory budget: tests/test_kv_cache_dtype.py (a fixed CPU budget; on a GPU other tests move the free
memory a pool is sized to)."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from tsdev_kernels.ops import attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FP8, SCALES = attention.FP8_KV_DTYPE, (0.75, 0.5)
BF16_TOL = dict(atol=1e-2, rtol=2e-2)  # attention.ATTENTION_TOLERANCE's bf16 row


def batch(seq_lens, q_lens, page_size=16, Hq=16, Hk=8, D=128):
    """Random K/V quantized into an e4m3 pool on shuffled pages, bf16 queries for each sequence's last rows."""
    pages = [-(-s // page_size) for s in seq_lens]
    num = sum(pages) + 4
    kc = attention.quantize_kv(torch.randn(num, page_size, Hk, D, device="cuda") * 2, SCALES[0], FP8)
    vc = attention.quantize_kv(torch.randn(num, page_size, Hk, D, device="cuda"), SCALES[1], FP8)
    order = torch.randperm(num).tolist()
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device="cuda")
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(order[:n])
        order = order[n:]
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]), Hq, D, device="cuda", dtype=torch.bfloat16)
    return q, kc, vc, cu, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), table


def test_the_store_rounds_to_e4m3_as_torch_does_bit_for_bit():
    T, Hk, D = 64, 8, 128
    k = torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16) * 50
    k[0, 0, :2] = torch.tensor([1000.0, -1000.0])  # past 448 * 0.75: saturates
    v = torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(8, 16, Hk, D, device="cuda", dtype=FP8)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(128, device="cuda")[:T]
    attention.store_kvcache_triton(k, v, kc, vc, slots, SCALES)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    attention.store_kvcache_ref(k, v, want_k, want_v, slots, SCALES)
    assert torch.equal(kc.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8))
    assert kc.float().abs().max() == 448 and not kc.float().isnan().any()


@pytest.mark.parametrize("B", [1, 64, 139, 256])
def test_decode_over_an_fp8_pool_matches_the_reference_at_mixed_contexts(B):
    seq_lens = torch.randint(100, 2049, (B,)).tolist()
    q, kc, vc, cu, sl, pt = batch(seq_lens, [1] * B)
    got = attention.paged_decode_triton(q, kc, vc, cu, sl, pt, 128**-0.5, kv_scales=SCALES)
    want = attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 128**-0.5, kv_scales=SCALES)
    torch.testing.assert_close(got, want, **BF16_TOL)


def test_prefill_over_an_fp8_pool_matches_the_reference_with_cached_prefixes():
    seq_lens, q_lens = [700, 300, 1500, 64], [700, 100, 37, 1]
    q, kc, vc, cu, sl, pt = batch(seq_lens, q_lens)
    got = attention.paged_prefill_triton(q, kc, vc, cu, sl, pt, 128**-0.5, max(q_lens), kv_scales=SCALES)
    want = attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 128**-0.5, kv_scales=SCALES)
    torch.testing.assert_close(got, want, **BF16_TOL)


def long_context_logits(kv_cache_dtype: str, prompts: list[list[int]], chunk: int, decodes: int) -> torch.Tensor:
    """The default model's logits, for each prompt: at its last row (a prefill in `chunk`-row pieces reading
    the pool), then at each of `decodes` one-row steps feeding the prompt's own next tokens (both pools see the
    same inputs)."""
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine
    from tsdev_runtime.engine.scheduler import ScheduledBatch
    from tsdev_runtime.engine.sequence import SamplingParams, Sequence

    eng = LLMEngine(EngineConfig(model=None, device="cuda", kv_pages=320, max_model_len=4096, max_running=8,
                                 max_batched_tokens=chunk, kv_cache_dtype=kv_cache_dtype))
    if kv_cache_dtype != "auto":
        assert eng.runner.kv_cache.dtype == FP8
    out = []
    for i, prompt in enumerate(prompts):
        body, tail = prompt[:-decodes], prompt[-decodes:]
        seq = Sequence(str(i), list(body), SamplingParams(max_tokens=decodes + 1, temperature=0, ignore_eos=True))
        for start in range(0, len(body), chunk):  # logits at the last piece only (the others sample nothing)
            n = min(chunk, len(body) - start)
            eng.block_manager.allocate(seq, n)
            logits = eng.runner.compute_logits(ScheduledBatch([seq], [n]))
            seq.num_computed_tokens += n
        out.append(logits[0].float().clone())
        for token in tail:
            seq.token_ids.append(token)
            eng.block_manager.allocate(seq, 1)
            out.append(eng.runner.compute_logits(ScheduledBatch([seq], [1]))[0].float().clone())
            seq.num_computed_tokens += 1
        eng.block_manager.free_pages(seq)
    del eng
    torch.cuda.empty_cache()
    return torch.stack(out)


def test_fp8_kv_logits_stay_within_cosine_099_of_bf16_kv_over_a_2048_token_context():
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 150000, (n,), generator=generator).tolist() for n in (512, 1024, 2048)]
    bf16 = long_context_logits("auto", prompts, chunk=256, decodes=24)
    fp8 = long_context_logits("fp8", prompts, chunk=256, decodes=24)
    cos = F.cosine_similarity(fp8, bf16, dim=-1)
    agree = (fp8.argmax(-1) == bf16.argmax(-1)).float().mean().item()
    print(f"fp8 vs bf16 KV, {len(cos)} positions at contexts 488-2048: cosine min {cos.min():.4f} mean "
          f"{cos.mean():.4f}; greedy agreement {agree:.2%}")
    assert cos.min() >= 0.99, cos

