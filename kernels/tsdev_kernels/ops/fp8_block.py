"""Block-quantized FP8, as the FP8 checkpoints people serve store it (Qwen's `*-FP8` releases, DeepSeek-V3): e4m3
weights with one float32 multiplier per block of 128 x 128 (`<name>.weight_scale_inv`: weight ~ e4m3 x the scale of its
block), and activations quantized at run time per token and per group of 128 columns (`activation_scheme:
dynamic`). The torch references of that arithmetic: what the checkpoint writer of the tests stores, what the Triton
kernels to come (issue 50) are checked against.

A weight whose sizes are not multiples of the block has partial blocks at its edges (the scales' shape is
ceil(N / block_n) x ceil(K / block_k), as DeepSeek's); each block's scale is its largest magnitude / 448 (e4m3's
largest finite value), 1 for an all-zero block, as transformers' fine-grained FP8 quantizer writes it.
"""
import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
BLOCK = (128, 128)  # (block_n, block_k): the only block size shipped checkpoints use


def _blocked(t: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """t [N, K] zero-padded to whole blocks, viewed [N / block_n, block_n, K / block_k, block_k]."""
    n, k = t.shape
    padded = torch.nn.functional.pad(t, (0, -k % block_k, 0, -n % block_n))
    return padded.view(padded.shape[0] // block_n, block_n, padded.shape[1] // block_k, block_k)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], weight_scale_inv float32 [ceil(N / block_n), ceil(K / block_k)])."""
    n, k = weight.shape
    tiles = _blocked(weight.float(), *block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, E4M3_MAX / torch.where(amax > 0, amax, 1.0), torch.ones_like(amax))
    scale_inv = 1.0 / scale  # the stored multiplier, computed as transformers' quantizer computes it
    scaled = tiles * scale[:, None, :, None]
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(tiles.shape[0] * block[0], tiles.shape[2] * block[1])
    return q[:n, :k].contiguous(), scale_inv


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(e4m3 [N, K], scales [ceil(N / block_n), ceil(K / block_k)]) -> the weight [N, K] in `dtype`."""
    n, k = q.shape
    expected = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a weight of {n} x {k} in blocks of "
                         f"{block[0]} x {block[1]}: expected {expected}")
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (q.float() * scales).to(dtype)


def quantize_fp8_token_groups(x: torch.Tensor, group: int = BLOCK[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [T, K] -> (e4m3 [T, K], scales float32 [T, ceil(K / group)]), each token's
    group of `group` columns scaled so that its largest magnitude is 448 (1 for an all-zero group)."""
    t, k = x.shape
    groups = torch.nn.functional.pad(x.float(), (0, -k % group)).view(t, -1, group)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(t, -1)[:, :k]
    return q.contiguous(), scale


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         block: tuple[int, int] = BLOCK, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y ~ x @ W.T (+ bias) the way a w8a8-block kernel computes it: x [..., K] quantized per token and group of
    block_k columns, then for each block of K the e4m3 product (exact in float32) times the token's group scale and
    the weight block's scale, summed over the blocks in float32; rounded to x's dtype once."""
    block_n, block_k = block
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_fp8_token_groups(rows, block_k)
    n, k = weight.shape
    kb = x_scale.shape[1]
    xs = torch.nn.functional.pad(xq.float(), (0, -k % block_k)).view(rows.shape[0], kb, block_k)
    ws = torch.nn.functional.pad(weight.float(), (0, -k % block_k)).view(n, kb, block_k)
    partial = torch.einsum("tbk,nbk->tbn", xs, ws)  # per K block: [T, blocks, N]
    w_scale = weight_scale_inv.float().repeat_interleave(block_n, 0)[:n]  # [N, blocks]
    y = (partial * x_scale[:, :, None] * w_scale.t()[None]).sum(dim=1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], n)
