"""RMSNorm, with and without the residual add fused in front of it.

One Triton program normalises one row. The Gluon kernel (TSDEV_KERNELS=gluon:norm) lays rows out explicitly, one
warp per row: a row's sum of squares is reduced in registers and warp shuffles, never through shared memory and a
barrier as the Triton kernel's cross-warp sum is; several rows share a program once there are rows for every SM.
It is slower than the Triton kernel on the H200 (docs/benchmarks.md, issue 33): a warp per row keeps fewer loads in
flight. Both follow the reference's rounding order (normalise in
float32, round to the input dtype, multiply by the weight, round again), as Hugging Face's Qwen3RMSNorm
does (the GPU tests compare bf16 within ~2-4 bf16 ulps, atol 1e-2 / rtol 1.6e-2, not bit for bit).
"""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tsdev_kernels.checks import KernelCheck, Tolerance, nbytes
from tsdev_kernels.ops import pdl, sm_count, use_gluon, use_triton, wait_for_previous


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as Hugging Face's Qwen3RMSNorm, so bf16 results agree.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


@triton.jit
def rms_norm_values(x, w, N, eps, dt):
    """w * round(x * rsqrt(mean(x^2) + eps)) in float32, for one row x (float32 values of dtype dt, masked
    lanes 0) and its weight w (float32): round to dt before the weight, as the reference does (the caller
    rounds the product). The one-row GEMV runs it too, on the projection's input
    (kernels/tsdev_kernels/ops/linear.py)."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    return w * (x * rstd).to(dt).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    X, R, W, OUT, R_OUT,
    inner, stride_x0, stride_x1, stride_r0, stride_r1,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    # rows are addressed as [outer, inner] so a strided 3-D view (q heads inside a fused qkv row) needs no copy
    row = tl.program_id(0)
    i, j = row // inner, row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + i * stride_x0 + j * stride_x1 + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # x + residual is rounded to the input dtype first, exactly as the reference adds in that dtype
        r = tl.load(R + i * stride_r0 + j * stride_r1 + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(R_OUT.dtype.element_ty)
        tl.store(R_OUT + row * N + cols, x, mask=mask)
        x = x.to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    # R_OUT: the dtype x was in
    tl.store(OUT + row * N + cols, rms_norm_values(x, w, N, eps, R_OUT.dtype.element_ty).to(OUT.dtype.element_ty),
             mask=mask)


@gluon.jit
def rms_norm_values_gluon(x, w, N, eps, dt: gl.constexpr):
    """rms_norm_values for rows [ROWS, BLOCK] (float32, masked lanes 0) and the weight [1, BLOCK]."""
    rstd = 1.0 / gl.sqrt(gl.sum(x * x, axis=1) / N + eps)
    return w * (x * gl.expand_dims(rstd, 1)).to(dt).to(gl.float32)


@gluon.jit
def _rms_norm_gluon_kernel(
    X, R, W, OUT, R_OUT,
    rows, inner, stride_x0, stride_x1, stride_r0, stride_r1,
    N, eps,
    HAS_RESIDUAL: gl.constexpr, BLOCK: gl.constexpr, PDL: gl.constexpr,
):
    ROWS: gl.constexpr = gl.num_warps()  # a warp per row, its 32 lanes across the row
    layout: gl.constexpr = gl.BlockedLayout([1, BLOCK // 32], [1, 32], [ROWS, 1], [1, 0])
    if PDL:  # as wait_for_previous
        gdc_launch_dependents()
        gdc_wait()
    row = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.expand_dims(gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout)), 0)
    i, j = row // inner, row % inner
    mask = gl.expand_dims(row < rows, 1) & (cols < N)
    x = gl.load(X + gl.expand_dims(i * stride_x0 + j * stride_x1, 1) + cols, mask=mask, other=0.0).to(gl.float32)
    if HAS_RESIDUAL:
        r = gl.load(R + gl.expand_dims(i * stride_r0 + j * stride_r1, 1) + cols, mask=mask, other=0.0).to(gl.float32)
        x = (x + r).to(R_OUT.dtype.element_ty)
        gl.store(R_OUT + gl.expand_dims(row, 1) * N + cols, x, mask=mask)
        x = x.to(gl.float32)
    w = gl.load(W + cols, mask=cols < N, other=0.0).to(gl.float32)
    y = rms_norm_values_gluon(x, w, N, eps, R_OUT.dtype.element_ty)
    gl.store(OUT + gl.expand_dims(row, 1) * N + cols, y.to(OUT.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """x as rows of its last dim: (x, outer, inner, stride_outer, stride_inner), copying only when unavoidable."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x, x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    x2 = x.reshape(-1, x.shape[-1])
    return x2, x2.shape[0], 1, x2.stride(0), 0


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, gluon: bool | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel, or the Gluon one when `gluon` (None: as TSDEV_KERNELS says, `use_gluon`)."""
    N = x.shape[-1]
    xr, outer, inner, sx0, sx1 = _rows(x)
    if residual is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rr, sr0, sr1, r_out = xr, 0, 0, xr  # not written: the kernel reads only R_OUT's dtype
    else:
        rr, _, _, sr0, sr1 = _rows(residual)
        r_out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        out = torch.empty(x.shape, dtype=torch.promote_types(r_out.dtype, weight.dtype), device=x.device)
    BLOCK = triton.next_power_of_2(N)
    use_pdl = pdl(x)
    if use_gluon("norm") if gluon is None else gluon:
        rows = outer * inner
        per_program = 1 << max(0, min(2, (rows // sm_count(x.device.index or 0)).bit_length() - 1))  # 1, 2 or 4
        _rms_norm_gluon_kernel[(triton.cdiv(rows, per_program),)](
            xr, rr, weight, out, r_out, rows, inner, sx0, sx1, sr0, sr1, N, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=max(BLOCK, 32), PDL=use_pdl, num_warps=per_program,
            launch_pdl=use_pdl,
        )
    else:
        _rms_norm_kernel[(outer * inner,)](
            xr, rr, weight, out, r_out, inner, sx0, sx1, sr0, sr1, N, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=BLOCK, PDL=use_pdl, num_warps=min(max(BLOCK // 256, 1), 8),
            launch_pdl=use_pdl,
        )
    return out if residual is None else (out, r_out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: weight * round(x * rsqrt(mean(x^2) + eps)). Returns a new tensor.

    x: [..., N], any dtype, last dim contiguous (a strided 3-D view such as q heads cut out of a fused qkv
    projection is read in place). weight: [N]. Float32 statistics; the result is rounded to x's dtype
    before the weight multiply, as Hugging Face does. Triton on CUDA, the reference elsewhere.
    """
    if use_triton(x, "norm"):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; inputs are not modified.

    x, residual: same shape [..., N]. The sum is rounded to the input dtype before it is normalised
    (as the reference, which adds in that dtype), and returned as the next layer's residual.
    """
    if use_triton(x, "norm"):
        return rms_norm_triton(x, weight, eps, residual)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


NORM_TOLERANCE = {
    torch.bfloat16: Tolerance(1e-2, 1.6e-2, "bf16 output: float32 statistics in another summation order, then the "
                              "reference's two bf16 roundings (~2-4 ulps)"),
    torch.float16: Tolerance(1e-3, 2e-3, "fp16 output, as bf16 with 3 more mantissa bits"),
    torch.float32: Tolerance(1e-5, 1e-5, "float32 throughout: the summation order"),
}


def _rows_of_hidden(serving):
    return [(tokens, serving.hidden) for tokens in serving.tokens]


def _norm_inputs(shape, dtype, device, generator):
    x, weight = (torch.randn(n, generator=generator, device=device).to(dtype) for n in (shape, shape[-1:]))
    return x, weight, 1e-6


def _add_norm_inputs(shape, dtype, device, generator):
    x, residual, weight = (torch.randn(n, generator=generator, device=device).to(dtype)
                           for n in (shape, shape, shape[-1:]))
    return x, residual, weight, 1e-6


def _norm_cost(x, weight, eps):
    return nbytes(x, weight, x), 0  # x and the weight read, the output written


def _add_norm_cost(x, residual, weight, eps):
    return nbytes(x, residual, weight, x, residual), 0  # the sum written back as the next residual, and the output


def _rows_on_cuda(serving):
    """Gluon kernels run on a GPU only (Triton's interpreter does not run them)."""
    return _rows_of_hidden(serving) if serving.device.startswith("cuda") else []


CHECKS = [
    KernelCheck(op="rms_norm", kernels=("_rms_norm_kernel",), shapes=_rows_of_hidden, inputs=_norm_inputs,
                kernel=lambda x, w, eps: rms_norm_triton(x, w, eps, gluon=False), reference=rms_norm_ref,
                tolerance=NORM_TOLERANCE, cost=_norm_cost),
    KernelCheck(op="fused_add_rms_norm", kernels=("_rms_norm_kernel",), shapes=_rows_of_hidden,
                inputs=_add_norm_inputs, kernel=lambda x, r, w, eps: rms_norm_triton(x, w, eps, r, gluon=False),
                reference=fused_add_rms_norm_ref, tolerance=NORM_TOLERANCE, cost=_add_norm_cost),
    KernelCheck(op="rms_norm_gluon", kernels=("_rms_norm_gluon_kernel",), shapes=_rows_on_cuda, inputs=_norm_inputs,
                kernel=lambda x, w, eps: rms_norm_triton(x, w, eps, gluon=True), reference=rms_norm_ref,
                tolerance=NORM_TOLERANCE, cost=_norm_cost),
    KernelCheck(op="fused_add_rms_norm_gluon", kernels=("_rms_norm_gluon_kernel",), shapes=_rows_on_cuda,
                inputs=_add_norm_inputs, kernel=lambda x, r, w, eps: rms_norm_triton(x, w, eps, r, gluon=True),
                reference=fused_add_rms_norm_ref, tolerance=NORM_TOLERANCE, cost=_add_norm_cost),
]
