import torch
from torch import nn

from tsdev_kernels.ops import rope as rope_ops


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        # derived, not loaded: filled by process_weights_after_loading, in place (CUDA graphs read it)
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, head_dim, dtype=torch.float32),
                             persistent=False)

    def process_weights_after_loading(self) -> None:
        table = rope_ops.rope_cos_sin_cache(self.head_dim, self.max_positions, self.theta, self.cos_sin_cache.device,
                                            scaling=self.scaling)
        self.cos_sin_cache.copy_(table)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] by their tokens' positions."""
        return rope_ops.apply_rope(q, k, positions, self.cos_sin_cache)


def qk_norm_rope(q_norm: nn.Module, k_norm: nn.Module, rope: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and of k (`q_norm`, `k_norm`: RMSNorms of head_dim), then `rope`'s rotation, in
    one kernel (`rope_ops.qk_norm_rope`: the norm's arithmetic inside the rotation's; the two ops one after another
    where TSDEV_KERNELS takes either off Triton, and off CUDA)."""
    return rope_ops.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, q_norm.eps, positions, rope.cos_sin_cache)
