"""Op families: norm, rope, activation, attention, sampling. Import the submodules directly.

Each public op runs its Triton kernel when its inputs are on CUDA and its torch reference otherwise.
Set TSDEV_KERNELS=ref to run the references on CUDA too (to compare speed or rule a kernel out).
Under TRITON_INTERPRET=1 the Triton entry points (`*_triton`) also run on CPU tensors; the tests use that.
"""
import functools
import os

import torch


def use_triton(x: torch.Tensor) -> bool:
    """Whether the public op should launch its Triton kernel for this input."""
    return x.is_cuda and os.environ.get("TSDEV_KERNELS", "triton") != "ref"


@functools.lru_cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (kernels size their grids by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
