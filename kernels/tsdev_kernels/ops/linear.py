"""Linear projections: y = x @ w.T (+ bias). One input row (decode at batch 1) runs a Triton GEMV, up to
SKINNY_ROWS rows a Triton kernel with the rows padded to 16 for tl.dot; more rows go to cuBLAS (`F.linear`).

At a few rows a projection is a pure read of its weight, which cuBLAS's kernels for those shapes do not
always do at full speed (on the H200, o_proj at 1-4 rows reads at a third of the speed of its neighbours).
Both kernels give each program a block of BLOCK_N output columns and stream those weight rows once in
BLOCK_K chunks, accumulating in float32 with one rounding at the end, as cuBLAS does. The GEMV multiplies
elementwise and reduces once after the loop; the skinny kernel uses tl.dot (IEEE fp32 for fp32 inputs).
The GEMV's configuration comes from the projection's shape (`gemv_config`: a rule that reproduces the best of
`benchmarks/pdl_probe.py`'s sweep for every Qwen3-0.6B projection and keeps other models' tiles free of
register spills). The skinny kernel's is fixed, the best of `benchmarks/kernels_bench.py --only linear --sweep`
on the H200 for the Qwen3-0.6B projections; its grid is one program per 16 columns (tl.dot's smallest tile),
so o_proj and down_proj leave SMs idle (Qwen3-0.6B 64, Llama-3.2-1B 128, Qwen2.5-1.5B 96 programs on the
H200's 132): only a split over K could fill them, which has not been measured.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tsdev_kernels.checks import KernelCheck, Tolerance, matmul_cost, nbytes
from tsdev_kernels.ops import pdl, use_triton, wait_for_previous
from tsdev_kernels.ops.activation import silu_and_mul_values
from tsdev_kernels.ops.norm import rms_norm_values

SKINNY_ROWS = 8


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@triton.jit
def _gemv_kernel(X, W, B, S, OUT, N, K, stride_wn, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    dt = OUT.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    rows = W + cols[:, None].to(tl.int64) * stride_wn
    # the first chunk of weights is read before waiting for the kernel that writes x (weights never change
    # within a step)
    w = tl.load(rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    wait_for_previous(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + k0 + ks, mask=(k0 + ks) < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        nk = k0 + BLOCK_K + ks
        w = tl.load(rows + nk[None, :], mask=col_ok[:, None] & (nk < K)[None, :], other=0.0)
    y = _finish_row(tl.sum(acc, axis=1), cols, col_ok, B, S, HAS_BIAS, HAS_SCALE)
    tl.store(OUT + cols, y.to(dt), mask=col_ok)


@triton.jit
def _gemv_norm_kernel(X, R, NW, W, B, S, OUT, R_OUT, N, K, stride_wn, eps, HAS_RESIDUAL: tl.constexpr,
                      GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """`_gemv_kernel` with the norm in front (the whole row one chunk, BLOCK_K >= K) and, GATED, the activation
    after: a kernel of its own, so that an edit of the norm's or the activation's Triton code builds only these
    variants again, not the plain projections."""
    dt = OUT.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    k_ok = ks < K
    rows = W + cols[:, None].to(tl.int64) * stride_wn
    w = tl.load(rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    if GATED:  # the up projection's rows follow the gate's
        u = tl.load(rows + N * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    wait_for_previous(PDL)
    # x = rms_norm(x + residual), rounded where norm.py rounds
    x = tl.load(X + ks, mask=k_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = (x + tl.load(R + ks, mask=k_ok, other=0.0).to(tl.float32)).to(dt)
        if tl.program_id(0) == 0:
            tl.store(R_OUT + ks, x, mask=k_ok)
        x = x.to(tl.float32)
    x = rms_norm_values(x, tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32), K, eps, dt).to(dt).to(tl.float32)
    y = _finish_row(tl.sum(w.to(tl.float32) * x[None, :], axis=1), cols, col_ok, B, S, HAS_BIAS, HAS_SCALE)
    if GATED:  # silu(gate) * up, each rounded where activation.py rounds after the projection's rounding
        gate = y.to(dt).to(tl.float32)
        up = _finish_row(tl.sum(u.to(tl.float32) * x[None, :], axis=1), cols + N, col_ok, B, S, HAS_BIAS,
                         HAS_SCALE).to(dt).to(tl.float32)
        y = silu_and_mul_values(gate, up, dt)
    tl.store(OUT + cols, y.to(dt), mask=col_ok)


@triton.jit
def _finish_row(y, cols, col_ok, B, S, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr):
    if HAS_SCALE:  # e4m3 weights: one float32 scale per output row (kernels/tsdev_kernels/ops/fp8.py)
        y *= tl.load(S + cols, mask=col_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    return y


GEMV_PROGRAMS = 512  # ~4 programs per SM on the H200 (132 SMs)
GEMV_ROW_BYTES = 4096  # bytes of each weight row a program loads per chunk (without the fused norm)
GEMV_WEIGHTS_PER_THREAD = 64  # weight elements of a tile per thread (as many float32 accumulators)


def gemv_config(n_out: int, k: int, fused_norm: bool, gated: bool, weight_bytes: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the GEMV with n_out outputs over k inputs (gated: n_out gate|up row pairs;
    weight_bytes: of one weight element, 2 for bf16, 1 for e4m3).

    One row is a pure weight stream: HBM runs at full speed only with ~20-30 KB in flight per SM, i.e. several
    programs per SM, each loading a few KB per step, none spilling registers (a spill turns the tile into
    local-memory traffic: with the norm fused at K=2048 the old fixed 2 warps spilled 192 B per thread on q|k|v,
    2576 B on gate|up).
    * BLOCK_N: 4 rows per program, fewer where that leaves under GEMV_PROGRAMS programs.
    * BLOCK_K: with the norm fused, the whole row (the kernel normalises its input first); else chunks of
      GEMV_ROW_BYTES of each row (2048 bf16 or 4096 e4m3 elements), or the whole row if shorter.
    * num_warps: enough that a thread holds at most GEMV_WEIGHTS_PER_THREAD weight elements of the tile (every
      measured Qwen3-0.6B config holds 64 or fewer; the old default at K=2048 held 128, 256 gated), 2 to 8; 8
      when a row takes several chunks (more loads in flight). BLOCK_N shrinks if even 8 warps are not enough
      (a fused norm over a very long row).
    This gives the best of `benchmarks/pdl_probe.py`'s sweep on the H200 (2026-12-01; one row, CUDA graph, PDL) for
    each Qwen3-0.6B projection: q|k|v (4, 1024, 2) and gate|up (4, 1024, 4) with the norm fused, 3.53 and 4.88 us;
    o_proj (2, 2048, 2) 2.02 us, down_proj (2, 2048, 8) 2.62 us (2.84 and 3.70 us with the old fixed (4, 1024, 2));
    lm_head (4, 1024, 2). Other shapes' configurations follow from the rule: compiled for sm_90 without spills
    (tests/test_kernel_configs.py), not measured."""
    gates = 2 if gated else 1
    block_k = (triton.next_power_of_2(k) if fused_norm
               else min(triton.next_power_of_2(k), GEMV_ROW_BYTES // weight_bytes))
    block_n = next(b for b in (4, 2, 1) if n_out >= b * GEMV_PROGRAMS or b == 1)
    block_n = min(block_n, max(1, GEMV_WEIGHTS_PER_THREAD * 32 * 8 // (block_k * gates)))
    num_warps = min(8, max(2, block_n * block_k * gates // (GEMV_WEIGHTS_PER_THREAD * 32)))
    if k > block_k:
        num_warps = 8
    return block_n, block_k, num_warps


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
                block_k: int | None = None, num_warps: int | None = None, num_stages: int = 3,
                weight_scale: torch.Tensor | None = None, *, residual: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                gated: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] holding one row, weight [N, K] -> [..., N] in x's dtype. With weight_scale [N] float32 the
    weight may be e4m3, multiplied by its row's scale after the float32 sum (kernels/tsdev_kernels/ops/fp8.py).

    Fusions (the decode step at batch 1 pays per launch): with norm_weight [K] the input is first
    rms_norm(x + residual) (norm.py's rounding; without residual rms_norm(x)) and the result is
    (y, x + residual) (x itself without residual). gated: the weight holds gate rows then up rows
    (a merged gate_up projection) and y = silu(gate) * up [..., N / 2] (activation.py's rounding).
    The same operations in the same order as the unfused ops with the same block sizes (the interpreter tests
    check equality). Block sizes and warps default to `gemv_config`'s."""
    K, N = x.shape[-1], weight.shape[0]
    if x.numel() != K:
        raise ValueError(f"gemv_triton multiplies one row; x has shape {tuple(x.shape)}")
    if (residual is not None or gated) and norm_weight is None:
        raise ValueError("gemv_triton adds a residual and applies the activation only around its norm: pass "
                         "norm_weight with them")
    x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    n_out = N // 2 if gated else N
    norm = norm_weight is not None
    default_n, default_k, default_warps = gemv_config(n_out, K, norm, gated, weight.element_size())
    block_k = triton.next_power_of_2(K) if norm else min(block_k or default_k, triton.next_power_of_2(K))
    out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else x
    use_pdl = pdl(x)
    grid = (triton.cdiv(n_out, block_n or default_n),)
    scale = weight_scale if weight_scale is not None else weight
    config = dict(HAS_BIAS=bias is not None, HAS_SCALE=weight_scale is not None, BLOCK_N=block_n or default_n,
                  BLOCK_K=block_k, PDL=use_pdl, num_warps=num_warps or default_warps, num_stages=num_stages,
                  launch_pdl=use_pdl)
    if norm:
        _gemv_norm_kernel[grid](x, residual.contiguous() if residual is not None else x, norm_weight, weight,
                                bias if bias is not None else weight, scale, out, r_out, n_out, K, weight.stride(0),
                                eps, HAS_RESIDUAL=residual is not None, GATED=gated, **config)
    else:
        _gemv_kernel[grid](x, weight, bias if bias is not None else weight, scale, out, n_out, K, weight.stride(0),
                           **config)
    return (out, r_out) if norm else out


@triton.jit
def _skinny_kernel(X, W, B, S, OUT, M, N, K, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                   HAS_SCALE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok, row_ok = cols < N, rows < M
    w_rows = W + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        w = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        # to x's dtype: a no-op for bf16/fp32 weights, exact for e4m3 ones (every e4m3 value fits)
        acc = tl.dot(x, tl.trans(w.to(X.dtype.element_ty)), acc, input_precision="ieee" if IEEE else "tf32")
    if HAS_SCALE:
        acc = acc * tl.load(S + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def skinny_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 16,
                  block_k: int = 256, num_warps: int = 2, num_stages: int = 4,
                  weight_scale: torch.Tensor | None = None, block_m: int = 16) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N]: one program per BLOCK_N columns and block_m rows (rows padded to 16 for
    tl.dot at the served 2..SKINNY_ROWS; more rows, up to a decode batch, for benchmarks/kernels_bench.py's sweep
    against cuBLAS). weight_scale: as gemv_triton's."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        use_pdl = pdl(x)
        _skinny_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m))](
            x2, weight, bias if bias is not None else weight, weight_scale if weight_scale is not None else weight,
            out, M, N, K, x2.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            HAS_SCALE=weight_scale is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, PDL=use_pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=use_pdl,
        )
    return out.reshape(*x.shape[:-1], N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias), x [..., K]. On CUDA: the GEMV for one row, the skinny kernel for up to
    SKINNY_ROWS rows, cuBLAS above."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if use_triton(x, "linear") and 1 <= rows <= SKINNY_ROWS:
        return gemv_triton(x, weight, bias) if rows == 1 else skinny_triton(x, weight, bias)
    return linear_ref(x, weight, bias)


MATMUL_TOLERANCE = {
    torch.bfloat16: Tolerance(1e-2, 1.6e-2, "bf16 output of a float32 sum in another order than cuBLAS's, one "
                              "rounding: a few bf16 ulps on outputs of unit scale"),
    torch.float16: Tolerance(2e-3, 2e-3, "fp16 output, as bf16 with 3 more mantissa bits"),
    torch.float32: Tolerance(1e-4, 1e-4, "float32 sums of K products in another order than cuBLAS's"),
}


def _matrix(rows: int, k: int, dtype, device, generator) -> torch.Tensor:
    """Values of unit scale after a K-long dot product with a unit-scale row."""
    return (torch.randn(rows, k, generator=generator, device=device) / k ** 0.5).to(dtype)


def _linear_inputs(shape, dtype, device, generator):
    rows, k, n = shape
    return torch.randn(rows, k, generator=generator, device=device).to(dtype), _matrix(n, k, dtype, device, generator)


def _fused_inputs(shape, dtype, device, generator):
    _, k, n = shape
    x, residual, norm_weight = (torch.randn(size, generator=generator, device=device).to(dtype)
                                for size in ((1, k), (1, k), (k,)))
    return x, residual, norm_weight, _matrix(n, k, dtype, device, generator)


def _norm_gate_up_ref(x, residual, norm_weight, weight):
    from tsdev_kernels.ops.activation import silu_and_mul_ref
    from tsdev_kernels.ops.norm import fused_add_rms_norm_ref

    normed, residual = fused_add_rms_norm_ref(x, residual, norm_weight, 1e-6)
    return silu_and_mul_ref(linear_ref(normed, weight)), residual


def _norm_gate_up_cost(x, residual, norm_weight, weight):
    """The normed row's projection (x, residual, the norm's weight and the matrix read), the gated half [1, N/2]
    and the new residual written."""
    _, flops = matmul_cost(x, weight)
    return nbytes(x, residual, norm_weight, weight, residual) + weight.shape[0] // 2 * x.element_size(), flops


def _skinny_rows(s) -> list[int]:
    return [t for t in s.tokens if 1 < t <= SKINNY_ROWS] or [SKINNY_ROWS]


CHECKS = [
    # the decode step at batch 1: down_proj's GEMV, and the post-attention norm + gate_up + SiLU fused into one
    KernelCheck(op="gemv", kernels=("_gemv_kernel",),
                shapes=lambda s: [(1, s.intermediate, s.hidden)] if 1 in s.tokens else [],
                inputs=_linear_inputs, kernel=gemv_triton, reference=linear_ref, tolerance=MATMUL_TOLERANCE,
                cost=matmul_cost),
    KernelCheck(op="gemv_norm_gate_up", kernels=("_gemv_norm_kernel",),
                shapes=lambda s: [(1, s.hidden, 2 * s.intermediate)] if 1 in s.tokens else [],
                inputs=_fused_inputs, kernel=lambda x, r, nw, w: gemv_triton(x, w, residual=r, norm_weight=nw,
                                                                              eps=1e-6, gated=True),
                reference=_norm_gate_up_ref, tolerance=MATMUL_TOLERANCE, cost=_norm_gate_up_cost),
    # 2..SKINNY_ROWS rows: down_proj's shape at the decode batches served in that range (the largest when none)
    KernelCheck(op="skinny_linear", kernels=("_skinny_kernel",),
                shapes=lambda s: [(t, s.intermediate, s.hidden) for t in _skinny_rows(s)],
                inputs=_linear_inputs, kernel=skinny_triton, reference=linear_ref, tolerance=MATMUL_TOLERANCE,
                cost=matmul_cost),
]
