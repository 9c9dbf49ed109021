"""Block-quantized FP8 as shipped checkpoints store it (kernels/tsdev_kernels/ops/fp8_block.py): the writer against
transformers' own fine-grained FP8 quantizer, partial blocks at the edges, the dequantized weight against the one
quantized, and the w8a8-block reference arithmetic against a loop over the blocks and against the unquantized product.
Fresh random inputs."""
import pytest
import torch

from tsdev_kernels.ops.fp8_block import (E4M3_MAX, dequantize_fp8_blocks, fp8_block_linear_ref, quantize_fp8_blocks,
                                         quantize_fp8_token_groups)


def test_the_writer_stores_what_transformers_fine_grained_fp8_quantizer_stores():
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 384, generator=g) * torch.rand(256, 1, generator=g) * 3).bfloat16()
    weight[:128, :128] = 0  # an all-zero block: scale 1
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=[128, 128],
                                                                                 scale_fmt=None)))
    theirs = quantizer.convert({"layer.weight": weight})
    q, scale_inv = quantize_fp8_blocks(weight)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32 and scale_inv.shape == (2, 3)
    assert torch.equal(q.view(torch.uint8), theirs["layer.weight"].view(torch.uint8))
    assert torch.equal(scale_inv, theirs["layer.weight_scale_inv"])
    assert scale_inv[0, 0] == 1.0


@pytest.mark.parametrize("n, k", [(200, 300), (128, 128), (7, 130)])
def test_partial_blocks_at_the_edges_and_the_dequantized_weight_is_within_e4m3s_rounding(n, k):
    g = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k)[None, :]  # magnitudes vary across blocks
    q, scale_inv = quantize_fp8_blocks(weight)
    assert q.shape == (n, k) and scale_inv.shape == (-(-n // 128), -(-k // 128))
    back = dequantize_fp8_blocks(q, scale_inv)
    scales = scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    # e4m3: 3 mantissa bits, so a normal value rounds within 1/16 of itself; subnormals within half their step
    assert ((back - weight).abs() <= weight.abs() / 16 + scales * 2.0**-10).all()
    for bn in range(scale_inv.shape[0]):  # each block's largest magnitude maps to 448 exactly
        for bk in range(scale_inv.shape[1]):
            tile = weight[bn * 128:(bn + 1) * 128, bk * 128:(bk + 1) * 128]
            assert torch.isclose(tile.abs().max() / scale_inv[bn, bk], torch.tensor(E4M3_MAX), rtol=1e-6)
    with pytest.raises(ValueError, match="expected"):
        dequantize_fp8_blocks(q, torch.ones(scale_inv.shape[0] + 1, scale_inv.shape[1]))


def test_activations_are_quantized_per_token_and_group():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, generator=g) * torch.tensor([0.01, 1, 10, 100, 0.5])[:, None]
    x[2, 128:256] = 0
    q, scale = quantize_fp8_token_groups(x)
    assert q.shape == (5, 300) and scale.shape == (5, 3) and scale[2, 1] == 1.0
    for t in range(5):
        for group in range(3):
            columns = slice(group * 128, min((group + 1) * 128, 300))
            if x[t, columns].abs().max() > 0:
                assert torch.isclose(q[t, columns].float().abs().max(), torch.tensor(E4M3_MAX))


def loop_over_blocks(x, q, scale_inv):
    """The same arithmetic written the plain way: one block of the weight at a time."""
    xq, x_scale = quantize_fp8_token_groups(x)
    n, k = q.shape
    y = torch.zeros(x.shape[0], n)
    for bn in range(scale_inv.shape[0]):
        rows = slice(bn * 128, min((bn + 1) * 128, n))
        for bk in range(scale_inv.shape[1]):
            cols = slice(bk * 128, min((bk + 1) * 128, k))
            y[:, rows] += (xq[:, cols].float() @ q[rows, cols].float().t()) * x_scale[:, bk:bk + 1] * scale_inv[bn, bk]
    return y


@pytest.mark.parametrize("tokens, n, k", [(1, 256, 384), (9, 200, 300), (33, 128, 1024)])
def test_the_block_linear_reference_is_the_blockwise_sum_and_close_to_the_unquantized_product(tokens, n, k):
    g = torch.Generator().manual_seed(tokens + n)
    x = torch.randn(tokens, k, generator=g)
    weight = torch.randn(n, k, generator=g) * k**-0.5
    bias = torch.randn(n, generator=g)
    q, scale_inv = quantize_fp8_blocks(weight)
    y = fp8_block_linear_ref(x, q, scale_inv, bias=bias)
    torch.testing.assert_close(y, loop_over_blocks(x, q, scale_inv) + bias, rtol=1e-5, atol=1e-5)
    exact = x @ weight.t() + bias
    cosine = torch.nn.functional.cosine_similarity(y.flatten(), exact.flatten(), dim=0)
    assert cosine > 0.999, cosine
    assert fp8_block_linear_ref(x.bfloat16(), q, scale_inv).dtype == torch.bfloat16
    assert fp8_block_linear_ref(x.view(1, tokens, k), q, scale_inv).shape == (1, tokens, n)


def test_the_token_group_kernel_is_the_reference_where_the_interpreter_casts_exactly():
    """One program per token and group. Values e4m3 holds exactly after the division (each group's largest 448 times
    a power of two; an all-zero group: scale 1) -- the interpreter's cast rounds others a binade down; the GPU test
    compares random values bit for bit."""
    from tsdev_kernels.ops.fp8_block import quantize_fp8_token_groups_triton

    g = torch.Generator().manual_seed(5)
    grid = quantize_fp8_token_groups(torch.randn(3, 300, generator=g) * 50)[0].float()
    grid[:, ::128] = 448.0  # each group's amax
    t = grid * torch.tensor([2.0**-4, 1.0, 8.0])[:, None]
    t[1, 128:256] = 0
    q, scale = quantize_fp8_token_groups_triton(t)
    want_q, want_scale = quantize_fp8_token_groups(t)
    assert scale.shape == (3, 3) and torch.equal(scale, want_scale) and scale[1, 1] == 1
    assert torch.equal(q.float(), want_q.float())


@pytest.mark.parametrize("tokens, n, k", [(1, 256, 384), (5, 200, 300), (40, 128, 130)])
def test_the_block_gemm_kernel_is_the_block_linear_reference(tokens, n, k):
    """Given the token-group quantization, the kernel's K loop (a block's product from zero, times both scales, into
    a float32 sum) is the reference's blockwise sum up to float32 order; partial blocks at both edges, a bias."""
    from tsdev_kernels.ops.fp8_block import fp8_block_gemm_triton

    g = torch.Generator().manual_seed(tokens)
    weight, scale_inv = quantize_fp8_blocks(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g))
    x, bias = torch.randn(tokens, k, generator=g) * 3, torch.randn(n, generator=g)
    xq, x_scale = quantize_fp8_token_groups(x)
    got = fp8_block_gemm_triton(xq, x_scale, weight, scale_inv, bias=bias, out_dtype=torch.float32)
    torch.testing.assert_close(got, fp8_block_linear_ref(x, weight, scale_inv, bias=bias), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got, fp8_block_linear_ref(x, weight, scale_inv), rtol=1e-5, atol=1e-4)  # the bias


@pytest.mark.parametrize("tokens, n, k, split_k", [(5, 200, 300, 1), (40, 128, 130, 1), (20, 200, 600, 3)])
def test_the_block_gemm_quantizing_its_own_tiles_is_the_two_launch_path(tokens, n, k, split_k):
    """x_scale None: the kernel quantizes each activation tile per token and K block itself -- the same products as
    quantizing first (`quantize_fp8_token_groups`), so the same output to float32 order; partial groups at the K
    edge, a zero group (scale 1), a bias, K split. Values e4m3 holds exactly after the division (the interpreter's
    cast rounds others a binade down; the GPU test draws random ones)."""
    from tsdev_kernels.ops.fp8_block import _check_activations, fp8_block_gemm_triton

    g = torch.Generator().manual_seed(tokens + split_k)
    weight, scale_inv = quantize_fp8_blocks(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g))
    x, bias = _check_activations(tokens, k, torch.float32, "cpu", g), torch.randn(n, generator=g)
    x[1, :128] = 0
    xq, x_scale = quantize_fp8_token_groups(x)
    want = fp8_block_gemm_triton(xq, x_scale, weight, scale_inv, bias=bias, out_dtype=torch.float32,
                                 config=(16, 64, 4, split_k))
    got = fp8_block_gemm_triton(x, None, weight, scale_inv, bias=bias, out_dtype=torch.float32,
                                config=(16, 64, 4, split_k))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got, fp8_block_linear_ref(x, weight, scale_inv, bias=bias), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got, fp8_block_linear_ref(x * 1.5, weight, scale_inv, bias=bias), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("split_k", [2, 3, 5])
def test_the_block_gemm_split_over_k_is_the_reference_and_leaves_its_counters_zero(split_k):
    """K cut into shares (5 blocks in 3 shares: 2, 2, 1), each program's share into a float32 partial, the last of a
    tile's shares to arrive summing them in order: the reference up to float32 order, bias added once, partial
    tiles at the M and N edges, and every arrival counter zero again for the next launch."""
    from tsdev_kernels.ops import split_arrivals
    from tsdev_kernels.ops.fp8_block import fp8_block_gemm_triton

    g = torch.Generator().manual_seed(split_k)
    tokens, n, k = 20, 200, 600
    weight, scale_inv = quantize_fp8_blocks(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g))
    x, bias = torch.randn(tokens, k, generator=g) * 3, torch.randn(n, generator=g)
    xq, x_scale = quantize_fp8_token_groups(x)
    want = fp8_block_linear_ref(x, weight, scale_inv, bias=bias)
    for _ in range(2):  # the second launch finds the counters the first left
        got = fp8_block_gemm_triton(xq, x_scale, weight, scale_inv, bias=bias, out_dtype=torch.float32,
                                    config=(16, 64, 4, split_k))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not split_arrivals(x.device, 8).any()


def test_the_split_over_k_fills_the_gpu_only_where_the_tiles_do_not():
    """On the H200 (132 SMs) at Qwen3-8B's projections, 64 x 128 tiles: o and down (32 tiles at M <= 64) in 4 shares,
    q|k|v (48) in 2, gate|up (192) and every projection at M 256 (128+ tiles) unsplit; never a share under 4 blocks."""
    from tsdev_kernels.ops.fp8_block import block_gemm_split

    def split(m, n, k):
        return block_gemm_split(-(-m // 64) * -(-n // 128), -(-k // 128), 132)
    assert [split(16, n, k) for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))] == [2, 4, 1, 4]
    assert [split(256, n, k) for n, k in ((6144, 4096), (4096, 4096), (4096, 12288))] == [1, 1, 1]
    assert split(1, 4096, 1024) == 2 and split(1, 128, 512) == 1  # 8 blocks: 2 shares of 4; 4 blocks: one


@pytest.mark.parametrize("tokens, n, k", [(1, 256, 384), (2, 200, 300), (1, 130, 1000)])
def test_the_block_gemv_quantizes_inside_and_is_the_block_linear_reference(tokens, n, k):
    """One launch for a few tokens: each group quantized in the kernel, then the blockwise sum; values e4m3 holds
    exactly after the division (as the token-group kernel's test: the interpreter's cast rounds others a binade
    down), partial blocks at both edges, a bias, a BLOCK_K of several groups."""
    from tsdev_kernels.ops.fp8_block import fp8_block_gemv_triton

    g = torch.Generator().manual_seed(n)
    weight, scale_inv = quantize_fp8_blocks(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g))
    x = quantize_fp8_token_groups(torch.randn(tokens, k, generator=g) * 50)[0].float()
    x[:, ::128] = 448.0
    x = x * 2.0 ** torch.randint(-4, 4, (tokens, 1), generator=g)
    bias = torch.randn(n, generator=g)
    want = fp8_block_linear_ref(x, weight, scale_inv, bias=bias)
    for config in (None, (2, 512, 4)):
        got = fp8_block_gemv_triton(x, weight, scale_inv, bias=bias, config=config)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    assert not torch.allclose(fp8_block_gemv_triton(x, weight, scale_inv), want, rtol=1e-5, atol=1e-3)  # the bias


def test_the_block_gemm_reads_its_tuned_file_by_shape_and_gpu_and_says_once_when_there_is_none(tmp_path, monkeypatch,
                                                                                              caplog):
    """What `tsdev tune` writes (the best config per M of a shape on this GPU), the kernel reads: the nearest M
    bucket's entry (the smaller on a tie); another shape, or no GPU, runs UNTUNED_GEMM, a missing file said once with
    the command that writes it."""
    import logging

    from tsdev.tune import write_table
    from tsdev_kernels import ops
    from tsdev_kernels.ops import fp8_block

    monkeypatch.setattr(fp8_block, "GEMM_CONFIG_DIR", tmp_path)
    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fp8_block, "device_name", lambda device: None if str(device) == "cpu" else "NVIDIA H200")
    fp8_block._gemm_table.cache_clear(), ops.tuned_configs.cache_clear()
    path = fp8_block.block_gemm_config_path(4096, 12288, "NVIDIA H200")
    assert path.name == "N=4096,K=12288,dtype=float8_e4m3fn,block=128x128,device=NVIDIA_H200.json"
    write_table(path, {1: (16, 64, 4, 4), 64: (64, 128, 4), 2048: (128, 128, 8)})
    got = {m: fp8_block.block_gemm_config(m, 4096, 12288, "cuda") for m in (1, 16, 32, 33, 64, 1000, 1057, 4096)}
    assert got == {1: (16, 64, 4, 4), 16: (16, 64, 4, 4), 32: (16, 64, 4, 4), 33: (64, 128, 4), 64: (64, 128, 4),
                   1000: (64, 128, 4), 1057: (128, 128, 8), 4096: (128, 128, 8)}
    assert fp8_block.block_gemm_config(16, 4096, 12288, "cpu") == fp8_block.UNTUNED_GEMM
    caplog.clear()  # what the tuned shape said above, if an earlier test (a server's start) turned INFO on
    with caplog.at_level(logging.INFO, logger=ops.tuned_log.name):
        for m in (1, 64, 256):
            assert fp8_block.block_gemm_config(m, 6144, 4096, "cuda") == fp8_block.UNTUNED_GEMM
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "N=6144,K=4096" in said[0] and "tsdev tune --gemm 6144,4096" in said[0]
    fp8_block._gemm_table.cache_clear()
