import torch
from torch import nn

from tsdev_kernels.ops import norm as norm_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: rms_norm(x). With it: (rms_norm(x + residual), x + residual)."""
        if residual is None:
            return norm_ops.rms_norm(x, self.weight, self.eps)
        return norm_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
