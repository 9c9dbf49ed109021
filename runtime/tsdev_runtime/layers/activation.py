import torch
from torch import nn

from tsdev_kernels.ops import activation as act_ops
from tsdev_kernels.ops import use_cute, use_triton


class SiluAndMul(nn.Module):
    """silu(gate) * up of a merged gate|up projection's output: the Triton kernel, or its CuTe DSL twin under
    TSDEV_KERNELS=cute:activation (kernels/tsdev_kernels/ops/activation_cute.py, imported then: the package is
    optional). At one row on CUDA the gate|up projection's GEMV runs the activation kernel's arithmetic
    itself (`tsdev_runtime.layers.linear.norm_linear`) and this forward is not called."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x, "activation") and use_cute("activation"):
            from tsdev_kernels.ops.activation_cute import silu_and_mul_cute
            return silu_and_mul_cute(x)
        return act_ops.silu_and_mul(x)
