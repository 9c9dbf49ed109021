"""Rotary position embedding (the "rotate half" / NeoX layout used by Qwen and Llama)."""
import torch


def rope_cos_sin_cache(head_dim: int, max_positions: int, theta: float) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def apply_rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T]. Returns rotated (q, k) in their dtype."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope_ref(q, k, positions, cos_sin_cache)
