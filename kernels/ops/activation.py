"""Gated activations.

SiLU-and-mul reads gate | up once and writes silu(gate) * up: one program per (row, block of columns).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.ops import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding gate | up. Returns silu(gate) * up: [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    # rounded where the reference rounds: silu's result, then the product
    act = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * I + cols, (act * up).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    I = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * I)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], I, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(I, block))](x2, out, x2.stride(0), I, BLOCK=block, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding gate | up (the merged gate_up projection). Returns silu(gate) * up: [..., I].

    Float32 inside; rounded to x's dtype after the SiLU and after the product, like the reference.
    """
    if use_triton(x, "activation"):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
