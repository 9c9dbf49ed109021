"""Rotary position embedding (the "rotate half" / NeoX layout used by Qwen and Llama), optionally fused
with Qwen3's per-head RMSNorm of q and k.

One Triton program handles one token: all its q heads and k heads. Each head is read as its two halves
(x1 | x2), so rotate-half is two multiply-adds and the RMSNorm statistic is the sum over both halves.
The kernel rounds to the input dtype where the references do (they compute in that dtype), so bf16
results match Hugging Face's order of operations.

Context-extension scaling (linear, llama3, yarn) lives entirely in the cos/sin table: it changes the inverse
frequencies (and, for yarn, multiplies cos and sin by an attention factor) the way transformers computes them.
"""
import math

import torch
import triton
import triton.language as tl

from tsdev_kernels.checks import KernelCheck, Tolerance, nbytes
from tsdev_kernels.ops import pdl, use_fused_triton, use_triton, wait_for_previous
from tsdev_kernels.ops.norm import rms_norm, rms_norm_ref

_REQUIRED_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


def _rope_type(scaling: dict | None) -> str:
    """Hugging Face's name for the variant; older configs spell the key `type`."""
    if not scaling:
        return "default"
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _REQUIRED_FIELDS:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(_REQUIRED_FIELDS)}")
    for field in _REQUIRED_FIELDS[rope_type]:
        if scaling.get(field) is None:
            raise ValueError(f"rope type {rope_type!r} needs the field {field!r}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:  # the kernels rotate the whole head
        raise ValueError(f"partial_rotary_factor {scaling['partial_rotary_factor']} is not supported")
    return rope_type


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(powers: torch.Tensor, head_dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN: keep fast dimensions, interpolate slow ones, blend linearly between (corrections from the paper)."""
    factor, original = s["factor"], s["original_max_position_embeddings"]
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek's form; transformers ignores one given alone
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=powers.device) - low) / (high - low)).clamp(0, 1)
    # same operations as transformers, so the blend is bit-identical (1 - (1 - r) need not equal r)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * powers) * (1 - extrapolation) + 1.0 / powers * extrapolation
    return inv_freq, float(attention_factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] float32 and the factor cos/sin are multiplied by.

    `scaling` is a Hugging Face `rope_scaling` / `rope_parameters` dict; its own `rope_theta`, if any, is ignored
    (`theta` wins). The arithmetic follows transformers.modeling_rope_utils operation by operation, so the
    frequencies equal transformers' bit for bit on the same device.
    """
    rope_type = _rope_type(scaling)
    # an int64 arange cast to float, as transformers builds it
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    inv_freq = 1.0 / powers
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        # short wavelengths stay, long ones are divided by factor, the band between is interpolated
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(powers, head_dim, theta, scaling)
    return inv_freq, 1.0


def rope_cos_sin_cache(head_dim: int, max_positions: int, theta: float, device=None,
                       scaling: dict | None = None) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second.

    `scaling`: see `rope_inv_freq`. Unknown rope types and missing fields raise ValueError.
    """
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling, device)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64, device=device).float(), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table if attention_factor == 1.0 else table * attention_factor


def rope_settings(raw_config: dict) -> tuple[float, dict | None]:
    """(rope theta, scaling dict or None) from a Hugging Face config.json dict, resolved as transformers does.

    Hub checkpoints write `rope_theta` next to `rope_scaling` (often null); transformers 5 writes one
    `rope_parameters` dict holding `rope_type`, `rope_theta` and the scaling fields. When both appear,
    `rope_scaling` wins, as in transformers. The returned dict has `rope_type` (never the legacy `type`) and
    no `rope_theta`.
    """
    params = dict(raw_config.get("rope_scaling") or raw_config.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", None) or raw_config.get("rope_theta") or 10000.0)
    legacy_type = params.pop("type", "default")
    params.setdefault("rope_type", legacy_type)
    if params["rope_type"] == "default" and params.get("partial_rotary_factor", 1.0) == 1.0:
        return theta, None
    # transformers fills the pretraining length from max_position_embeddings when a config leaves it out
    if (params["rope_type"] in ("llama3", "yarn") and "original_max_position_embeddings" not in params
            and "max_position_embeddings" in raw_config):
        params["original_max_position_embeddings"] = raw_config["max_position_embeddings"]
    return theta, params


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
    q_out, k_out = (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                    torch.empty(k.shape, dtype=k.dtype, device=k.device))
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
    if use_fused_triton(q, "rope", "norm"):
        return rope_triton(q, k, positions, cos_sin_cache, q_weight, k_weight, eps)
    # each op as TSDEV_KERNELS picks it (ref:rope, gluon:norm), or both references off CUDA: qk_norm_rope_ref
    return apply_rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), positions, cos_sin_cache)


ROPE_TOLERANCE = {
    torch.bfloat16: Tolerance(2e-2, 2e-2, "bf16 in and out: the cos/sin table rounded to bf16 as Hugging Face does, "
                              "products summed in float32 (the per-head norm first: its roundings too)"),
    torch.float16: Tolerance(2e-3, 2e-3, "fp16, as bf16 with 3 more mantissa bits"),
    torch.float32: Tolerance(1e-5, 1e-5, "float32 throughout"),
}
CHECK_POSITIONS = 8192  # positions drawn below this (the table is built for them)


def _rope_inputs(shape, dtype, device, generator):
    tokens, q_heads, kv_heads, head_dim = shape
    q, k = (torch.randn(tokens, heads, head_dim, generator=generator, device=device).to(dtype)
            for heads in (q_heads, kv_heads))
    positions = torch.randint(0, CHECK_POSITIONS, (tokens,), generator=generator, device=device)
    cache = rope_cos_sin_cache(head_dim, CHECK_POSITIONS, 1e6, device=device)
    q_weight, k_weight = (torch.randn(head_dim, generator=generator, device=device).to(dtype) for _ in range(2))
    return q, k, q_weight, k_weight, positions, cache


def _rope_cost(q, k, q_weight, k_weight, positions, cache, normed: bool = False):
    """q and k read and written, the positions and their rows of the cos/sin table read (and the norms' weights)."""
    return (2 * nbytes(q, k) + nbytes(positions) + positions.numel() * cache.shape[-1] * cache.element_size()
            + (nbytes(q_weight, k_weight) if normed else 0)), 0


def _head_shapes(serving):
    return [(t, serving.q_heads, serving.kv_heads, serving.head_dim) for t in serving.tokens]


CHECKS = [
    KernelCheck(op="rope", kernels=("_rope_kernel",), shapes=_head_shapes, inputs=_rope_inputs,
                kernel=lambda q, k, qw, kw, pos, cache: rope_triton(q, k, pos, cache),
                reference=lambda q, k, qw, kw, pos, cache: apply_rope_ref(q, k, pos, cache),
                tolerance=ROPE_TOLERANCE, cost=_rope_cost),
    KernelCheck(op="qk_norm_rope", kernels=("_rope_kernel",), shapes=_head_shapes, inputs=_rope_inputs,
                kernel=lambda q, k, qw, kw, pos, cache: rope_triton(q, k, pos, cache, qw, kw, 1e-6),
                reference=lambda q, k, qw, kw, pos, cache: qk_norm_rope_ref(q, k, qw, kw, 1e-6, pos, cache),
                tolerance=ROPE_TOLERANCE, cost=lambda *args: _rope_cost(*args, normed=True)),
]
