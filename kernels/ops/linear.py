"""Linear projections: y = x @ w.T (+ bias). One input row (decode at batch 1) runs a Triton GEMV;
more rows go to cuBLAS (`F.linear`).

At one row a projection is a pure read of its weight, which cuBLAS's kernels for that shape do not
always do at full speed. The GEMV gives each program a block of BLOCK_N output columns: it streams
those weight rows once in BLOCK_K chunks, multiplies them elementwise by the input in float32, and
reduces once at the end (one rounding to the output dtype, as cuBLAS does).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.ops import use_triton


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@triton.jit
def _gemv_kernel(X, W, B, OUT, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    rows = W + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        w = tl.load(rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + k0 + ks, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(OUT + cols, y.to(OUT.dtype.element_ty), mask=col_ok)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 4,
                block_k: int = 1024, num_warps: int = 2, num_stages: int = 3) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] -> [..., N] in x's dtype. The default config is the best of
    `benchmarks/kernels_bench.py --only linear --sweep` on the H200 for the Qwen3-0.6B projections."""
    K, N = x.shape[-1], weight.shape[0]
    if x.numel() != K:
        raise ValueError(f"gemv_triton multiplies one row; x has shape {tuple(x.shape)}")
    x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, out, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(K)),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias), x [..., K]: the Triton GEMV for a single row on CUDA, else cuBLAS."""
    if use_triton(x, "linear") and x.numel() == x.shape[-1]:
        return gemv_triton(x, weight, bias)
    return linear_ref(x, weight, bias)
