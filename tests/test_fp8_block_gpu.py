"""Block-FP8 kernels on the H200 (`pytest -m gpu tests/test_fp8_block_gpu.py`): the token-group quantization bit for
bit torch's on fresh random activations, and the block linear (quantization + block GEMM) against its torch reference
at Qwen3-8B's projection shapes, on both of Hopper's instruction paths (BLOCK_M 16: mma.sync; 64: the FP8 wgmma, whose
reduced-precision sums the K loop restarts every block), and the block-FP8 experts on the aligned MoE GEMMs. Until
these pass, layers and experts run the reference."""
import pytest
import torch

from tsdev_kernels.ops.fp8_block import (fp8_block_gemm_ref, fp8_block_gemm_triton, fp8_block_linear,
                                         fp8_block_linear_ref, fp8_block_linear_triton, fp8_block_scaled_mm,
                                         quantize_fp8_blocks, quantize_fp8_token_groups,
                                         quantize_fp8_token_groups_triton, scaled_mm_available)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens, k", [(1, 4096), (64, 12288), (300, 1000)])
def test_the_token_group_kernel_is_torchs_bit_for_bit(tokens, k):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn(tokens, k, generator=g, device="cuda") * 7).bfloat16()
    x[0, :128] = 0
    q, scale = quantize_fp8_token_groups_triton(x)
    want_q, want_scale = quantize_fp8_token_groups(x)
    assert torch.equal(scale, want_scale) and scale[0, 0] == 1
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("config", [(16, 64, 4), (64, 128, 4)], ids=["mma", "wgmma"])
@pytest.mark.parametrize("tokens, n, k", [(1, 6144, 4096), (16, 4096, 4096), (256, 24576, 4096), (200, 4096, 12288)])
def test_the_block_linear_is_its_reference_in_bf16(tokens, n, k, config):
    g = torch.Generator(device="cuda").manual_seed(n + tokens)
    weight, scale_inv = quantize_fp8_blocks(torch.randn(n, k, generator=g, device="cuda") * k**-0.5)
    x = torch.randn(tokens, k, generator=g, device="cuda").bfloat16()
    ref = fp8_block_linear_ref(x, weight, scale_inv).float()
    xq, x_scale = quantize_fp8_token_groups_triton(x)
    ours = fp8_block_gemm_triton(xq, x_scale, weight, scale_inv, out_dtype=torch.bfloat16, config=config).float()
    assert (ours - ref).abs().max() / ref.abs().max() < 6e-3  # a bf16 rounding's few 1e-3 at most
    fused = fp8_block_gemm_triton(x, None, weight, scale_inv, out_dtype=torch.bfloat16, config=config).float()
    assert (fused - ref).abs().max() / ref.abs().max() < 6e-3  # its tiles quantized inside the kernel
    served = fp8_block_linear_triton(x, weight, scale_inv).float()  # as served, the default configuration
    assert (served - ref).abs().max() / ref.abs().max() < 6e-3


@pytest.mark.parametrize("block_m", [16, 64], ids=["mma", "wgmma"])
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_block_fp8_experts_are_their_reference_at_qwen3_30b_a3bs_layer(tokens, block_m):
    """128 experts, top 8, I 768 (six blocks), H 2048: each expert's blocks quantized as the checkpoint stores them."""
    from tsdev_kernels.ops import moe

    E, K, I, H = 128, 8, 768, 2048
    g = torch.Generator(device="cuda").manual_seed(tokens)
    blocks = [[quantize_fp8_blocks(w) for w in torch.randn(E, rows, cols, generator=g, device="cuda") * cols**-0.5]
              for rows, cols in ((2 * I, H), (H, I))]
    (q13, s13), (q2, s2) = ([torch.stack(t) for t in zip(*b)] for b in blocks)
    x = torch.randn(tokens, H, generator=g, device="cuda").bfloat16()
    weights, ids = torch.randn(tokens, E, generator=g, device="cuda").softmax(-1).topk(K, dim=-1)
    weights, ids = (weights / weights.sum(-1, keepdim=True)).float(), ids.int()
    scales = dict(w13_scale=s13, w2_scale=s2, block=(128, 128))
    ref = moe.fused_moe_ref(x, q13, q2, weights, ids, **scales).float()
    config = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    ours = moe.fused_moe_triton(x, q13, q2, weights, ids, config=config, **scales).float()
    assert (ours - ref).abs().max() / ref.abs().max() < 6e-3


@pytest.mark.parametrize("tokens, n, k", [(1, 6144, 4096), (7, 4096, 4096), (256, 24576, 4096), (2048, 4096, 12288)])
def test_scaled_mm_with_block_scales_is_the_block_gemm_reference(tokens, n, k, monkeypatch):
    """cuBLASLt's block-scaled GEMM (the route `uses_scaled_mm` takes where it is faster) computes
    `fp8_block_gemm_ref`'s product, rows padded to a multiple of 4 and cut off; the served op under
    TSDEV_KERNELS=cublas:fp8 too. Skipped where this torch / GPU has none (the op then serves Triton)."""
    if not scaled_mm_available(torch.device("cuda")):
        pytest.skip(f"torch {torch.__version__} has no block-scaled _scaled_mm on this GPU (sm_90, CUDA >= 12.9)")
    g = torch.Generator(device="cuda").manual_seed(n + tokens)
    weight, scale_inv = quantize_fp8_blocks(torch.randn(n, k, generator=g, device="cuda") * k**-0.5)
    x = torch.randn(tokens, k, generator=g, device="cuda").bfloat16()
    xq, x_scale = quantize_fp8_token_groups_triton(x)
    ref = fp8_block_gemm_ref(xq, x_scale, weight, scale_inv)
    ours = fp8_block_scaled_mm(xq, x_scale, weight, scale_inv).float()
    assert ours.shape == (tokens, n)
    assert (ours - ref).abs().max() / ref.abs().max() < 6e-3  # a bf16 rounding's few 1e-3 at most
    monkeypatch.setenv("TSDEV_KERNELS", "cublas:fp8")
    served = fp8_block_linear(x, weight, scale_inv).float()
    assert (served - fp8_block_linear_ref(x, weight, scale_inv).float()).abs().max() / ref.abs().max() < 6e-3
