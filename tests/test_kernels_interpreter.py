"""Every Triton kernel in kernels/tsdev_kernels/ops against its torch reference, on CPU through TRITON_INTERPRET=1.

float32, small shapes (the interpreter runs one program at a time), fresh random inputs, and the awkward
cases: sizes that are not multiples of the block sizes, strided inputs, padding slots (-1), cached
prefixes, GQA, sequences of different lengths, empty KV splits. tests/conftest.py sets the interpreter
before Triton decorates anything. The same kernels on CUDA: tests/test_kernels_gpu.py.
"""
import itertools
import os
import zlib
from types import SimpleNamespace

import pytest
import torch

import tsdev_kernels.ops
from tsdev_kernels.ops import activation, attention, fp8, linear, norm, rope, sampling

# With a GPU, this process compiled the kernels for it: tests/test_kernels_interpreter_process.py runs this file in
# a process that sees no GPU (a plain `pytest` on a GPU machine checks every kernel too)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run in a process without the GPU (tests/test_kernels_interpreter_process.py)")

TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))  # the same seed in every run (str hash is not)


def fused_qkv(T, Hq, Hk, D):
    """q, k, v as strided views of one fused projection, as the model produces them."""
    qkv = torch.randn(T, (Hq + 2 * Hk) * D)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    return q.view(T, Hq, D), k.view(T, Hk, D), v.view(T, Hk, D)


# --- norm -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7, 40), (3, 5, 24), (2, 2, 3, 8)])
def test_rms_norm(shape):
    x, w = torch.randn(shape), torch.randn(shape[-1])
    torch.testing.assert_close(norm.rms_norm_triton(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6), **TOL)


def test_rms_norm_reads_strided_heads():
    q, _, _ = fused_qkv(5, 4, 2, 16)
    w = torch.randn(16)
    torch.testing.assert_close(norm.rms_norm_triton(q, w, 1e-6), norm.rms_norm_ref(q, w, 1e-6), **TOL)


def test_fused_add_rms_norm():
    x, r, w = torch.randn(9, 72), torch.randn(9, 72), torch.randn(72)
    x0, r0 = x.clone(), r.clone()
    out, res = norm.rms_norm_triton(x, w, 1e-5, r)
    ref_out, ref_res = norm.fused_add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(res, ref_res, **TOL)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs untouched


# --- linear -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("N,K,block_n,block_k", [(40, 72, 4, 32), (33, 100, 8, 64), (17, 19, 2, 16), (5, 300, 16, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv(N, K, block_n, block_k, bias):
    x, w = torch.randn(1, K), torch.randn(N, K)
    b = torch.randn(N) if bias else None
    got = linear.gemv_triton(x, w, b, block_n=block_n, block_k=block_k)
    torch.testing.assert_close(got, linear.linear_ref(x, w, b), **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("N,K,block_n", [(40, 72, 4), (33, 100, 8), (6, 24, 16)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_with_norm_and_activation_equals_the_ops_one_after_another(N, K, block_n, residual, gated, bias):
    x, w, nw = torch.randn(1, K), torch.randn(2 * N if gated else N, K), torch.randn(K)
    r = torch.randn(1, K) if residual else None
    b = torch.randn(w.shape[0]) if bias else None
    y, res = linear.gemv_triton(x, w, b, block_n=block_n, residual=r, norm_weight=nw, eps=1e-6, gated=gated)
    normed, want_res = norm.rms_norm_triton(x, nw, 1e-6, r) if residual else (norm.rms_norm_triton(x, nw, 1e-6), x)
    want = linear.gemv_triton(normed, w, b, block_n=block_n, block_k=1024)
    want = activation.silu_and_mul_triton(want) if gated else want
    assert torch.equal(y, want) and torch.equal(res, want_res)  # the same arithmetic, the same rounding
    normed_ref, _ = norm.fused_add_rms_norm_ref(x, r, nw, 1e-6) if residual else (norm.rms_norm_ref(x, nw, 1e-6), x)
    ref = linear.linear_ref(normed_ref, w, b)
    torch.testing.assert_close(y, activation.silu_and_mul_ref(ref) if gated else ref, **TOL)


def test_gemv_with_norm_and_activation_takes_fp8_weights():
    x, r, nw, (w, s) = torch.randn(1, 72), torch.randn(1, 72), torch.randn(72), fp8_weight(2 * 40, 72)
    y, res = linear.gemv_triton(x, w, weight_scale=s, residual=r, norm_weight=nw, eps=1e-6, gated=True)
    normed, want_res = norm.fused_add_rms_norm_ref(x, r, nw, 1e-6)
    torch.testing.assert_close(y, activation.silu_and_mul_ref(fp8.fp8_weight_only_ref(normed, w, s)), **TOL)
    assert torch.equal(res, want_res)


def test_gemv_keeps_leading_dims_and_refuses_several_rows():
    x, w = torch.randn(1, 1, 24), torch.randn(8, 24)
    assert linear.gemv_triton(x, w).shape == (1, 1, 8)
    with pytest.raises(ValueError, match="one row"):
        linear.gemv_triton(torch.randn(2, 24), w)


@pytest.mark.parametrize("M,N,K,block_n,block_k", [(2, 40, 72, 16, 32), (5, 33, 100, 16, 64), (8, 64, 256, 32, 256),
                                                   (16, 17, 19, 16, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear(M, N, K, block_n, block_k, bias):
    x, w = torch.randn(M, K), torch.randn(N, K)
    b = torch.randn(N) if bias else None
    got = linear.skinny_triton(x, w, b, block_n=block_n, block_k=block_k)
    torch.testing.assert_close(got, linear.linear_ref(x, w, b), **TOL)


@pytest.mark.parametrize("M, block_m", [(40, 16), (139, 64)])
def test_the_skinny_kernel_tiles_more_rows_than_one_block(M, block_m):
    """Rows past one tile (the kernels_bench.py sweep against cuBLAS at decode batches): each program its block_m rows,
    the last tile partial."""
    x, w, b = torch.randn(M, 72), torch.randn(33, 72), torch.randn(33)
    got = linear.skinny_triton(x, w, b, block_n=16, block_k=32, block_m=block_m)
    torch.testing.assert_close(got, linear.linear_ref(x, w, b), **TOL)


def fp8_weight(N, K):
    """An e4m3 weight with per-row scales from fresh random rows of different magnitudes."""
    q, s = fp8.quantize_fp8_rows(torch.randn(N, K) * torch.rand(N, 1).add(0.1) * 4)
    return q, s.view(-1)


@pytest.mark.parametrize("N,K,block_n,block_k", [(40, 72, 4, 32), (33, 100, 8, 64), (5, 300, 16, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv(N, K, block_n, block_k, bias):
    x, (w, s) = torch.randn(1, K), fp8_weight(N, K)
    b = torch.randn(N) if bias else None
    got = fp8.fp8_gemv_triton(x, w, s, b, block_n=block_n, block_k=block_k)
    torch.testing.assert_close(got, fp8.fp8_weight_only_ref(x, w, s, b), **TOL)


@pytest.mark.parametrize("M,N,K,block_n,block_k", [(2, 40, 72, 16, 32), (5, 33, 100, 16, 64), (8, 64, 256, 32, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_skinny(M, N, K, block_n, block_k, bias):
    x, (w, s) = torch.randn(M, K), fp8_weight(N, K)
    b = torch.randn(N) if bias else None
    got = fp8.fp8_skinny_triton(x, w, s, b, block_n=block_n, block_k=block_k)
    torch.testing.assert_close(got, fp8.fp8_weight_only_ref(x, w, s, b), **TOL)


@pytest.mark.parametrize("value,families,gluon", [
    ("triton", set(), False), ("ref", set(tsdev_kernels.ops.FAMILIES), False), ("ref:linear", {"linear"}, False),
    ("ref:linear,rope", {"linear", "rope"}, False), ("gluon:norm", set(), True),
    ("ref:linear,rope,gluon:norm", {"linear", "rope"}, True), ("gluon:norm,ref:norm", {"norm"}, False)])
def test_tsdev_kernels_sends_families_to_their_references_or_gluon_kernels(monkeypatch, value, families, gluon):
    monkeypatch.setenv("TSDEV_KERNELS", value)
    assert tsdev_kernels.ops.reference_families() == families and tsdev_kernels.ops.use_gluon("norm") is gluon


@pytest.mark.parametrize("value,fused", [("triton", True), ("ref:rope", True), ("ref:linear", False),
                                         ("gluon:norm", False), ("cute:activation", False)])
def test_a_fused_triton_kernel_stands_in_only_for_families_left_on_triton(monkeypatch, value, fused):
    """The decode GEMV with the norm and activation inside: a family picked off Triton serves its own kernel at
    batch 1 too."""
    monkeypatch.setenv("TSDEV_KERNELS", value)
    assert tsdev_kernels.ops.use_fused_triton(SimpleNamespace(is_cuda=True), "norm", "linear", "activation") is fused
    assert not tsdev_kernels.ops.use_fused_triton(SimpleNamespace(is_cuda=False), "norm", "linear", "activation")


def test_qk_norm_rope_unfused_is_its_reference_bit_for_bit():
    """What a pick of norm or rope off Triton serves: the two ops one after the other, rounded as the fused one."""
    q, k = torch.randn(5, 4, 64).bfloat16(), torch.randn(5, 2, 64).bfloat16()
    qw, kw, positions = (torch.rand(64).bfloat16() + 0.5, torch.rand(64).bfloat16() + 0.5,
                         torch.tensor([0, 3, 7, 8, 100]))
    cache = rope.rope_cos_sin_cache(64, 128, 10000.0)
    for got, want in zip(rope.qk_norm_rope(q, k, qw, kw, 1e-6, positions, cache),
                         rope.qk_norm_rope_ref(q, k, qw, kw, 1e-6, positions, cache)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("value", ["torch", "ref:gemm", "ref:", "gluon:rope", "gluon", "norm"])
def test_tsdev_kernels_rejects_what_it_does_not_know(monkeypatch, value):
    monkeypatch.setenv("TSDEV_KERNELS", value)
    with pytest.raises(ValueError, match="TSDEV_KERNELS"):
        tsdev_kernels.ops.reference_families()


# --- rope -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Hq,Hk,D", [(4, 2, 16), (3, 3, 24)])
def test_apply_rope(Hq, Hk, D):
    T = 6
    q, k, _ = fused_qkv(T, Hq, Hk, D)
    cache = rope.rope_cos_sin_cache(D, 64, 10000.0)
    positions = torch.randint(0, 64, (T,))
    for got, want in zip(rope.rope_triton(q, k, positions, cache), rope.apply_rope_ref(q, k, positions, cache)):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("Hq,Hk,D", [(4, 2, 16), (6, 2, 24)])
def test_qk_norm_rope(Hq, Hk, D):
    T = 5
    q, k, _ = fused_qkv(T, Hq, Hk, D)
    qw, kw = torch.randn(D), torch.randn(D)
    cache = rope.rope_cos_sin_cache(D, 100, 1e6)
    positions = torch.randint(0, 100, (T,))
    got = rope.rope_triton(q, k, positions, cache, qw, kw, 1e-6)
    want = rope.qk_norm_rope_ref(q, k, qw, kw, 1e-6, positions, cache)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_qk_norm_rope_ref_matches_hugging_face_qwen3():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    q, k, _ = fused_qkv(3, 2, 1, 8)
    qw, kw = torch.randn(8), torch.randn(8)
    cache, positions = rope.rope_cos_sin_cache(8, 16, 100.0), torch.tensor([0, 5, 15])
    q_norm, k_norm = Qwen3RMSNorm(8, eps=1e-6), Qwen3RMSNorm(8, eps=1e-6)
    q_norm.weight.data, k_norm.weight.data = qw, kw
    # Hugging Face's layout: [batch, heads, tokens, head_dim], cos/sin [batch, tokens, head_dim]
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8))
    angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(q_norm(q).transpose(0, 1)[None], k_norm(k).transpose(0, 1)[None],
                                      angles.cos(), angles.sin())
    got_q, got_k = rope.qk_norm_rope(q, k, qw, kw, 1e-6, positions, cache)
    torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1), **TOL)
    torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1), **TOL)


# --- activation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,block", [((5, 2 * 300), 128), ((2, 3, 2 * 64), 64)])
def test_silu_and_mul(shape, block):
    x = torch.randn(shape) * 3
    torch.testing.assert_close(activation.silu_and_mul_triton(x, block=block), activation.silu_and_mul_ref(x), **TOL)


# --- attention --------------------------------------------------------------------------------------


def paged_batch(seq_lens, q_lens, Hq, Hk, D, page_size, spare_pages=3):
    """A KV pool with random contents, each sequence on shuffled pages, and queries for its last q_len tokens."""
    pages_per_seq = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    k_cache = torch.randn(num_pages, page_size, Hk, D)
    v_cache = torch.randn(num_pages, page_size, Hk, D)
    order = torch.randperm(num_pages).tolist()
    page_table = torch.zeros(len(seq_lens), max(pages_per_seq) + 1, dtype=torch.int32)  # +1: a padded column
    for i, n in enumerate(pages_per_seq):
        page_table[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), Hq, D)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), page_table


@pytest.mark.parametrize("page_size", [4, 5])
def test_store_kvcache(page_size):
    T, Hk, D = 7, 3, 8
    _, k, v = fused_qkv(T, 2 * Hk, Hk, D)  # v strided, as in the model
    k_cache, v_cache = torch.randn(6, page_size, Hk, D), torch.randn(6, page_size, Hk, D)
    slots = torch.randperm(6 * page_size)[:T]
    slots[[1, 4]] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    attention.store_kvcache_triton(k, v, k_cache, v_cache, slots)
    attention.store_kvcache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("Hq,Hk,page_size", [(4, 2, 4), (3, 1, 5), (2, 2, 16)])
def test_prefill_attention(Hq, Hk, page_size):
    # a fresh prompt longer than one block, a chunk after a cached prefix, a decode row, a short prompt
    seq_lens, q_lens = [37, 29, 12, 3], [37, 11, 1, 3]
    q, kc, vc, cu, sl, pt = paged_batch(seq_lens, q_lens, Hq, Hk, 16, page_size)
    got = attention.paged_prefill_triton(q, kc, vc, cu, sl, pt, 0.25, max(q_lens))
    torch.testing.assert_close(got, attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 0.25), **TOL)


def test_prefill_attention_in_any_start_order_gives_each_sequence_its_own_output():
    seq_lens, q_lens = [37, 29, 12, 3], [37, 11, 1, 3]
    q, kc, vc, cu, sl, pt = paged_batch(seq_lens, q_lens, 4, 2, 16, 4)
    order = torch.tensor(attention.longest_first(seq_lens))
    got = attention.paged_prefill_triton(q, kc, vc, cu, sl, pt, 0.25, max(q_lens), order=order)
    torch.testing.assert_close(got, attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 0.25), **TOL)


def test_prefill_attention_odd_head_dim_and_blocks():
    seq_lens, q_lens = [20, 9], [13, 9]
    q, kc, vc, cu, sl, pt = paged_batch(seq_lens, q_lens, 4, 2, 24, 3)
    got = attention.paged_prefill_triton(q, kc, vc, cu, sl, pt, 0.2, 13, block_m=16, block_n=32)
    torch.testing.assert_close(got, attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 0.2), **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("Hq,Hk,page_size", [(4, 2, 4), (8, 2, 5), (2, 2, 16)])
def test_decode_attention(num_splits, Hq, Hk, page_size):
    # lengths from one token to a few blocks: with 8 splits most chunks of the short ones are empty
    seq_lens = [1, 17, 40, 6]
    q, kc, vc, cu, sl, pt = paged_batch(seq_lens, [1] * 4, Hq, Hk, 16, page_size)
    got = attention.paged_decode_triton(q, kc, vc, cu, sl, pt, 0.3, num_splits=num_splits)
    torch.testing.assert_close(got, attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 0.3), **TOL)
    assert not attention.split_arrivals(q.device, 4 * Hk).any()  # each merge zeroed its counter


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 7, 1]], ids=["decode", "mixed"])
def test_paged_attention_stores_then_attends_on_either_kernel(q_lens, monkeypatch):
    """The public op given store=: the decode kernel stores itself, a mixed batch stores first; both as the
    references do (store_kvcache_ref, then paged_attention_ref)."""
    monkeypatch.setattr(attention, "use_triton", lambda x, family: True)  # the Triton paths, interpreted
    seq_lens, page_size, Hk = [9, 20, 3], 4, 2
    q, kc, vc, cu, sl, pt = paged_batch(seq_lens, q_lens, 4, Hk, 16, page_size)
    T = sum(q_lens)
    k, v = torch.randn(T, Hk, 16), torch.randn(T, Hk, 16)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(q_lens))
    slots = pt[seq, positions // page_size].long() * page_size + positions % page_size
    want_k, want_v = kc.clone(), vc.clone()
    attention.store_kvcache_ref(k, v, want_k, want_v, slots)
    got = attention.paged_attention(q, kc, vc, cu, sl, pt, 0.3, max_q_len=max(q_lens), store=(k, v, slots))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    torch.testing.assert_close(got, attention.paged_attention_ref(q, want_k, want_v, cu, sl, pt, 0.3), **TOL)


@pytest.mark.parametrize("seq_lens, q_lens, decode_order", [([9, 30, 3, 20, 5, 12], [1, 1, 1, 7, 1, 12], [1, 0, 2]),
                                                             ([9, 20, 5], [1, 7, 1], None)])
def test_a_mixed_step_runs_its_decode_rows_on_the_decode_kernel_and_the_rest_on_the_prefill_kernel(
        seq_lens, q_lens, decode_order, monkeypatch):
    """The scheduler puts decodes first: with `decodes` (and `split_order`'s order) the public op runs the leading
    one-row sequences on the decode kernel as a decode step would (storing their rows; one sequence unordered), stores
    the other rows and runs them on the prefill kernel -- each kernel on its own sequences (the launches recorded),
    together the reference. A one-row prefill chunk after the first longer sequence stays with the prefill kernel."""
    monkeypatch.setattr(attention, "use_triton", lambda x, family: True)  # the Triton paths, interpreted
    page_size, Hk = 4, 2
    decodes, order = attention.split_order(q_lens, seq_lens)
    assert order[:decodes] == (decode_order or [0]) and sorted(order[decodes:]) == list(range(decodes, len(q_lens)))
    q, kc, vc, cu, sl, pt = paged_batch(seq_lens, q_lens, 4, Hk, 16, page_size)
    T = sum(q_lens)
    k, v = torch.randn(T, Hk, 16), torch.randn(T, Hk, 16)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = pt[seq, positions // page_size].long() * page_size + positions % page_size
    want_k, want_v = kc.clone(), vc.clone()
    attention.store_kvcache_ref(k, v, want_k, want_v, slots)
    launched = []
    for name in ("paged_decode_triton", "paged_prefill_triton"):
        kernel = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _k=kernel, _n=name, **kw: launched.append(
            (_n, None if kw["order"] is None else kw["order"].tolist(), kw.get("store") is not None)) or _k(*a, **kw))
    got = attention.paged_attention(q, kc, vc, cu, sl, pt, 0.3, max_q_len=max(q_lens), store=(k, v, slots),
                                    order=torch.tensor(order), decodes=decodes)
    assert launched == [("paged_decode_triton", decode_order, True), ("paged_prefill_triton", order[decodes:], False)]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    torch.testing.assert_close(got, attention.paged_attention_ref(q, want_k, want_v, cu, sl, pt, 0.3), **TOL)
    assert attention.split_order([1, 1], [4, 9]) == (0, [1, 0])  # a decode step: no split
    assert attention.split_order([5, 1], [5, 9]) == (0, [1, 0])  # a prefill first: nothing to split off


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("longest_first", [False, True], ids=["batch-order", "longest-first"])
def test_decode_attention_stores_the_steps_keys_and_values_itself(num_splits, longest_first):
    """In either start order (`order`), each sequence gets its own output and its own K/V row."""
    seq_lens, page_size, Hk = [1, 17, 40, 6], 5, 2
    q, kc, vc, cu, sl, pt = paged_batch(seq_lens, [1] * 4, 4, Hk, 16, page_size)
    k, v = torch.randn(4, Hk, 16), torch.randn(4, Hk, 16)
    last = sl.long() - 1
    slots = pt[torch.arange(4), last // page_size].long() * page_size + last % page_size
    slots[2] = -1  # a padding row writes nothing
    want_k, want_v = kc.clone(), vc.clone()
    attention.store_kvcache_ref(k, v, want_k, want_v, slots)
    order = attention.longest_first(seq_lens) if longest_first else None
    if longest_first:
        assert order == [2, 1, 3, 0]
    got = attention.paged_decode_triton(q, kc, vc, cu, sl, pt, 0.3, num_splits=num_splits, store=(k, v, slots),
                                        order=None if order is None else torch.tensor(order))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    torch.testing.assert_close(got, attention.paged_attention_ref(q, want_k, want_v, cu, sl, pt, 0.3), **TOL)


def test_decode_attention_skips_sequences_without_a_row():
    q, kc, vc, _, sl, pt = paged_batch([9, 14, 3], [1, 1, 1], 4, 2, 16, 4)
    cu = torch.tensor([0, 1, 1, 2], dtype=torch.int32)  # the middle sequence has no query row this step
    q = q[:2]
    for splits in (1, 2):
        got = attention.paged_decode_triton(q, kc, vc, cu, sl, pt, 0.3, num_splits=splits)
        torch.testing.assert_close(got, attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 0.3), **TOL)


def test_decode_and_prefill_kernels_agree_on_a_decode_batch():
    q, kc, vc, cu, sl, pt = paged_batch([5, 33], [1, 1], 4, 2, 16, 4)
    torch.testing.assert_close(attention.paged_decode_triton(q, kc, vc, cu, sl, pt, 0.3),
                               attention.paged_prefill_triton(q, kc, vc, cu, sl, pt, 0.3, 1), **TOL)


# --- sampling ---------------------------------------------------------------------------------------


def sampling_batch(S=8, V=1000):
    logits = torch.randn(S, V) * 2
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 2.0, 0.5, 1.0])[:S]
    seeds = torch.randint(-(2**62), 2**62, (S,))
    return logits, temps, seeds


def test_exponential_noise_is_exp1_and_per_column():
    seeds = torch.tensor([0, 1, -7, 2**40 + 5])
    noise = sampling.exponential_noise(seeds, torch.arange(20000))
    assert noise.min() > 0 and abs(noise.mean() - 1) < 0.03 and abs(noise.std() - 1) < 0.05
    assert (noise[:, None] - noise[None]).abs().sum(-1).triu(1).count_nonzero() == 6  # rows differ
    cols = torch.tensor([[5, 19999, 0], [3, 2, 1], [7, 7, 7], [100, 200, 300]])
    assert torch.equal(sampling.exponential_noise(seeds, cols), noise.gather(1, cols))


def test_noise_stays_positive_and_finite_at_the_hash_extremes():
    noise = sampling._exp1_from_hash(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1]))
    assert torch.isfinite(noise).all() and (noise > 0).all()


@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_race_matches_reference_without_filters(num_splits):
    logits, temps, seeds = sampling_batch()
    S, V = logits.shape
    want = sampling.sample_ref(logits, temps, torch.zeros(S, dtype=torch.int64), torch.ones(S),
                               sampling.exponential_noise(seeds, torch.arange(V)))
    assert torch.equal(sampling.race_triton(logits, temps, seeds, num_splits=num_splits), want)


def test_race_breaks_greedy_ties_like_argmax():
    logits = torch.randn(2, 700)
    logits[:, [600, 301, 650]] = 10.0
    got = sampling.race_triton(logits, torch.zeros(2), torch.zeros(2, dtype=torch.int64), num_splits=3)
    assert got.tolist() == [301, 301]


@pytest.mark.parametrize("V,chunks", [(1000, 8), (1003, 8), (1000, 3), (5000, 64)])  # all two-stage
def test_two_stage_topk(V, chunks):
    logits = torch.randn(5, V)
    values, cols = sampling._topk(logits, 20, chunks)
    want_values, want_cols = logits.topk(20, dim=-1)
    assert torch.equal(values, want_values) and torch.equal(cols, want_cols)


@pytest.mark.parametrize("topk_chunks", [1, 7])
def test_top_k_candidates_match_reference(topk_chunks):
    logits, temps, seeds = sampling_batch()
    S, V = logits.shape
    top_ks = torch.tensor([0, 5, 20, 1, 3, 20, 7, 13])  # a greedy row may have top_k = 0
    top_ps = torch.tensor([1.0, 0.9, 1.0, 0.8, 0.5, 0.95, 1.0, 0.6])
    want = sampling.sample_ref(logits, temps, top_ks, top_ps, sampling.exponential_noise(seeds, torch.arange(V)))
    assert torch.equal(sampling.sample_top_k_triton(logits, temps, top_ks, top_ps, seeds, 20, topk_chunks), want)


def test_seeded_noise_draws_from_the_distribution():
    """Many seeds on one row: frequencies follow softmax(logits / T) restricted to the nucleus.
    (The kernels draw the same noise, checked above; the GPU tests repeat this through them.)"""
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * 11]).expand(n, -1)
    temps, seeds = torch.full((n,), 0.8), torch.arange(n) * 7919
    top_ks, top_ps = torch.full((n,), 4), torch.full((n,), 0.9)
    tokens = sampling.sample(logits, temps, top_ks, top_ps, seeds)  # CPU: the reference
    probs = (logits[0, :4] / 0.8).softmax(-1)
    keep = (probs.cumsum(0) - probs) < 0.9
    expected = torch.where(keep, probs, 0) / torch.where(keep, probs, 0).sum()
    freq = torch.bincount(tokens, minlength=16)[:4].float() / n
    assert (freq - expected).abs().max() < 0.015 and tokens.max() < 4


def penalties_batch(S: int, V: int, slots: int, generator: torch.Generator):
    """Random logits, per-slot tables (counts up to 3 with prompt tokens marked, penalties, a few bias entries)
    and a slot per row; some rows without one."""
    logits = torch.randn(S, V, generator=generator) * 3
    counts = torch.randint(0, 4, (slots, V), generator=generator, dtype=torch.int32)
    counts |= torch.where(torch.rand(slots, V, generator=generator) < 0.2, sampling.PROMPT_BIT, 0).int()
    params = torch.stack([torch.rand(slots, generator=generator) * 4 - 2,
                          torch.rand(slots, generator=generator) * 4 - 2,
                          torch.rand(slots, generator=generator) * 1.9 + 0.1], dim=1)
    bias_ids = torch.stack([torch.randperm(V, generator=generator)[:6] for _ in range(slots)]).int()
    bias_values = torch.rand(slots, 6, generator=generator) * 200 - 100
    bias_count = torch.randint(0, 7, (slots,), generator=generator, dtype=torch.int32)
    rows = torch.randint(0, slots, (S,), generator=generator)
    rows[::3] = -1
    return logits, rows, (counts, params, bias_ids, bias_values, bias_count)


def test_penalties_kernels_match_the_reference():
    generator = torch.Generator().manual_seed(5)
    logits, slots, tables = penalties_batch(7, 300, 4, generator)
    want = logits.clone()
    sampling.apply_penalties_ref(want, slots, *tables)
    got = logits.clone()
    sampling.apply_penalties_triton(got, slots, *tables)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[::3], logits[::3])  # rows without a slot are left as they are
    assert not torch.equal(got[1], logits[1])


def test_penalties_reference_follows_vllms_formula_entry_by_entry():
    generator = torch.Generator().manual_seed(6)
    logits, slots, (counts, params, bias_ids, bias_values, bias_count) = penalties_batch(4, 12, 2, generator)
    bias_count[:] = 3
    got = logits.clone()
    sampling.apply_penalties_ref(got, slots, counts, params, bias_ids, bias_values, bias_count)
    for r in range(4):
        for t in range(12):
            x, slot = logits[r, t].item(), slots[r].item()
            if slot >= 0:
                presence, frequency, repetition = params[slot].tolist()
                x += sum(v for i, v in zip(bias_ids[slot, :3].tolist(), bias_values[slot, :3].tolist()) if i == t)
                history = counts[slot, t].item()
                n = history & (sampling.PROMPT_BIT - 1)
                if history:  # in the prompt or generated
                    x = x / repetition if x > 0 else x * repetition
                x -= frequency * n + presence * (n > 0)
            assert abs(got[r, t].item() - x) < 1e-4, (r, t)


def test_count_kernel_adds_each_drawn_token_to_its_slot_only():
    counts = torch.zeros(3, 20, dtype=torch.int32)
    slots, tokens = torch.tensor([2, -1, 0, 2]), torch.tensor([5, 7, 19, 5])
    sampling._count_kernel[(4,)](counts, slots, tokens, counts.stride(0))
    want = torch.zeros(3, 20, dtype=torch.int32)
    want[2, 5], want[0, 19] = 2, 1
    assert torch.equal(counts, want)
    again = torch.zeros(3, 20, dtype=torch.int32)
    sampling.count_tokens(again, slots, tokens)  # CPU: the reference
    assert torch.equal(again, want)


@pytest.mark.parametrize("top_n", [0, 1, 5])
def test_token_logprobs_kernel_is_log_softmax_and_its_top_n(top_n):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(7)) * 4
    tokens = torch.tensor([3, 0, 299, 17, 17])
    full = logits.log_softmax(-1)
    for chosen, values, ids in (sampling.token_logprobs_triton(logits, tokens, top_n),
                                sampling.token_logprobs(logits, tokens, top_n)):  # CPU: the reference
        torch.testing.assert_close(chosen, full.gather(1, tokens.unsqueeze(1)).squeeze(1))
        want_values, want_ids = full.topk(top_n)
        torch.testing.assert_close(values, want_values)
        assert torch.equal(ids, want_ids) and ids.dtype == torch.int64


def test_public_ops_use_the_references_on_cpu(monkeypatch):
    def triton_called(*args, **kwargs):
        raise AssertionError("a Triton entry point ran for CPU tensors")

    for module, name in ((sampling, "race_triton"), (sampling, "sample_top_k_triton"),
                         (sampling, "apply_penalties_triton"),
                         (sampling, "token_logprobs_triton"),
                         (attention, "paged_decode_triton"), (attention, "paged_prefill_triton"),
                         (linear, "gemv_triton"), (linear, "skinny_triton"), (norm, "rms_norm_triton"),
                         (rope, "rope_triton"), (activation, "silu_and_mul_triton"),
                         (attention, "store_kvcache_triton"), (fp8, "fp8_gemv_triton"),
                         (fp8, "fp8_skinny_triton"), (fp8, "fp8_scaled_mm")):
        monkeypatch.setattr(module, name, triton_called)
    logits, temps, seeds = sampling_batch(V=50)
    top_ks, top_ps = torch.zeros(8, dtype=torch.int64), torch.ones(8)
    want = sampling.sample_ref(logits, temps, top_ks, top_ps, sampling.exponential_noise(seeds, torch.arange(50)))
    assert torch.equal(sampling.sample(logits, temps, top_ks, top_ps, seeds, max_top_k=0), want)
    penalised, slots, tables = penalties_batch(4, 50, 2, torch.Generator().manual_seed(8))
    want = penalised.clone()
    sampling.apply_penalties_ref(want, slots, *tables)
    sampling.apply_penalties(penalised, slots, *tables)
    assert torch.equal(penalised, want)
    q, kc, vc, cu, sl, pt = paged_batch([6, 3], [2, 1], 2, 1, 8, 4)
    assert torch.equal(attention.paged_attention(q, kc, vc, cu, sl, pt, 0.5, max_q_len=2),
                       attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 0.5))
    for rows in (1, 3):
        x, w = torch.randn(rows, 16), torch.randn(4, 16)
        assert torch.equal(linear.linear(x, w), linear.linear_ref(x, w))
    w8, s8 = fp8_weight(4, 16)
    for rows in (1, 3, 9):
        x = torch.randn(rows, 16)
        want = (fp8.fp8_weight_only_ref if rows <= fp8.SKINNY_ROWS else fp8.fp8_scaled_mm_ref)(x, w8, s8)
        assert torch.equal(fp8.fp8_linear(x, w8, s8), want)
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    assert torch.equal(norm.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))
    for got, want in zip(norm.fused_add_rms_norm(x, r, w, 1e-6), norm.fused_add_rms_norm_ref(x, r, w, 1e-6)):
        assert torch.equal(got, want)
    assert torch.equal(activation.silu_and_mul(x), activation.silu_and_mul_ref(x))
    q, k, v = fused_qkv(3, 2, 1, 8)
    cache, positions = rope.rope_cos_sin_cache(8, 16, 100.0), torch.tensor([0, 5, 15])
    for got, want in zip(rope.apply_rope(q, k, positions, cache), rope.apply_rope_ref(q, k, positions, cache)):
        assert torch.equal(got, want)
    qw, kw = torch.randn(8), torch.randn(8)
    for got, want in zip(rope.qk_norm_rope(q, k, qw, kw, 1e-6, positions, cache),
                         rope.qk_norm_rope_ref(q, k, qw, kw, 1e-6, positions, cache)):
        assert torch.equal(got, want)
    k_cache, v_cache = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    attention.store_kvcache(k, v, k_cache, v_cache, torch.tensor([0, -1, 5]))
    assert torch.equal(k_cache.view(-1, 1, 8)[[0, 5]], k[[0, 2]]) and k_cache.view(-1, 1, 8)[1:5].eq(0).all()


# --- an fp8 KV cache (--kv-cache-dtype fp8): e4m3 rows with per-tensor scales ----------------------------

FP8 = attention.FP8_KV_DTYPE


def fp8_paged_batch(seq_lens, q_lens, Hq, Hk, D, page_size):
    """paged_batch's, its K/V pool stored in e4m3 as the kernels store it (values past e4m3's range included)."""
    q, kc, vc, cu, sl, pt = paged_batch(seq_lens, q_lens, Hq, Hk, D, page_size)
    return q, attention.quantize_kv(kc * 3, 0.5, FP8), attention.quantize_kv(vc * 3, 0.25, FP8), cu, sl, pt


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_kv_decode_and_prefill_match_a_reference_that_dequantizes_the_same_rows(num_splits):
    scales = (0.5, 0.25)
    q, kc, vc, cu, sl, pt = fp8_paged_batch([1, 17, 40, 6], [1] * 4, 4, 2, 16, 5)
    want = attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 0.3, kv_scales=scales)
    got = attention.paged_decode_triton(q, kc, vc, cu, sl, pt, 0.3, num_splits=num_splits, kv_scales=scales)
    torch.testing.assert_close(got, want, **TOL)
    seq_lens, q_lens = [37, 29, 12, 3], [37, 11, 1, 3]
    q, kc, vc, cu, sl, pt = fp8_paged_batch(seq_lens, q_lens, 4, 2, 16, 4)
    got = attention.paged_prefill_triton(q, kc, vc, cu, sl, pt, 0.25, max(q_lens), kv_scales=scales)
    torch.testing.assert_close(got, attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 0.25, kv_scales=scales),
                               **TOL)
    unscaled = attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 0.25)  # the scales matter
    assert (got - unscaled).abs().max() > 0.1


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_kv_decode_of_a_bf16_q_meets_the_rows_in_float16(num_splits):
    """A bf16 model's decode over an e4m3 pool: q, the rows and the softmax weights meet in float16
    (`fp8_dot_dtype`); the output within one bf16 rounding of the float32 reference."""
    q, kc, vc, cu, sl, pt = fp8_paged_batch([1, 17, 40, 6], [1] * 4, 4, 2, 16, 5)
    q = q.bfloat16()
    assert attention.fp8_dot_dtype(q.dtype) == torch.float16
    got = attention.paged_decode_triton(q, kc, vc, cu, sl, pt, 0.3, num_splits=num_splits, kv_scales=(0.5, 0.25))
    want = attention.paged_attention_ref(q, kc, vc, cu, sl, pt, 0.3, kv_scales=(0.5, 0.25))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)


def test_fp8_dot_over_a_pool_that_is_not_e4m3_is_refused_not_ignored():
    q, kc, vc, cu, sl, pt = fp8_paged_batch([1, 17], [1] * 2, 4, 2, 16, 5)
    with pytest.raises(ValueError, match="fp8_dot applies to an e4m3 KV cache; this one is torch.float32"):
        attention.paged_decode_triton(q, kc.float(), vc.float(), cu, sl, pt, 0.3, fp8_dot=torch.float16)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 7, 1]], ids=["decode", "mixed"])
def test_fp8_kv_store_quantizes_as_the_reference_does_bit_for_bit(q_lens, monkeypatch):
    monkeypatch.setattr(attention, "use_triton", lambda x, family: True)  # the Triton paths, interpreted
    seq_lens, page_size, Hk, scales = [9, 20, 3], 4, 2, (0.5, 0.125)
    q, kc, vc, cu, sl, pt = fp8_paged_batch(seq_lens, q_lens, 4, Hk, 16, page_size)
    T = sum(q_lens)
    # values e4m3 holds exactly (times the scales), keys past 448 * scale among them: clamped, never NaN. (Triton's
    # interpreter rounds a value that carries into the next power of two down a binade -- 125.2 to 64, not 128 --
    # where the GPU's conversion rounds as torch does: the GPU test checks the rounding, bit for bit.)
    k = attention.quantize_kv(torch.randn(T, Hk, 16) * 100, 1.0, FP8).float() * 0.5
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 300.0, -225.0])  # clamped to +-448 * 0.5 (on 0.5's grid: exact)
    v = attention.quantize_kv(torch.randn(T, Hk, 16), 1.0, FP8).float() * 0.125
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(q_lens))
    slots = pt[seq, positions // page_size].long() * page_size + positions % page_size
    want_k, want_v = kc.clone(), vc.clone()
    attention.store_kvcache_ref(k, v, want_k, want_v, slots, scales)
    got = attention.paged_attention(q, kc, vc, cu, sl, pt, 0.3, max_q_len=max(q_lens), store=(k, v, slots),
                                    kv_scales=scales)
    assert torch.equal(kc.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8))
    assert not kc.float().isnan().any() and kc.float().abs().max() == 448
    torch.testing.assert_close(got, attention.paged_attention_ref(q, want_k, want_v, cu, sl, pt, 0.3,
                                                                  kv_scales=scales), **TOL)
