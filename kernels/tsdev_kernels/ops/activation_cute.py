"""SwiGLU's silu_and_mul written in CuTe DSL (NVIDIA's CUTLASS Python DSL, `pip install tsdev[cute]`), served under
TSDEV_KERNELS=cute:activation in place of the Triton kernel (kernels/tsdev_kernels/ops/activation.py; same reference,
same rounding: silu rounded to the output dtype, then the product). A first CuTe DSL kernel to edit under `tsdev watch`,
not a fast one: a thread per output element.

Compiled kernels are kept in `_COMPILED`, a module-level cache keyed by dtype (the tensors' layouts are dynamic: one
kernel serves every row count), which a reload of this module starts empty: the next call compiles the new source
(in the reload's warm step, inside the pause). Compiles for the H200 on a CPU too (CUTE_DSL_ARCH=sm_90a): the tests.
"""
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack

from tsdev_kernels.checks import KernelCheck
from tsdev_kernels.ops.activation import CHECKS as TRITON_CHECKS, silu_and_mul_ref

THREADS = 256
_COMPILED: dict[torch.dtype, object] = {}


@cute.kernel
def _silu_and_mul_kernel(x: cute.Tensor, out: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, row, _ = cute.arch.block_idx()
    col = bidx * THREADS + tidx
    inter = out.shape[1]
    if col < inter:
        gate = x[row, col].to(cutlass.Float32)
        up = x[row, col + inter].to(cutlass.Float32)
        act = (gate / (1.0 + cute.math.exp(-gate))).to(out.element_type).to(cutlass.Float32)
        out[row, col] = (act * up).to(out.element_type)


@cute.jit
def _silu_and_mul_host(x: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
    _silu_and_mul_kernel(x, out).launch(grid=(cute.ceil_div(out.shape[1], THREADS), out.shape[0], 1),
                                        block=(THREADS, 1, 1), stream=stream)


def _tensor(t: torch.Tensor):
    return from_dlpack(t, assumed_align=16).mark_layout_dynamic()


def _stream(device: torch.device):
    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)


def compiled(x: torch.Tensor, out: torch.Tensor):
    """The compiled kernel for x's dtype (compiled now if this module has none yet)."""
    kernel = _COMPILED.get(x.dtype)
    if kernel is None:
        kernel = _COMPILED[x.dtype] = cute.compile(_silu_and_mul_host, _tensor(x), _tensor(out), _stream(x.device))
    return kernel


def silu_and_mul_cute(x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul (kernels/tsdev_kernels/ops/activation.py) on CUDA tensors by the CuTe DSL kernel."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        compiled(x2, out.view(-1, inter))(_tensor(x2), _tensor(out.view(-1, inter)), _stream(x.device))
    return out


CHECKS = [KernelCheck(op="silu_and_mul_cute", kernels=("_silu_and_mul_host",),
                      shapes=lambda serving: [(t, 2 * serving.intermediate) for t in serving.tokens]
                      if serving.device.startswith("cuda") else [],  # CuTe DSL runs on a GPU only
                      inputs=TRITON_CHECKS[0].inputs, kernel=silu_and_mul_cute, reference=silu_and_mul_ref,
                      cost=TRITON_CHECKS[0].cost,
                      tolerance=TRITON_CHECKS[0].tolerance)]
