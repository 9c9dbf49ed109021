"""The routers. Qwen3-MoE's: softmax over the experts, the top k of them, renormalised (`norm_topk_prob`), as
transformers routes; DeepSeek-V2's and -V3's below. On CUDA the router's GEMM and one Triton launch
(kernels/tsdev_kernels/ops/router.py), elsewhere torch's. Replicated on every tensor-parallel rank and never
quantized: a routing that differed between ranks would send a token's partial sums to different experts."""
import torch
from torch import nn

from tsdev_kernels.ops.router import route_grouped_ref, route_grouped_triton, route_triton


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


class SoftmaxRouter(nn.Module):
    """DeepSeek-V2's: softmax over the experts of float32 logits (the weight is kept in float32, as transformers keeps
    it), the top k ("greedy"), or the top k of the `topk_group` groups whose best expert scores highest
    ("group_limited_greedy"), not renormalised, times `routed_scaling_factor`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scaling: float, method: str = "greedy",
                 n_group: int | None = None, topk_group: int | None = None):
        super().__init__()
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {method!r}: tsdev routes DeepSeek-V2 by greedy or group_limited_greedy")
        self.top_k, self.scaling, self.method = top_k, scaling, method
        self.n_group, self.topk_group = n_group, topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda and self.method == "greedy":
            weights, ids = route_triton(x.float(), self.weight, self.top_k, False)
            return weights * self.scaling, ids
        probs = torch.softmax(torch.nn.functional.linear(x.float(), self.weight), dim=-1)
        if self.method == "group_limited_greedy":
            groups = probs.view(probs.shape[0], self.n_group, -1)
            best = groups.amax(dim=-1).topk(self.topk_group, dim=-1).indices
            allowed = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
            probs = (groups * allowed[..., None]).flatten(1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return weights * self.scaling, ids.to(torch.int32)


class GroupedTopKRouter(nn.Module):
    """DeepSeek-V3's: sigmoid scores of float32 logits plus `e_score_correction_bias` choose, among the `topk_group`
    of `n_group` groups whose two best choices sum highest, the top k; their scores (without the bias),
    renormalised (`norm_topk_prob`), times `routed_scaling_factor` (kernels/tsdev_kernels/ops/router.py)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 renormalize: bool, scaling: float):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.renormalize, self.scaling = renormalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        route = route_grouped_triton if x.is_cuda else route_grouped_ref
        return route(x, self.weight, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                     self.renormalize, self.scaling)
