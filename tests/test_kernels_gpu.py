"""Every Triton kernel against its torch reference on CUDA: bf16 and fp32, Qwen3-0.6B shapes (hidden 1024,
16 q / 8 kv heads, head_dim 128, intermediate 3072, vocab 151936), batch 1..256, context up to 4096,
page sizes 16 and 24, through the public ops (which pick Triton on CUDA) and through CUDA graphs.

Run on the H200: python3 -m pytest -q -m gpu tests/test_kernels_gpu.py
"""
import itertools
import zlib

import pytest
import torch

from tsdev_kernels.ops import activation, attention, linear, norm, rope, sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.bfloat16, torch.float32]
HQ, HK, D, HIDDEN, INTER, VOCAB = 16, 8, 128, 1024, 3072, 151936


def tol(dtype, loose=False):
    if dtype == torch.float32:
        return dict(atol=1e-4, rtol=1e-4) if loose else dict(atol=1e-5, rtol=1e-5)
    return dict(atol=2e-2, rtol=2e-2) if loose else dict(atol=1e-2, rtol=1.6e-2)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))  # the same seed in every run (str hash is not)


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def fused_qkv(T, dtype):
    qkv = rand(T, (HQ + 2 * HK) * D, dtype=dtype)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    return q.view(T, HQ, D), k.view(T, HK, D), v.view(T, HK, D)


# --- elementwise / row ops --------------------------------------------------------------------------


@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, HIDDEN), (37, HIDDEN), (256, HIDDEN), (4096, HIDDEN), (1000, 4096), (3, 96)])
def test_rms_norm_and_fused_add(dtype, T, N, gluon):
    x, r, w = rand(T, N, dtype=dtype), rand(T, N, dtype=dtype), rand(N, dtype=dtype)
    torch.testing.assert_close(norm.rms_norm_triton(x, w, 1e-6, gluon=gluon), norm.rms_norm_ref(x, w, 1e-6),
                               **tol(dtype))
    out, res = norm.rms_norm_triton(x, w, 1e-6, r, gluon=gluon)
    ref_out, ref_res = norm.fused_add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, **tol(dtype))


@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_heads(dtype, gluon):
    q, _, _ = fused_qkv(77, dtype)
    w = rand(D, dtype=dtype)
    torch.testing.assert_close(norm.rms_norm_triton(q, w, 1e-6, gluon=gluon), norm.rms_norm_ref(q, w, 1e-6),
                               **tol(dtype))


def test_tsdev_kernels_gluon_norm_serves_the_gluon_kernel(monkeypatch):
    x, w = rand(64, HIDDEN), rand(HIDDEN)
    monkeypatch.setenv("TSDEV_KERNELS", "gluon:norm")
    norm.rms_norm(x, w, 1e-6)
    torch.cuda.synchronize()
    assert norm._rms_norm_gluon_kernel.device_caches[x.device.index or 0][0]  # compiled and launched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 37, 2048])
def test_rope_and_qk_norm_rope(dtype, T):
    q, k, _ = fused_qkv(T, dtype)
    cache = rope.rope_cos_sin_cache(D, 40960, 1e6).cuda()
    positions = torch.randint(0, 40960, (T,), device="cuda")
    for got, want in zip(rope.apply_rope(q, k, positions, cache), rope.apply_rope_ref(q, k, positions, cache)):
        torch.testing.assert_close(got, want, **tol(dtype))
    qw, kw = rand(D, dtype=dtype), rand(D, dtype=dtype)
    got = rope.qk_norm_rope(q, k, qw, kw, 1e-6, positions, cache)
    want = rope.qk_norm_rope_ref(q, k, qw, kw, 1e-6, positions, cache)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol(dtype, loose=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 37, 4096])
def test_silu_and_mul(dtype, T):
    x = rand(T, 2 * INTER, dtype=dtype, scale=3)
    torch.testing.assert_close(activation.silu_and_mul(x), activation.silu_and_mul_ref(x), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [((HQ + 2 * HK) * D, HIDDEN), (HIDDEN, HQ * D), (2 * INTER, HIDDEN),
                                 (HIDDEN, INTER), (VOCAB, HIDDEN), (37, 77)])
def test_linear_picks_gemv_skinny_or_cublas_by_rows(dtype, N, K, monkeypatch):
    w, b = rand(N, K, dtype=dtype, scale=K ** -0.5), rand(N, dtype=dtype)
    calls = []
    for name in ("gemv_triton", "skinny_triton"):
        kernel = getattr(linear, name)
        monkeypatch.setattr(linear, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    for rows, kernel in ((1, "gemv_triton"), (2, "skinny_triton"), (5, "skinny_triton"), (8, "skinny_triton"),
                         (9, None), (64, None)):
        x = rand(rows, K, dtype=dtype)
        for bias in (None, b):
            calls.clear()
            torch.testing.assert_close(linear.linear(x, w, bias), linear.linear_ref(x, w, bias), **tol(dtype))
            assert calls == ([kernel] if kernel else []), (rows, calls)
    monkeypatch.setenv("TSDEV_KERNELS", "ref:linear")
    calls.clear()
    x = rand(1, K, dtype=dtype)
    assert torch.equal(linear.linear(x, w), linear.linear_ref(x, w)) and calls == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_gemv_with_norm_and_activation(dtype, gated, residual):
    """The one-row GEMV that normalises its input (and applies SwiGLU's activation to a gate|up output) against
    the torch references, and against the separate kernels one after another."""
    N = INTER if gated else (HQ + 2 * HK) * D
    x, nw, w = (rand(1, HIDDEN, dtype=dtype), rand(HIDDEN, dtype=dtype),
                rand(2 * N if gated else N, HIDDEN, dtype=dtype, scale=HIDDEN ** -0.5))
    r = rand(1, HIDDEN, dtype=dtype) if residual else None
    y, res = linear.gemv_triton(x, w, residual=r, norm_weight=nw, eps=1e-6, gated=gated)
    normed, want_res = norm.fused_add_rms_norm_ref(x, r, nw, 1e-6) if residual else (norm.rms_norm_ref(x, nw, 1e-6), x)
    ref = linear.linear_ref(normed, w)
    torch.testing.assert_close(y, activation.silu_and_mul_ref(ref) if gated else ref, **tol(dtype, loose=True))
    assert torch.equal(res, want_res)
    separate = linear.gemv_triton(norm.rms_norm_triton(x, nw, 1e-6, r)[0] if residual
                                  else norm.rms_norm_triton(x, nw, 1e-6), w)
    torch.testing.assert_close(y, activation.silu_and_mul_triton(separate) if gated else separate, **tol(dtype))


def test_a_pdl_chain_in_a_graph_computes_what_it_computes_without_pdl(monkeypatch):
    """28 layers of the batch-1 decode kernels, each reading what the one before wrote (and the KV cache the
    layer's store wrote), captured in a CUDA graph: launched with programmatic dependent launch, where a
    kernel starts before the one before it ends, the result is bit-identical to launching without it."""
    dt, layers = torch.bfloat16, 28
    q, kc, vc, cu, sl, pt = paged_batch([512], [1], 16, dt)
    slots = (pt[0, 31].long() * 16 + 15).view(1)  # the sequence's last slot
    cache = rope.rope_cos_sin_cache(D, 1024, 1e6).cuda()
    weights = [dict(qkv=rand((HQ + 2 * HK) * D, HIDDEN, dtype=dt, scale=HIDDEN ** -0.5),
                    o=rand(HIDDEN, HQ * D, dtype=dt, scale=0.1),
                    gate_up=rand(2 * INTER, HIDDEN, dtype=dt, scale=HIDDEN ** -0.5),
                    down=rand(HIDDEN, INTER, dtype=dt, scale=0.1),
                    n1=rand(HIDDEN, dtype=dt), n2=rand(HIDDEN, dtype=dt), qn=rand(D, dtype=dt), kn=rand(D, dtype=dt))
               for _ in range(layers)]
    x, pos = rand(1, HIDDEN, dtype=dt), torch.tensor([511], device="cuda")

    def step():
        hidden, residual = x, None
        for w in weights:
            qkv, residual = linear.gemv_triton(hidden, w["qkv"], residual=residual, norm_weight=w["n1"], eps=1e-6)
            qq, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
            qq, k = rope.qk_norm_rope(qq.view(1, HQ, D), k.view(1, HK, D), w["qn"], w["kn"], 1e-6, pos, cache)
            o = attention.paged_attention(qq, kc, vc, cu, sl, pt, D**-0.5, max_q_len=1,
                                          store=(k, v.view(1, HK, D), slots))
            hidden = linear.linear(o.flatten(1), w["o"])
            act, residual = linear.gemv_triton(hidden, w["gate_up"], residual=residual, norm_weight=w["n2"], eps=1e-6,
                                               gated=True)
            hidden = linear.linear(act, w["down"])
        return norm.rms_norm(hidden + residual, weights[0]["n1"], 1e-6)

    outs = {}
    start_k, start_v = kc.clone(), vc.clone()
    for flag in ("0", "1"):
        monkeypatch.setenv("TSDEV_PDL", flag)
        kc.copy_(start_k), vc.copy_(start_v)
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        replays = []
        for _ in range(3):
            kc.copy_(start_k), vc.copy_(start_v)
            graph.replay()
            replays.append(out.clone())
        assert all(torch.equal(r, replays[0]) for r in replays)
        outs[flag] = replays[0]
    assert outs["1"].float().std() > 0.1 and torch.equal(outs["1"], outs["0"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 24])
def test_store_kvcache(dtype, page_size):
    T, pages = 300, 64
    _, k, v = fused_qkv(T, dtype)
    k_cache, v_cache = rand(pages, page_size, HK, D, dtype=dtype), rand(pages, page_size, HK, D, dtype=dtype)
    slots = torch.randperm(pages * page_size, device="cuda")[:T]
    slots[::7] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    attention.store_kvcache(k, v, k_cache, v_cache, slots)
    attention.store_kvcache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# --- attention --------------------------------------------------------------------------------------


def paged_batch(seq_lens, q_lens, page_size, dtype, spare_pages=4):
    pages_per_seq = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    k_cache = rand(num_pages, page_size, HK, D, dtype=dtype)
    v_cache = rand(num_pages, page_size, HK, D, dtype=dtype)
    order = torch.randperm(num_pages).tolist()
    table = torch.zeros(len(seq_lens), max(pages_per_seq) + 2, dtype=torch.int32)
    for i, n in enumerate(pages_per_seq):
        table[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    q = rand(int(cu[-1]), HQ, D, dtype=dtype)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), table.cuda()


DECODE_CASES = {
    "b1-ctx512": [512], "b1-ctx4096": [4096], "b1-ctx1": [1], "b8-mixed": [1, 17, 100, 511, 512, 513, 2000, 4096],
    "b64-ctx512": [512] * 64, "b256-random": None,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 24])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_attention(case, page_size, dtype):
    seq_lens = DECODE_CASES[case] or torch.randint(1, 1500, (256,)).tolist()
    q, kc, vc, cu, sl, pt = paged_batch(seq_lens, [1] * len(seq_lens), page_size, dtype)
    got = attention.paged_attention(q, kc, vc, cu, sl, pt, D**-0.5, max_q_len=1)
    torch.testing.assert_close(got, attention.paged_attention_ref(q, kc, vc, cu, sl, pt, D**-0.5),
                               **tol(dtype, loose=True))
    # with this step's keys and values stored by the kernel itself (one row a padding row: slot -1)
    k, v = rand(len(seq_lens), HK, D, dtype=dtype), rand(len(seq_lens), HK, D, dtype=dtype)
    last = (sl.long() - 1)
    slots = pt[torch.arange(len(seq_lens), device="cuda"), last // page_size].long() * page_size + last % page_size
    slots[len(seq_lens) // 2] = -1
    want_k, want_v = kc.clone(), vc.clone()
    attention.store_kvcache_ref(k, v, want_k, want_v, slots)
    want = attention.paged_attention_ref(q, want_k, want_v, cu, sl, pt, D**-0.5)
    got = attention.paged_attention(q, kc, vc, cu, sl, pt, D**-0.5, max_q_len=1, store=(k, v, slots))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    torch.testing.assert_close(got, want, **tol(dtype, loose=True))


PREFILL_CASES = {
    "one-2048": ([2048], [2048]),
    "cached-prefixes": ([1024 + 300, 4096, 77, 700], [300, 1000, 77, 1]),
    "mixed-with-decodes": ([5, 900, 901, 64, 3000, 129], [5, 1, 1, 64, 31, 1]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 24])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_attention(case, page_size, dtype):
    seq_lens, q_lens = PREFILL_CASES[case]
    q, kc, vc, cu, sl, pt = paged_batch(seq_lens, q_lens, page_size, dtype)
    got = attention.paged_attention(q, kc, vc, cu, sl, pt, D**-0.5, max_q_len=max(q_lens))
    torch.testing.assert_close(got, attention.paged_attention_ref(q, kc, vc, cu, sl, pt, D**-0.5),
                               **tol(dtype, loose=True))
    # without the host hints the op finds max_q_len itself (one sync) and agrees
    torch.testing.assert_close(attention.paged_attention(q, kc, vc, cu, sl, pt, D**-0.5), got, atol=0, rtol=0)


def test_decode_graph_replays_with_new_lengths_and_pages():
    """Capture once, replay with other seq_lens / page tables written in place."""
    B, page_size, max_len = 8, 16, 4096
    q, kc, vc, cu, sl, pt = paged_batch([4096] * B, [1] * B, page_size, torch.bfloat16)
    run = lambda: attention.paged_attention(q, kc, vc, cu, sl, pt, D**-0.5, max_q_len=1)
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(10):
        sl.copy_(torch.randint(1, max_len + 1, (B,), device="cuda", dtype=torch.int32))
        pt.copy_(pt[torch.randperm(B, device="cuda")])
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.testing.assert_close(out, attention.paged_attention_ref(q, kc, vc, cu, sl, pt, D**-0.5), **tol(q.dtype))
    # the splits' arrival counters are zero again after every launch (the last split of each head resets its own)
    assert not attention.split_arrivals(q.device, B * HK).any()


# --- sampling ---------------------------------------------------------------------------------------


def sampling_batch(S, greedy_every=4):
    logits = rand(S, VOCAB, scale=3)
    temps = torch.rand(S, device="cuda") * 1.5 + 0.1
    temps[::greedy_every] = 0
    seeds = torch.randint(-(2**62), 2**62, (S,), device="cuda")
    return logits, temps, seeds


def reference(logits, temps, top_ks, top_ps, seeds):
    noise = sampling.exponential_noise(seeds, torch.arange(logits.shape[1], device=logits.device))
    return sampling.sample_ref(logits, temps, top_ks, top_ps, noise)


@pytest.mark.parametrize("S", [1, 7, 256])
def test_penalties_and_logprobs_match_reference(S):
    logits = rand(S, VOCAB, scale=3)
    slots = torch.randint(0, 300, (S,), device="cuda")
    slots[1::3] = -1
    counts = torch.randint(0, 3, (300, VOCAB), device="cuda", dtype=torch.int32)
    counts |= torch.where(torch.rand(300, VOCAB, device="cuda") < 0.05, sampling.PROMPT_BIT, 0).int()
    params = torch.stack([torch.rand(300, device="cuda") * 4 - 2, torch.rand(300, device="cuda") * 4 - 2,
                          torch.rand(300, device="cuda") * 1.9 + 0.1], dim=1)
    bias_ids = torch.stack([torch.randperm(VOCAB, device="cuda")[:300] for _ in range(300)]).int()
    bias_values = torch.rand(300, 300, device="cuda") * 200 - 100
    bias_count = torch.randint(0, 301, (300,), device="cuda", dtype=torch.int32)
    tables = (counts, params, bias_ids, bias_values, bias_count)
    want, got = logits.clone(), logits.clone()
    sampling.apply_penalties_ref(want, slots, *tables)
    sampling.apply_penalties(got, slots, *tables)  # the Triton kernels on CUDA
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4)
    assert torch.equal(got[1::3], logits[1::3])
    tokens = torch.randint(0, VOCAB, (S,), device="cuda")
    for top_n in (0, 5, 20):
        chosen, values, ids = sampling.token_logprobs(logits, tokens, top_n)
        want_chosen, want_values, want_ids = sampling.token_logprobs_ref(logits, tokens, top_n)
        torch.testing.assert_close(chosen, want_chosen, rtol=0, atol=1e-5)
        torch.testing.assert_close(values, want_values, rtol=0, atol=1e-5)
        assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))  # the same values (ties may swap ids)


@pytest.mark.parametrize("S", [1, 7, 64, 256])
def test_sample_paths_match_reference(S):
    logits, temps, seeds = sampling_batch(S)
    off_k, off_p = torch.zeros(S, dtype=torch.int64, device="cuda"), torch.ones(S, device="cuda")
    want = reference(logits, temps, off_k, off_p, seeds)
    assert torch.equal(sampling.sample(logits, temps, off_k, off_p, seeds, max_top_k=0), want)
    assert torch.equal(sampling.sample(logits, temps, off_k, off_p, seeds), want)
    top_ks = torch.randint(1, 51, (S,), device="cuda")
    top_ps = torch.where(torch.rand(S, device="cuda") < 0.5, torch.rand(S, device="cuda") * 0.9 + 0.05, 1.0)
    want = reference(logits, temps, top_ks, top_ps, seeds)
    assert torch.equal(sampling.sample(logits, temps, top_ks, top_ps, seeds, max_top_k=50), want)
    for chunks in (1, 16):  # a plain torch.topk, and another first-stage width
        assert torch.equal(sampling.sample_top_k_triton(logits, temps, top_ks, top_ps, seeds, 50, chunks), want)
    assert torch.equal(sampling.sample(logits, temps, top_ks, top_ps, seeds), want)
    # top-p alone (top_k off) needs the full path
    want = reference(logits, temps, off_k, top_ps, seeds)
    assert torch.equal(sampling.sample(logits, temps, off_k, top_ps, seeds), want)


def test_greedy_ties_pick_the_lowest_column():
    logits = rand(3, VOCAB).to(torch.bfloat16).float()
    logits[:, [150000, 70000, 90000]] = 100.0
    zeros = torch.zeros(3, device="cuda")
    for max_top_k in (0, 20, None):
        got = sampling.sample(logits, zeros, torch.zeros(3, dtype=torch.int64, device="cuda"), zeros + 1,
                              torch.zeros(3, dtype=torch.int64, device="cuda"), max_top_k=max_top_k)
        assert got.tolist() == [70000] * 3


def test_the_race_kernel_compiles_no_other_binary_for_other_row_counts():
    """Its split count follows the rows (19 at one row, 16 at 33, 1 from 528): none of them may compile anew in
    the middle of serving, after the warm-up's one row."""
    def binaries():
        return sum(len(cache[0]) for cache in sampling._race_kernel.device_caches.values())

    logits, temps = rand(600, VOCAB, dtype=torch.float32), torch.full((600,), 0.7, device="cuda")
    seeds = torch.randint(0, 2**62, (600,), device="cuda")
    sampling.race_triton(logits[:1], temps[:1], seeds[:1])
    before = binaries()
    for rows in (33, 64, 600):
        sampling.race_triton(logits[:rows], temps[:rows], seeds[:rows])
    assert binaries() == before


def test_sample_draws_from_the_distribution():
    n = 20000
    logits = torch.full((n, VOCAB), -30.0, device="cuda")
    logits[:, :5] = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], device="cuda")
    temps, seeds = torch.full((n,), 0.8, device="cuda"), torch.arange(n, device="cuda") * 7919
    probs = (logits[0, :5] / 0.8).softmax(-1)
    for max_top_k, top_k, top_p in [(0, 0, 1.0), (8, 4, 0.9)]:
        tokens = sampling.sample(logits, temps, torch.full((n,), top_k, device="cuda"),
                                 torch.full((n,), top_p, device="cuda"),
                                 seeds, max_top_k=max_top_k)
        p = probs.clone()
        if top_k:
            p[top_k:] = 0
        keep = (p / p.sum()).cumsum(0) - p / p.sum() < top_p
        expected = torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()
        freq = torch.bincount(tokens, minlength=VOCAB)[:5].float() / n
        assert (freq - expected).abs().max() < 0.015 and tokens.max() < 5


@pytest.mark.parametrize("max_top_k", [0, 50])
def test_sample_in_a_cuda_graph(max_top_k):
    S = 16
    logits, temps, seeds = sampling_batch(S)
    top_ks = torch.full((S,), 50 if max_top_k else 0, device="cuda")
    top_ps = torch.full((S,), 0.9 if max_top_k else 1.0, device="cuda")
    run = lambda: sampling.sample(logits, temps, top_ks, top_ps, seeds, max_top_k=max_top_k)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step in range(3):
        seeds.copy_(seeds + 1)
        logits.copy_(torch.randn_like(logits) * 3)
        graph.replay()
        assert torch.equal(out, reference(logits, temps, top_ks, top_ps, seeds))
