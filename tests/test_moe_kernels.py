"""kernels/tsdev_kernels/ops/moe.py on CPU: the Triton path (alignment, both grouped GEMMs, the sum over k) in the
interpreter against the reference; the reference against a naive per-token loop and transformers' Qwen3-MoE block; the
config lookup. Tiny shapes: the interpreter runs one program at a time."""
import json
import logging
import zlib

import pytest
import torch
import torch.nn.functional as F

from tsdev_kernels import ops
from tsdev_kernels.ops import fp8, moe

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests are for CPU machines")

TOL = dict(atol=2e-5, rtol=2e-5)
# a block of 16 slots, 16 columns, 16 of H per step: several blocks per expert, several column tiles and K steps
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)
H, I = 32, 24  # I not a multiple of BLOCK_N


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def experts(E, dtype=torch.float32):
    return (torch.randn(E, 2 * I, H) * 0.3).to(dtype), (torch.randn(E, H, I) * 0.3).to(dtype)


def routing(T, E, K=2, kind="random"):
    """(weights [T, K] float32, ids [T, K] int32): distinct experts per token, as top-k gives."""
    if kind == "random":
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    elif kind == "few":  # only K experts get tokens (1, E - 1 and, for K > 2, from 3 up): 0 and 2 get none
        pool = torch.tensor([1, E - 1] + [e for e in range(3, E - 1)][:K - 2])
        ids = torch.stack([pool[torch.randperm(K)] for _ in range(T)])
    elif kind == "one":  # every token's first choice is expert 2; the rest spread
        ids = torch.stack([torch.cat([torch.tensor([2]), torch.randperm(E - 1)[:K - 1] + 3]) % E for _ in range(T)])
    weights = torch.rand(T, K) + 0.05
    return weights / weights.sum(-1, keepdim=True), ids.int()


def naive_moe(x, w13, w2, weights, ids):
    """Per token, per chosen expert, the dense MLP, float32 throughout."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k].item()
            gate, up = w13[e, :I].double() @ x[t].double(), w13[e, I:].double() @ x[t].double()
            out[t] += weights[t, k].item() * (w2[e].double() @ (F.silu(gate) * up))
    return out


# --- alignment ---------------------------------------------------------------------------------


@pytest.mark.parametrize("T,K,E,block_m", [(1, 2, 4, 16), (5, 2, 8, 16), (17, 2, 4, 16), (17, 4, 8, 32), (3, 1, 6, 16),
                                           (40, 2, 8, 16), (150, 2, 8, 16)])
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "few", "one"])
def test_align_kernel_matches_reference_and_its_contract(T, K, E, block_m, kind):
    _, ids = routing(T, E, K, kind)
    if kind == "random" and T > 1:
        ids = ids.long()  # int64 ids too
    want = moe.moe_align_ref(ids, E, block_m)
    for chunk in (None, 16):  # one program (every case here fits one chunk), and 16-slot chunks (three launches)
        got = moe.moe_align_triton(ids, E, block_m, chunk)
        for g, w in zip(got, want):
            assert g.dtype == torch.int32 and torch.equal(g, w), chunk
    sorted_ids, expert_ids, num_padded = got
    S = T * K
    max_slots, max_blocks = moe.moe_align_sizes(S, E, block_m)
    assert sorted_ids.shape == (max_slots,) and expert_ids.shape == (max_blocks,) and num_padded.shape == (1,)
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    assert num_padded.item() == padded.sum().item()
    used = num_padded.item() // block_m
    assert (expert_ids[used:] == -1).all() and (sorted_ids[num_padded.item():] == S).all()
    real = sorted_ids[sorted_ids < S].long()
    assert sorted(real.tolist()) == list(range(S))  # every (token, k) slot exactly once
    start = 0
    for e in range(E):  # each expert's slots contiguous from its start, in slot order, then its padding
        run = sorted_ids[start:start + padded[e]].long()
        assert run[:counts[e]].tolist() == (flat == e).nonzero().squeeze(1).tolist()
        assert (run[counts[e]:] == S).all()
        assert (expert_ids[start // block_m:(start + padded[e]) // block_m] == e).all()
        start += padded[e].item()


def test_align_sizes_bound_every_routing():
    """The allocation holds the worst case: as many experts as possible with one slot each, the rest on one."""
    for S, E, bm in [(1, 4, 16), (16, 4, 16), (17, 4, 16), (64, 128, 16), (1000, 8, 64), (7, 3, 16)]:
        n = min(E, S)
        worst = (n - 1) + -(-(S - n + 1) // bm)  # n - 1 experts with a slot, one with the rest
        _, blocks = moe.moe_align_sizes(S, E, bm)
        assert blocks >= worst
        ids = torch.cat([torch.arange(n - 1), torch.full((S - n + 1,), n - 1)])[torch.randperm(S)]
        num_padded = moe.moe_align_ref(ids.view(S, 1), E, bm)[2]
        assert num_padded.item() <= blocks * bm and num_padded.item() == worst * bm


# --- the fused op ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 3, 5, 17])
@pytest.mark.parametrize("kind", ["random", "few", "one"])
def test_triton_matches_reference_fp32(T, kind):
    E = 8 if kind == "random" else 4
    x, (w13, w2) = torch.randn(T, H), experts(E)
    weights, ids = routing(T, E, 2, kind)
    want = moe.fused_moe_ref(x, w13, w2, weights, ids)
    got = moe.fused_moe_triton(x, w13, w2, weights, ids, config=SMALL)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got, want, **TOL)


def test_triton_default_config_and_larger_k():
    """moe_config's CPU default (BLOCK_K past H, BLOCK_N past I), K = 4, int64 ids, T*K = 20 (not a multiple)."""
    T, E = 5, 6
    x, (w13, w2) = torch.randn(T, H), experts(E)
    weights, ids = routing(T, E, 4)
    got = moe.fused_moe_triton(x, w13, w2, weights, ids.long())
    torch.testing.assert_close(got, moe.fused_moe_ref(x, w13, w2, weights, ids), **TOL)


def test_triton_is_reproducible_bit_for_bit():
    x, (w13, w2) = torch.randn(17, H), experts(4)
    weights, ids = routing(17, 4)
    first = moe.fused_moe_triton(x, w13, w2, weights, ids, config=SMALL)
    assert torch.equal(first, moe.fused_moe_triton(x, w13, w2, weights, ids, config=SMALL))


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("kind, K", [("random", 2), ("few", 2), ("one", 4)])
def test_the_gemv_path_for_few_tokens_matches_reference_fp32(T, kind, K):
    """Decode's path (no alignment; the sum over k inside the down kernel), also when tokens share experts."""
    E = 8 if kind == "random" else 6
    x, (w13, w2) = torch.randn(T, H), experts(E)
    weights, ids = routing(T, E, K, kind)
    got = moe.fused_moe_gemv_triton(x, w13, w2, weights, ids)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got, moe.fused_moe_ref(x, w13, w2, weights, ids), **TOL)


def test_few_tokens_take_the_gemv_path_and_more_the_aligned_gemms(monkeypatch):
    aligned = []
    align = moe.moe_align_triton
    monkeypatch.setattr(moe, "moe_align_triton", lambda *a, **k: aligned.append(1) or align(*a, **k))
    for T in (1, moe.GEMV_MAX_TOKENS, moe.GEMV_MAX_TOKENS + 1):
        x, (w13, w2) = torch.randn(T, H), experts(4)
        weights, ids = routing(T, 4)
        torch.testing.assert_close(moe.fused_moe_triton(x, w13, w2, weights, ids),
                                   moe.fused_moe_ref(x, w13, w2, weights, ids), **TOL)
    assert len(aligned) == 1


def fp8_experts(E):
    """e4m3 experts with one scale per (expert, row), from random float32 ones (kernels/tsdev_kernels/ops/fp8.py's
    quantizer)."""
    w13, w2 = experts(E)
    (q13, s13), (q2, s2) = fp8.quantize_fp8_rows(w13), fp8.quantize_fp8_rows(w2)
    return q13, s13.squeeze(-1), q2, s2.squeeze(-1)


@pytest.mark.parametrize("T, kind", [(1, "random"), (3, "one"), (9, "random")])
def test_fp8_experts_are_the_dequantized_experts_weight_only_and_w8a8_on_the_aligned_gemms(T, kind):
    """Weight-only FP8 (the GEMV path, one token): e4m3 tiles converted exactly, each GEMM's sum times its (expert,
    row) scale, the input not quantized -- so the same as float32 experts holding the dequantized values (up to
    the order of float32 sums). The aligned GEMMs are W8A8: each GEMM's input rows quantized too (x per token, the
    activation per slot), as the reference does with w8a8."""
    E = 6
    q13, s13, q2, s2 = fp8_experts(E)
    x = torch.randn(T, H)
    weights, ids = routing(T, E, 2, kind)
    scales = dict(w13_scale=s13, w2_scale=s2)
    dequantized = moe.fused_moe_ref(x, fp8.dequantize_fp8_rows(q13, s13), fp8.dequantize_fp8_rows(q2, s2), weights,
                                    ids)
    weight_only = moe.fused_moe_ref(x, q13, q2, weights, ids, **scales, w8a8=False)
    torch.testing.assert_close(weight_only, dequantized, **TOL)
    if T <= moe.GEMV_MAX_TOKENS:
        torch.testing.assert_close(moe.fused_moe_gemv_triton(x, q13, q2, weights, ids, **scales), weight_only, **TOL)
    w8a8 = moe.fused_moe_ref(x, q13, q2, weights, ids, **scales, w8a8=True)
    torch.testing.assert_close(moe.fused_moe_triton(x, q13, q2, weights, ids, config=SMALL, **scales), w8a8, **TOL)
    # BLOCK_M 64 with `fp8_wgmma`: each K block's product summed from zero into the float32 sum (on the GPU the e4m3
    # wgmma; benchmarks/fp8_moe_accuracy.py), the same arithmetic up to the order of float32 sums
    promoted = dict(SMALL, BLOCK_M=64, fp8_wgmma=True)
    torch.testing.assert_close(moe.fused_moe_triton(x, q13, q2, weights, ids, config=promoted, **scales), w8a8, **TOL)
    torch.testing.assert_close(moe.fused_moe_ref(x, q13, q2, weights, ids, **scales),
                               w8a8 if T > moe.GEMV_MAX_TOKENS else weight_only, rtol=0, atol=0)  # the default
    activations_quantized = (w8a8 - weight_only).abs().max()
    assert 1e-4 < activations_quantized < 0.05 * weight_only.abs().max()  # a quantization's error, not garbage
    unscaled = moe.fused_moe_ref(x, q13.float(), q2.float(), weights, ids)
    assert (weight_only - unscaled).abs().max() > 0.1  # the scales matter


@pytest.mark.parametrize("T, kind", [(1, "few"), (2, "one"), (3, "random")])
def test_the_fp8_gemv_path_is_the_weight_only_reference_and_each_rows_own_scale_counts(T, kind):
    """The two GEMV launches on e4m3 experts (one token when serving; a few here too): each slot's rows converted
    exactly, each sum times its (expert, row) scale -- the weight-only reference, also where tokens share one expert
    or only two experts get any; the same scales on other rows of their expert give another result."""
    E = 6
    q13, s13, q2, s2 = fp8_experts(E)
    x = torch.randn(T, H)
    weights, ids = routing(T, E, 2, kind)
    want = moe.fused_moe_ref(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, w8a8=False)
    got = moe.fused_moe_gemv_triton(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(got, want, **TOL)
    for wrong in (dict(w13_scale=s13.flip(-1), w2_scale=s2), dict(w13_scale=s13, w2_scale=s2.roll(1, -1))):
        assert not torch.allclose(moe.fused_moe_gemv_triton(x, q13, q2, weights, ids, **wrong), want, **TOL)


def test_the_row_quantizer_kernel_is_torchs_where_the_interpreter_casts_exactly():
    """One launch per matrix (a row per program): scale amax / 448 (1 for a zero row), values on e4m3's grid. Values
    that e4m3 holds exactly after the division (the interpreter's cast rounds others a binade down; the GPU test
    compares random rows bit for bit)."""
    grid = fp8.quantize_fp8_rows(torch.randn(6, 40) * 100)[0].float()  # e4m3 values
    grid[:, 0] = 448.0  # each row's amax: its scale is then the power of two below
    t = grid * torch.tensor([2.0**-3, 1.0, 2.0**5, 2.0**-10, 0.5, 0.0])[:, None]
    q, scales = fp8.quantize_fp8_rows_triton(t)
    want_q, want_scales = fp8.quantize_fp8_rows(t)
    assert torch.equal(scales, want_scales.squeeze(-1)) and scales[-1] == 1.0
    assert torch.equal(q.float(), want_q.float()) and q.dtype == torch.float8_e4m3fn


def truncate_bf16(t):
    """float32 -> bf16 as the interpreter casts: the low 16 bits dropped (a GPU rounds to nearest)."""
    return (t.float().view(torch.int32) & -65536).view(torch.float32).bfloat16()


def rounded_moe(x, w13, w2, weights, ids, rnd):
    """The reference's arithmetic slot by slot, with rnd as the kernels' rounding to bf16 (the sum over k, in torch
    on both paths, rounds to nearest)."""
    T, K = ids.shape
    per_slot = torch.zeros(T, K, H)
    for t in range(T):
        for k in range(K):
            e = ids[t, k].item()
            gu = rnd(x[t].float() @ w13[e].float().T).float()
            h = rnd(rnd(F.silu(gu[:I])).float() * gu[I:]).float()
            per_slot[t, k] = rnd(rnd(w2[e].float() @ h).float() * weights[t, k]).float()
    return per_slot.sum(1).bfloat16()


@pytest.mark.parametrize("T,kind", [(3, "random"), (17, "one")])
def test_triton_bf16(T, kind):
    """bf16 in, float32 inside, rounded to bf16 where the reference rounds. The interpreter truncates its casts to
    bf16 (docs/kernels.md) where a GPU rounds to nearest, so the kernels are checked against the same arithmetic
    truncating (a float32 sum in another order may still cross a truncation point: an ulp here and there), and that
    arithmetic rounding to nearest against the reference."""
    E = 4
    x, (w13, w2) = torch.randn(T, H).bfloat16(), experts(E, torch.bfloat16)
    weights, ids = routing(T, E, 2, kind)
    weights = weights.bfloat16().float()  # as the router rounds them
    got = moe.fused_moe_triton(x, w13, w2, weights, ids, config=SMALL)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # (bit for bit on every seed tried; a few elements an ulp apart would still be right)
    nearest = rounded_moe(x, w13, w2, weights, ids, lambda t: t.bfloat16())
    for want, have in ((rounded_moe(x, w13, w2, weights, ids, truncate_bf16), got),
                       (moe.fused_moe_ref(x, w13, w2, weights, ids), nearest)):
        assert torch.isclose(have.float(), want.float(), atol=1e-3, rtol=8e-3).all()  # at most an ulp
        assert (have == want).float().mean() > 0.95


def test_gemm_skips_unused_blocks_and_writes_only_real_slots():
    """The gated GEMM writes every slot's row once and nothing for pad entries (NaN-filled output stays NaN
    nowhere; pad slot id = T*K would be out of bounds)."""
    T, E, K = 5, 8, 2
    x, (w13, _) = torch.randn(T, H), experts(E)
    _, ids = routing(T, E, K, "few")
    sorted_ids, expert_ids, _ = moe.moe_align_triton(ids, E, 16)
    assert (expert_ids == -1).any()  # the allocation's spare blocks
    inter = torch.full((T * K, I), float("nan"))
    moe._moe_gated_gemm[(expert_ids.numel(), 2)](x, x, w13, x, inter, sorted_ids, expert_ids, x, I, H, T * K, K,
                                                 x.stride(0), 0, w13.stride(0), w13.stride(1), 0, 0, inter.stride(0),
                                                 MUL_WEIGHT=False, HAS_SCALE=False, A_FP8=False, SCALE_BLOCK_N=0,
                                                 QUANTIZE_A=False, F32_DOT=True, FP8_WGMMA=False, BLOCK_M=16,
                                                 BLOCK_N=16, BLOCK_K=16, PDL=False)
    flat = ids.reshape(-1).long()
    gu = torch.einsum("sh,sih->si", x[torch.arange(T * K) // K], w13[flat])
    torch.testing.assert_close(inter, F.silu(gu[:, :I]) * gu[:, I:], **TOL)


def test_public_op_uses_the_reference_on_cpu(monkeypatch):
    def triton_called(*args, **kwargs):
        raise AssertionError("a Triton entry point ran for CPU tensors")

    monkeypatch.setattr(moe, "fused_moe_triton", triton_called)
    monkeypatch.setattr(moe, "moe_align_triton", triton_called)
    x, (w13, w2) = torch.randn(3, H), experts(4)
    weights, ids = routing(3, 4)
    assert torch.equal(moe.fused_moe(x, w13, w2, weights, ids), moe.fused_moe_ref(x, w13, w2, weights, ids))
    for got, want in zip(moe.moe_align(ids, 4, 16), moe.moe_align_ref(ids, 4, 16)):
        assert torch.equal(got, want)


# --- the reference -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "few", "one"])
def test_reference_matches_a_naive_per_token_loop(kind):
    T, E = 7, 6
    x, (w13, w2) = torch.randn(T, H), experts(E)
    weights, ids = routing(T, E, 2, kind)
    got = moe.fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), naive_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    # the masked form (what runs inside a CUDA graph capture) gives the same
    torch.testing.assert_close(moe.fused_moe_ref(x, w13, w2, weights, ids, masked=True), got, atol=1e-6, rtol=1e-6)
    xb, w13b, w2b, wb = x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights.bfloat16().float()
    torch.testing.assert_close(moe.fused_moe_ref(xb, w13b, w2b, wb, ids, masked=True),
                               moe.fused_moe_ref(xb, w13b, w2b, wb, ids), atol=1e-2, rtol=1e-2)


def hf_block(E, K, norm_topk_prob, implementation):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                         norm_topk_prob=norm_topk_prob)
    config._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.normal_()
        block.experts.gate_up_proj.normal_(std=0.3)
        block.experts.down_proj.normal_(std=0.3)
    return block


def hf_routing(block, x, norm_topk_prob):
    """transformers' router, as its code reads: softmax (float32) over all experts, top-k, renormalised if
    norm_topk_prob, rounded to x's dtype."""
    probs = torch.softmax(F.linear(x, block.gate.weight), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, block.gate.top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(x.dtype).float(), ids.int()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_reference_matches_transformers_qwen3_moe_block(norm_topk_prob, implementation):
    E, K, T = 8, 2, 9
    block = hf_block(E, K, norm_topk_prob, implementation)
    x = torch.randn(T, H)
    with torch.no_grad():
        want = block(x.view(1, T, H)).view(T, H)
        _, hf_weights, hf_ids = block.gate(x)
    weights, ids = hf_routing(block, x, norm_topk_prob)
    assert torch.equal(hf_ids.int(), ids) and torch.equal(hf_weights.float(), weights)
    w13, w2 = block.experts.gate_up_proj.data, block.experts.down_proj.data  # [E, 2I, H] gate rows first, [E, H, I]
    torch.testing.assert_close(moe.fused_moe_ref(x, w13, w2, weights, ids), want, **TOL)
    torch.testing.assert_close(moe.fused_moe_triton(x, w13, w2, weights, ids, config=SMALL), want, **TOL)


def test_reference_is_transformers_default_experts_bit_for_bit_in_bf16():
    """bf16, K = 4: the reference rounds where transformers' default (grouped_mm) experts do, and sums over k in
    float32 as they do (its eager loop adds in bf16, one rounding per expert: it differs from K = 3 on)."""
    E, K, T = 8, 4, 9
    block = hf_block(E, K, True, "grouped_mm").to(torch.bfloat16)
    x = torch.randn(T, H).bfloat16()
    with torch.no_grad():
        want = block(x.view(1, T, H)).view(T, H)
    weights, ids = hf_routing(block, x, True)
    got = moe.fused_moe_ref(x, block.experts.gate_up_proj.data, block.experts.down_proj.data, weights, ids)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


# --- configs -----------------------------------------------------------------------------------


def test_config_file_nearest_bucket_and_one_warning_when_missing(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(moe, "CONFIG_DIR", tmp_path)
    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path / "cache"))  # (no user file)
    monkeypatch.setattr(moe, "device_name", lambda device: "NVIDIA H200")
    moe._moe_table.cache_clear(), ops.tuned_configs.cache_clear()
    tuned = {str(t): dict(BLOCK_M=16 if t < 64 else 64, BLOCK_N=32 + t, BLOCK_K=64, num_warps=4, num_stages=3)
             for t in (1, 16, 64, 256)}
    path = moe.moe_config_path(8, 24, 32, torch.bfloat16, "NVIDIA H200")
    assert path.name == "E=8,I=24,H=32,dtype=bfloat16,device=NVIDIA_H200.json"
    path.write_text(json.dumps(tuned))
    with caplog.at_level(logging.WARNING, logger=moe.tuned_log.name):
        for tokens, bucket in [(1, 1), (7, 1), (9, 16), (40, 16), (41, 64), (100, 64), (5000, 256)]:
            assert moe.moe_config(8, 24, 32, torch.bfloat16, tokens) == tuned[str(bucket)], tokens
        assert not caplog.records
        for tokens in (1, 16, 500):  # no file for this shape: defaults, one warning naming the file and the command
            assert moe.moe_config(4, 24, 32, torch.bfloat16, tokens) == moe.default_moe_config(tokens)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "E=4,I=24,H=32,dtype=bfloat16 for the NVIDIA H200" in message
    assert "tsdev tune --moe 4,24,32 --kinds bf16 (" in message
    with caplog.at_level(logging.WARNING, logger=moe.tuned_log.name):  # FP8 experts' file: the command says fp8
        moe.moe_config(4, 24, 32, torch.float8_e4m3fn, 1)
    assert "--moe 4,24,32 --kinds fp8" in caplog.records[-1].getMessage()
    # block-FP8 experts: their own file; without it the per-row FP8 file of the shape, the warning naming both
    fp8_tuned = {"1": dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=2)}
    moe.moe_config_path(8, 24, 32, torch.float8_e4m3fn, "NVIDIA H200").write_text(json.dumps(fp8_tuned))
    block_path = moe.moe_config_path(8, 24, 32, torch.float8_e4m3fn, "NVIDIA H200", (128, 128))
    assert block_path.name == "E=8,I=24,H=32,dtype=float8_e4m3fn,block=128x128,device=NVIDIA_H200.json"
    with caplog.at_level(logging.WARNING, logger=moe.tuned_log.name):
        assert moe.moe_config(8, 24, 32, torch.float8_e4m3fn, 3, block=(128, 128)) == fp8_tuned["1"]
    assert "E=8,I=24,H=32,dtype=float8_e4m3fn,block=128x128" in caplog.records[-1].getMessage()
    assert "using the FP8 experts' configs" in caplog.records[-1].getMessage()
    assert "--kinds block-fp8" in caplog.records[-1].getMessage()
    block_tuned = {"1": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)}
    block_path.write_text(json.dumps(block_tuned))
    moe._moe_table.cache_clear(), ops.tuned_configs.cache_clear()  # (found once per process per shape and file)
    assert moe.moe_config(8, 24, 32, torch.float8_e4m3fn, 3, block=(128, 128)) == block_tuned["1"]
    moe._moe_table.cache_clear()


def test_config_on_cpu_is_the_default_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger=moe.tuned_log.name):
        assert moe.moe_config(128, 768, 2048, torch.bfloat16, 1, device="cpu") == moe.default_moe_config(1)
        assert moe.moe_config(128, 768, 2048, torch.bfloat16, 512, device="cpu")["BLOCK_M"] == 64
    assert not caplog.records


@pytest.mark.slow
def test_tuner_imports_and_prints_help():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "tune_moe.py"
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "--experts" in result.stdout and "--intermediate" in result.stdout and "--hidden" in result.stdout
    assert "--resume" in result.stdout and "--block-fp8" in result.stdout and "--fp8 " in result.stdout


def test_a_stopped_tuning_resumes_from_the_buckets_it_wrote(tmp_path, monkeypatch):
    """The file is written after each token bucket; a run stopped in the third (Ctrl-C, a lost machine) leaves the
    first two, and --resume times only the buckets missing, keeping the others as written. The GPU's timing is
    stood in for by a clock that prefers one config per bucket."""
    import argparse
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import tune_moe

    real_generator, timed = torch.Generator, []
    monkeypatch.setattr(torch, "Generator", lambda device=None: real_generator())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA Test")
    monkeypatch.setattr(tune_moe, "inputs", lambda tokens, args, dtype, generator: (tokens,))

    def clock(config, rep, tokens):
        if stop_at == tokens:
            raise KeyboardInterrupt
        timed.append(tokens)
        return 1.0 + abs(config["BLOCK_M"] - min(tokens, 64)) + config["num_warps"] / 100

    out = tmp_path / "tuned.json"
    args = argparse.Namespace(experts=4, intermediate=32, hidden=32, topk=2, dtype="bfloat16", tokens=[1, 16, 64],
                              rep=1, quick=True, fp8=False, block_fp8=False, fp8_wgmma=False, jobs=1, out=str(out),
                              resume=False)
    monkeypatch.setattr(tune_moe, "time_ms", clock)
    stop_at = 64
    with pytest.raises(KeyboardInterrupt):
        tune_moe.main(args)
    first = json.loads(out.read_text())
    assert list(first) == ["1", "16"] and first["1"]["BLOCK_M"] == 16 and first["16"]["num_warps"] == 4
    timed.clear()
    stop_at = None
    tune_moe.main(argparse.Namespace(**{**vars(args), "resume": True}))
    resumed = json.loads(out.read_text())
    assert set(timed) == {64} and list(resumed) == ["1", "16", "64"]
    assert {k: resumed[k] for k in first} == first and resumed["64"]["BLOCK_M"] == 64


def test_the_tuner_tries_the_fp8_wgmma_only_where_triton_would_run_it():
    """`fp8_wgmma` changes nothing below BLOCK_M 64 (mma.sync either way): the tuner does not time those twins."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import tune_moe

    grid = tune_moe.GRID | dict(fp8_wgmma=(False, True))
    configs = list(tune_moe.candidates(4096, 8, 128, grid))
    wgmma = [c for c in configs if c["fp8_wgmma"]]
    assert wgmma and all(c["BLOCK_M"] >= 64 for c in wgmma)
    assert {c["BLOCK_M"] for c in configs if not c["fp8_wgmma"]} == set(tune_moe.GRID["BLOCK_M"])


def test_the_tuner_compiles_its_grid_in_worker_processes_and_counts_the_launches_that_fail():
    """`tune_moe.py --jobs N` runs each (tokens, config) once in N spawned processes before timing anything (so
    Triton's cache on disk holds the binaries): every launch runs, and one that cannot compile (a BLOCK_N that is
    not a power of two) is counted, not fatal. On CPU tensors under the interpreter here; on the GPU the same."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import tune_moe

    args = argparse.Namespace(experts=4, intermediate=32, hidden=32, topk=2, dtype="float32", fp8=False,
                              block_fp8=False)
    good = [dict(SMALL, BLOCK_M=m) for m in (16, 32)]
    work = [(tokens, config) for tokens in (3, 20) for config in good] + [(3, dict(SMALL, BLOCK_N=24))]
    assert tune_moe.compile_chunk(vars(args), work, device="cpu") == 1
    assert tune_moe.precompile(args, work, jobs=2, device="cpu") == 1


def test_a_tensor_parallel_rank_looks_up_the_file_of_its_shard(monkeypatch):
    """Under --tp N each rank holds I/N of every expert's features: its GEMMs read the tuned file of that width
    (benchmarks/tune_moe.py --intermediate I/N), found by the shard's own shape."""
    asked = []
    monkeypatch.setattr(moe, "moe_config", lambda *args, **kwargs: asked.append(args) or SMALL)
    E, T, shard = 6, 5, I // 2
    w13, w2 = experts(E)
    x, (weights, ids) = torch.randn(T, H), routing(T, E, 2)
    rank_w13 = torch.cat([w13[:, :shard], w13[:, I:I + shard]], dim=1)  # rank 0's gate rows, then its up rows
    moe.fused_moe_triton(x, rank_w13, w2[:, :, :shard].contiguous(), weights, ids)
    assert asked == [(E, shard, H, torch.float32, T)]


@pytest.mark.parametrize("T, kind", [(1, "random"), (6, "one"), (11, "random")])
def test_block_fp8_experts_on_the_aligned_gemms_are_the_block_reference(T, kind):
    """A block-FP8 checkpoint's experts (128 x 128 blocks of scales per expert; gate's rows of blocks, then up's):
    each GEMM's input quantized per row and group of 128 columns, each K block's e4m3 product times both scales into
    a float32 sum -- the reference's `fp8_block_linear_ref` per expert, up to the order of float32 sums; partial
    blocks along H (200 = 128 + 72)."""
    from tsdev_kernels.ops import fp8_block

    E, hidden, inter = 3, 200, 256
    g = torch.Generator().manual_seed(T)
    w13 = torch.randn(E, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(E, hidden, inter, generator=g) * inter**-0.5
    (q13, s13), (q2, s2) = ([torch.stack(t) for t in zip(*map(fp8_block.quantize_fp8_blocks, w))] for w in (w13, w2))
    assert s13.shape == (E, 4, 2) and s2.shape == (E, 2, 2)
    x = torch.randn(T, hidden, generator=g)
    weights, ids = routing(T, E, 2, kind)
    scales = dict(w13_scale=s13, w2_scale=s2, block=(128, 128))
    want = moe.fused_moe_ref(x, q13, q2, weights, ids, **scales)
    got = moe.fused_moe_triton(x, q13, q2, weights, ids, config=dict(SMALL, BLOCK_N=256), **scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wgmma = moe.fused_moe_triton(x, q13, q2, weights, ids, config=dict(SMALL, BLOCK_M=64, fp8_wgmma=True), **scales)
    torch.testing.assert_close(wgmma, want, rtol=1e-5, atol=1e-5)
    exact = moe.fused_moe_ref(x, w13, w2, weights, ids)
    assert 0 < (got - exact).abs().max() < 0.1 * exact.abs().max()  # FP8's rounding, not garbage


@pytest.mark.parametrize("block_m", [16, 64])
def test_block_fp8_gemms_quantizing_their_own_tiles_are_the_two_launch_path(block_m, monkeypatch):
    """On CUDA, where the tuned configuration says `quantize_inside`, each aligned GEMM of block-FP8 experts quantizes
    its input tiles itself (`quantize_tile`, no quantization launch before it): the same e4m3 values and scales as the
    token-group kernel's, so the same layer to float32 order. Both ways here under the interpreter: the Triton
    quantization in front (its cast is the interpreter's, as the GEMM's is), against the GEMMs quantizing inside;
    partial blocks along H, an all-zero row."""
    from tsdev_kernels.ops import fp8_block

    E, hidden, inter, T = 3, 200, 256, 7
    g = torch.Generator().manual_seed(block_m)
    w13 = torch.randn(E, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(E, hidden, inter, generator=g) * inter**-0.5
    (q13, s13), (q2, s2) = ([torch.stack(t) for t in zip(*map(fp8_block.quantize_fp8_blocks, w))] for w in (w13, w2))
    x = torch.randn(T, hidden, generator=g) * 3
    x[2] = 0
    weights, ids = routing(T, E, 2, "random")
    scales = dict(w13_scale=s13, w2_scale=s2, block=(128, 128))
    config = dict(SMALL, BLOCK_M=block_m, BLOCK_N=128, quantize_inside=True)  # (as `tsdev tune` writes it)
    monkeypatch.setattr(moe, "_quantized", lambda t, group: fp8_block.quantize_fp8_token_groups_triton(t, group))
    two_launches = moe.fused_moe_triton(x, q13, q2, weights, ids, config=config, **scales)  # off CUDA: launches
    monkeypatch.setattr(moe, "_quantizes_in_gemm", lambda x, block: block is not None)  # as on CUDA
    inside = moe.fused_moe_triton(x, q13, q2, weights, ids, config=config, **scales)
    assert moe.fused_moe_triton(x, q13, q2, weights, ids, config=dict(config, quantize_inside=False),
                                **scales).equal(two_launches)  # a configuration without it: two launches
    torch.testing.assert_close(inside, two_launches, rtol=1e-5, atol=1e-5)
    assert not inside[2].any() and inside.abs().max() > 0.1
