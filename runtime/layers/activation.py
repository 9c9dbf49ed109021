import torch
from torch import nn

from kernels.ops import activation as act_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_ops.silu_and_mul(x)
