"""Op families: norm, rope, activation, linear, fp8, attention, sampling. Import the submodules directly.

Each public op runs its Triton kernel when its inputs are on CUDA and its torch reference otherwise.
Set TSDEV_KERNELS=ref to run the references on CUDA too (to compare speed or rule a kernel out), or
TSDEV_KERNELS=ref:linear,rope to do that for those families only.
Under TRITON_INTERPRET=1 the Triton entry points (`*_triton`) also run on CPU tensors; the tests use that.
"""
import functools
import os

import torch


FAMILIES = ("norm", "rope", "activation", "linear", "fp8", "attention", "sampling")


def reference_families() -> set[str]:
    """The op families TSDEV_KERNELS sends to their torch references on CUDA."""
    value = os.environ.get("TSDEV_KERNELS", "triton")
    if value in ("triton", ""):
        return set()
    if value == "ref":
        return set(FAMILIES)
    names = set(value.removeprefix("ref:").split(",")) if value.startswith("ref:") else None
    if names is None or not names <= set(FAMILIES):
        raise ValueError(f"TSDEV_KERNELS={value!r}: expected triton, ref, or ref:FAMILY[,FAMILY...] with "
                         f"families from {', '.join(FAMILIES)}")
    return names


def use_triton(x: torch.Tensor, family: str) -> bool:
    """Whether the public op of `family` should launch its Triton kernel for this input."""
    return x.is_cuda and family not in reference_families()


@functools.lru_cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (kernels size their grids by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
