import functools

import torch
from torch import nn

from kernels.ops import rope as rope_ops


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        self.register_buffer("cos_sin_cache", rope_ops.rope_cos_sin_cache(head_dim, max_positions, theta), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_ops.apply_rope(q, k, positions, self.cos_sin_cache)


@functools.lru_cache
def get_rope(head_dim: int, max_positions: int, theta: float) -> RotaryEmbedding:
    """One rotary table shared by every layer (it is large: max_positions x head_dim floats)."""
    return RotaryEmbedding(head_dim, max_positions, theta)
