"""The sparse MLP block of a mixture-of-experts layer: route each token to its top-k experts, run them in one fused
kernel (`StackedExperts.forward`: the alignment of tokens to experts, the gate|up GEMM with SiLU-and-mul, the down GEMM
with the router weights and the sum over k), and under tensor parallelism sum the ranks' partial outputs."""
import torch
from torch import nn

from tsdev_runtime import distributed
from tsdev_runtime.moe.experts import StackedExperts
from tsdev_runtime.moe.router import TopKRouter


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce(self.experts(x, *self.gate(x)))
