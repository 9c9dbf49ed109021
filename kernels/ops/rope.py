"""Rotary position embedding (the "rotate half" / NeoX layout used by Qwen and Llama), optionally fused
with Qwen3's per-head RMSNorm of q and k.

One Triton program handles one token: all its q heads and k heads. Each head is read as its two halves
(x1 | x2), so rotate-half is two multiply-adds and the RMSNorm statistic is the sum over both halves.
The kernel rounds to the input dtype where the references do (they compute in that dtype), so bf16
results match Hugging Face's order of operations.
"""
import torch
import triton
import triton.language as tl

from kernels.ops import pdl, use_triton, wait_for_previous
from kernels.ops.norm import rms_norm_ref


def rope_cos_sin_cache(head_dim: int, max_positions: int, theta: float, device=None) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64, device=device).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def apply_rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T]. Returns rotated (q, k) in their dtype."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope_ref(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then RoPE: Hugging Face Qwen3's order."""
    return apply_rope_ref(rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps), positions, cos_sin_cache)


@triton.jit
def _norm_rope_heads(X, OUT, W, stride_h, cos, sin, eps, H, HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):
    """Rotate (and first normalise) H heads of one token. X points at the token's first head."""
    dt = OUT.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (cols < HALF)
    x1 = tl.load(X + heads * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + heads * stride_h + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(W + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # out = x * cos + rotate_half(x) * sin, each product rounded as the reference does
    o1 = (x1 * cos).to(dt).to(tl.float32) + (-x2 * sin).to(dt).to(tl.float32)
    o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    out_offs = heads * (2 * HALF) + cols
    tl.store(OUT + out_offs, o1.to(dt), mask=mask)
    tl.store(OUT + out_offs + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QW, KW, Q_OUT, K_OUT, POS, COS_SIN,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    Hq, Hk, eps,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    pos = tl.load(POS + t).to(tl.int64)
    # the references cast the float32 table to the activations' dtype before using it
    dt = Q_OUT.dtype.element_ty
    cos = tl.load(COS_SIN + pos * stride_cs + cols, mask=cols < HALF, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(COS_SIN + pos * stride_cs + HALF + cols, mask=cols < HALF, other=0.0).to(dt).to(tl.float32)
    _norm_rope_heads(Q + t * stride_qt, Q_OUT + t * Hq * 2 * HALF, QW, stride_qh, cos, sin, eps, Hq,
                     HALF, BLOCK_HQ, BLOCK_HALF, NORM)
    _norm_rope_heads(K + t * stride_kt, K_OUT + t * Hk * 2 * HALF, KW, stride_kh, cos, sin, eps, Hk,
                     HALF, BLOCK_HK, BLOCK_HALF, NORM)


def rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [T, Hq, D] and k [T, Hk, D]; with weights, per-head RMSNorm first. New contiguous outputs."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    T, Hq, D = q.shape
    Hk = k.shape[1]
    norm = q_weight is not None
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    half = D // 2
    use_pdl = pdl(q)
    _rope_kernel[(T,)](
        q, k, q_weight if norm else q, k_weight if norm else k, q_out, k_out, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), Hq, Hk, eps,
        HALF=half, BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HK=triton.next_power_of_2(Hk),
        BLOCK_HALF=triton.next_power_of_2(half), NORM=norm, PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )
    return q_out, k_out


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] (last dim contiguous; other strides free) by positions [T].

    cos_sin_cache: [max_positions, D] float32 from `rope_cos_sin_cache`; cast to q's dtype before use,
    as Hugging Face does. Returns new contiguous (q, k) in their dtype.
    """
    if use_triton(q, "rope"):
        return rope_triton(q, k, positions, cos_sin_cache)
    return apply_rope_ref(q, k, positions, cos_sin_cache)


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    positions: torch.Tensor, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's attention prologue in one pass: per-head RMSNorm of q and k (weights [D]), then RoPE.

    Equals apply_rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), positions, cos_sin_cache),
    rounding included. q/k may be strided views of a fused qkv projection (last dim contiguous).
    Returns new contiguous (q [T, Hq, D], k [T, Hk, D]).
    """
    if use_triton(q, "rope"):
        return rope_triton(q, k, positions, cos_sin_cache, q_weight, k_weight, eps)
    return qk_norm_rope_ref(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)
