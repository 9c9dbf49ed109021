"""Gated activations.

SiLU-and-mul reads gate | up once and writes silu(gate) * up: one program per (row, block of columns).
The arithmetic is `silu_and_mul_values`, which the one-row GEMV also runs on the gate_up projection's output
(kernels/tsdev_kernels/ops/linear.py, the decode step at batch 1): an edit there reaches both.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tsdev_kernels.checks import KernelCheck, Tolerance, nbytes
from tsdev_kernels.ops import pdl, use_triton, wait_for_previous


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding gate | up. Returns silu(gate) * up: [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def silu_and_mul_values(gate, up, dt):
    """silu(gate) * up in float32 from float32 gate and up (values of dtype dt), rounded to dt where the
    reference rounds: silu's result (the caller rounds the product)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    return act * up


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * I + cols, silu_and_mul_values(gate, up, OUT.dtype.element_ty).to(OUT.dtype.element_ty),
             mask=mask)


def silu_and_mul_triton(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    I = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * I)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], I, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        use_pdl = pdl(x)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(I, block))](x2, out, x2.stride(0), I, BLOCK=block, PDL=use_pdl,
                                                                     num_warps=4, launch_pdl=use_pdl)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding gate | up (the merged gate_up projection). Returns silu(gate) * up: [..., I].

    Float32 inside; rounded to x's dtype after the SiLU and after the product, like the reference.
    """
    if use_triton(x, "activation"):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def _check_inputs(shape, dtype, device, generator):
    return (torch.randn(shape, generator=generator, device=device).to(dtype),)


CHECKS = [
    KernelCheck(
        op="silu_and_mul", kernels=("_silu_and_mul_kernel",),
        shapes=lambda serving: [(tokens, 2 * serving.intermediate) for tokens in serving.tokens],
        inputs=_check_inputs, kernel=silu_and_mul_triton, reference=silu_and_mul_ref,
        cost=lambda x: (nbytes(x) * 3 // 2, 0),  # [T, 2I] read, [T, I] written
        tolerance={torch.bfloat16: Tolerance(1e-2, 1.6e-2, "bf16 output: the kernel rounds where the reference "
                                             "does, exp in float32 may differ by an ulp, then one bf16 rounding"),
                   torch.float16: Tolerance(1e-3, 2e-3, "fp16 output, as bf16 with 3 more mantissa bits"),
                   torch.float32: Tolerance(1e-5, 1e-5, "float32 throughout: exp's last bits")}),
]
