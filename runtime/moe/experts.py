"""The experts of one sparse layer, stacked: `w13 [E, 2·I, H]` (each expert's gate rows, then its up rows) and
`w2 [E, H, I]`, so one grouped kernel (`kernels/ops/moe.py`) runs every expert a step chose.

Loaded per expert from the hub's names (`mlp.experts.E.gate_proj.weight`, `up_proj`, `down_proj`) through the
declared-keys protocol (`runtime/weights/keys.py`): w13 expects the keys (e, "gate") and (e, "up") of every expert,
w2 the keys (e, "down"), so "is this layer complete" is exact however the tensors arrive. Under tensor parallelism
each rank holds its slice of every expert's intermediate features (rows of gate and up, columns of down); the
partial outputs are summed after the layer."""
import torch
from torch import nn

from runtime import distributed
from runtime.weights.keys import DeclaredLoading, Key
from runtime.weights.layout import RankSlice

PROJECTIONS = {"gate": "w13", "up": "w13", "down": "w2"}


class StackedExperts(DeclaredLoading, nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        start, self.local_intermediate = distributed.shard(intermediate_size, "the experts' intermediate features")
        i = self.local_intermediate
        self.rows = RankSlice((intermediate_size, hidden_size), 0, start, i)  # of gate_proj / up_proj
        self.columns = RankSlice((hidden_size, intermediate_size), 1, start, i)  # of down_proj
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)

    def checkpoint_names(self, attr: str) -> dict[str, tuple[str, Key]]:
        return {f"{attr}.{e}.{proj}_proj.weight": (param, (e, proj))
                for e in range(self.num_experts) for proj, param in PROJECTIONS.items()}

    def weight_slice(self, param: str, key: Key) -> RankSlice:
        return self.columns if key[1] == "down" else self.rows

    def load_weight(self, param: str, key: Key, tensor: torch.Tensor) -> None:
        expert, proj = key
        i = self.local_intermediate
        target = {"gate": self.w13.data[expert, :i], "up": self.w13.data[expert, i:], "down": self.w2.data[expert]}[proj]
        if target.shape != tensor.shape:
            raise ValueError(f"expert {expert} {proj}_proj: expected shape {tuple(target.shape)}, checkpoint has "
                             f"{tuple(tensor.shape)}")
        target.copy_(tensor)
