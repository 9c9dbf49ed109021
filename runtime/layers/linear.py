"""Linear layers. Merged projections (q|k|v, gate|up) run as one matmul and load per shard."""
import torch
from torch import nn

from kernels.ops import linear as linear_ops


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_ops.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension."""

    def __init__(self, in_features: int, shards: dict[str, int]):
        super().__init__(in_features, sum(shards.values()))
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, shard: str, tensor: torch.Tensor) -> None:
        offset, size = self.shard_offsets[shard]
        target = self.weight.data[offset : offset + size]
        if target.shape != tensor.shape:
            raise ValueError(f"shard {shard}: expected shape {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}")
        target.copy_(tensor)
