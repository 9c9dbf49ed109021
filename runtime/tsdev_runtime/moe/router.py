"""The router: softmax over the experts, the top k of them, renormalised (`norm_topk_prob`), as transformers' Qwen3-MoE
routes. On CUDA the router's GEMM and one Triton launch (kernels/tsdev_kernels/ops/router.py), elsewhere torch's.
Replicated on every tensor-parallel rank and never quantized: a routing that differed between ranks would send a
token's partial sums to different experts."""
import torch
from torch import nn

from tsdev_kernels.ops.router import route_triton


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int32) of each token's chosen experts; the weights are rounded
        to x's dtype first, where transformers rounds them."""
        if x.is_cuda:
            return route_triton(x, self.weight, self.top_k, self.norm_topk_prob)
        probs = torch.softmax(torch.nn.functional.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype).float(), ids.to(torch.int32)
