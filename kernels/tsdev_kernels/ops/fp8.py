"""FP8 projections: y = x @ (weight_fp8 * weight_scale).T (+ bias), weights in e4m3 with one float32 scale
per output channel (row of the weight).

Layout: weight [N, K] torch.float8_e4m3fn, last dim contiguous; weight_scale [N] float32 with
weight ~ weight_fp8.float() * weight_scale[:, None]. `quantize_fp8_rows` makes both from a weight (and the
activation scales from x): scale = amax(|row|) / 448 in float32 (1 for an all-zero row, whose values are
then 0), values divided by it in float32, clamped to +-448 and rounded to nearest even by torch's cast.
An element then comes back within 2^-4 of its magnitude (3 mantissa bits) plus 2^-10 * scale (half the spacing
of e4m3's subnormals, for elements below 2^-6 * scale).

Two numerics, chosen by the number of rows (x [..., K] flattened):
* up to SKINNY_ROWS rows (decode): weight-only. x is not quantized; kernels/tsdev_kernels/ops/linear.py's Triton kernels
  (given the scales) load the e4m3 tile, convert it exactly to float32 / x's dtype (bf16, fp16 and fp32
  hold every e4m3 value), accumulate x @ w.T in float32 (the GEMV for one row: elementwise, then one
  reduction; 2-8 rows: tl.dot with the rows padded to 16), multiply by the row scale in float32 and round
  once to x's dtype. Reference: `fp8_weight_only_ref`.
* more rows (prefill, large decode batches): W8A8. x is quantized per token (dynamic: one float32 scale
  per row, `quantize_fp8_rows`), then `torch._scaled_mm` (cuBLASLt, row-wise scaling: scale_a [M, 1],
  scale_b [1, N], float32 accumulation, bf16 out) computes (xq @ wq.T) * sx * sw. Reference:
  `fp8_scaled_mm_ref` (the same quantization, a float32 matmul of the dequantized values).
On CUDA both need compute capability >= 8.9 (e4m3 conversion in Triton, e4m3 matmul in cuBLASLt):
`fp8_unsupported_reason` says why a device cannot run them. The kernels' configurations are linear.py's
(`gemv_config` reads e4m3 rows in 4096-element chunks, 4 KB as for bf16; not swept for e4m3 yet).
"""
import torch
import triton
import triton.language as tl

from tsdev_kernels.checks import KernelCheck, matmul_cost
from tsdev_kernels.ops import linear as linear_ops
from tsdev_kernels.ops import pdl, use_triton, wait_for_previous

SKINNY_ROWS = linear_ops.SKINNY_ROWS
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_DTYPE = torch.float8_e4m3fn
_E4M3_MAX = tl.constexpr(E4M3_MAX)  # the kernels' copy


def fp8_unsupported_reason(device: torch.device | str, flag: str = "--quantization") -> str | None:
    """Why `device` cannot run fp8 (the projections, or an e4m3 KV cache: `flag` says which to serve without),
    or None. CPU runs the references (tests, CI)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"fp8 runs on CUDA (compute capability >= 8.9) or CPU, not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"fp8 needs compute capability >= 8.9 (Ada, Hopper or newer) for e4m3 matmuls; {name} has "
                f"{major}.{minor}: serve without {flag}")
    return None


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [..., K] -> (e4m3 values [..., K], float32 scales [..., 1]) with t ~ values * scales.

    One scale per row: amax(|row|) / 448 (1 for an all-zero row). Plain torch on every device (a few
    elementwise kernels, no host sync, so it runs inside CUDA graphs)."""
    t32 = t.float()
    amax = t32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (t32 / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, scale


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program, whole in registers: `quantize_fp8_rows`' arithmetic (float32 amax / 448, 1 for a zero
    row; the values divided by it, clamped, rounded to nearest even)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK)
    t = tl.load(X + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(t), axis=0)
    scale = tl.where(amax > 0, amax / _E4M3_MAX, 1.0)
    q = tl.clamp(t / scale, -_E4M3_MAX, _E4M3_MAX)
    tl.store(Q + row * stride_q + ks, q.to(Q.dtype.element_ty), mask=ks < K)
    tl.store(S + row, scale)


def quantize_fp8_rows_triton(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_rows` of t [M, K] (last dim contiguous) in one launch: (e4m3 [M, K], float32 scales [M])."""
    M, K = t.shape
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=t.device)
    scale = torch.empty(M, dtype=torch.float32, device=t.device)
    if M:
        block = triton.next_power_of_2(K)
        use_pdl = pdl(t)
        _quantize_rows_kernel[(M,)](t, q, scale, K, t.stride(0), q.stride(0), BLOCK=block, PDL=use_pdl,
                                    num_warps=4 if block <= 2048 else 8, launch_pdl=use_pdl)
    return q, scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of (e4m3 [..., K], scales [...] or [..., 1])."""
    return q.float() * (scale if scale.dim() == q.dim() else scale.unsqueeze(-1))


def fp8_weight_only_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] unquantized @ (weight [N, K] e4m3 * weight_scale [N]).T in float32, rounded once to x's dtype."""
    y = (x.float() @ weight.float().T) * weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_scaled_mm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] quantized per row, then (xq @ weight.T) * sx * sw in float32, rounded once to x's dtype."""
    xq, sx = quantize_fp8_rows(x)
    y = (xq.float() @ weight.float().T) * sx * weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA: x quantized per row, torch._scaled_mm with row-wise scales (bf16 out, then x's dtype)."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    xq, sx = quantize_fp8_rows(x2)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    # b must be column-major: weight [N, K] row-major, transposed. Row-wise scaling wants bf16 output.
    y = torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=weight_scale.view(1, N).float(),
                         out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def fp8_gemv_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, **config) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] e4m3, weight_scale [N] float32 -> [..., N] in x's dtype:
    kernels/tsdev_kernels/ops/linear.py's GEMV with the row scales (config: its block_n, block_k, num_warps,
    num_stages)."""
    return linear_ops.gemv_triton(x, weight, bias, weight_scale=weight_scale, **config)


def fp8_skinny_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, **config) -> torch.Tensor:
    """x [..., K] with at most 16 rows, weight [N, K] e4m3, weight_scale [N] -> [..., N]:
    kernels/tsdev_kernels/ops/linear.py's skinny kernel with the row scales (e4m3 converted exactly to x's dtype before
    tl.dot)."""
    return linear_ops.skinny_triton(x, weight, bias, weight_scale=weight_scale, **config)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y ~ x @ (weight * weight_scale[:, None]).T (+ bias), x [..., K], weight [N, K] e4m3, weight_scale [N]
    float32. Up to SKINNY_ROWS rows: weight-only (CUDA: the fp8 GEMV for one row, the skinny kernel for 2-8);
    more rows: x quantized per token, torch._scaled_mm on CUDA. CPU (and TSDEV_KERNELS=ref:fp8): the
    references of the same two numerics."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    triton_ok = use_triton(x, "fp8")
    if rows <= SKINNY_ROWS:
        if triton_ok and rows >= 1:
            return (fp8_gemv_triton if rows == 1 else fp8_skinny_triton)(x, weight, weight_scale, bias)
        return fp8_weight_only_ref(x, weight, weight_scale, bias)
    if triton_ok and x.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0:  # cuBLASLt's fp8 alignment
        return fp8_scaled_mm(x, weight, weight_scale, bias)
    return fp8_scaled_mm_ref(x, weight, weight_scale, bias)


def _check_inputs(shape, dtype, device, generator):
    rows, k, n = shape
    weight, scale = quantize_fp8_rows(linear_ops._matrix(n, k, torch.float32, device, generator))
    return torch.randn(rows, k, generator=generator, device=device).to(dtype), weight, scale.squeeze(-1)


CHECKS = [  # linear.py's decode kernels with a float32 scale per output row (e4m3 weights, --quantization fp8)
    KernelCheck(op="fp8_gemv", kernels=("linear_ops._gemv_kernel",),
                shapes=lambda s: [(1, s.intermediate, s.hidden)] if s.fp8 and 1 in s.tokens else [],
                inputs=_check_inputs, kernel=lambda x, w, scale: linear_ops.gemv_triton(x, w, weight_scale=scale),
                reference=fp8_weight_only_ref, tolerance=linear_ops.MATMUL_TOLERANCE, cost=matmul_cost),
    KernelCheck(op="fp8_skinny_linear", kernels=("linear_ops._skinny_kernel",),
                shapes=lambda s: [(t, s.intermediate, s.hidden) for t in linear_ops._skinny_rows(s)] if s.fp8 else [],
                inputs=_check_inputs, kernel=lambda x, w, scale: linear_ops.skinny_triton(x, w, weight_scale=scale),
                reference=fp8_weight_only_ref, tolerance=linear_ops.MATMUL_TOLERANCE, cost=matmul_cost),
]
