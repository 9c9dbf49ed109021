import torch
from torch import nn

from tsdev_kernels.ops import activation as act_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up of a merged gate|up projection's output. At one row on CUDA the projection's GEMV runs
    the activation kernel's arithmetic itself (`NormedProjection`) and this forward is not called."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_ops.silu_and_mul(x)
