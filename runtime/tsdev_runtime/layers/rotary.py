import torch
from torch import nn

from tsdev_kernels.ops import rope as rope_ops


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        # derived, not loaded: filled by process_weights_after_loading, in place (CUDA graphs read it)
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, head_dim, dtype=torch.float32), persistent=False)

    def process_weights_after_loading(self) -> None:
        table = rope_ops.rope_cos_sin_cache(self.head_dim, self.max_positions, self.theta, self.cos_sin_cache.device,
                                            scaling=self.scaling)
        self.cos_sin_cache.copy_(table)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D]; given per-head RMSNorms (Qwen3), normalise first, in one fused op."""
        if q_norm is None:
            return rope_ops.apply_rope(q, k, positions, self.cos_sin_cache)
        return rope_ops.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, q_norm.eps, positions, self.cos_sin_cache)
