"""Qwen3-MoE: Qwen3 whose MLPs are sparse (`runtime/tsdev_runtime/moe/`) except in `mlp_only_layers` and the layers that
`decoder_sparse_step` skips, as transformers decides."""
from torch import nn

from tsdev_runtime.config import ModelConfig
from tsdev_runtime.models.llama import LlamaForCausalLM, LlamaMLP
from tsdev_runtime.models.qwen3 import Qwen3Attention
from tsdev_runtime.moe.layer import SparseMoeBlock


def num_experts(config: ModelConfig) -> int:
    """`num_experts` (hub checkpoints) or `num_local_experts` (what transformers 5 writes)."""
    return int(config.raw.get("num_experts") or config.raw.get("num_local_experts") or 0)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)
    attention = Qwen3Attention

    @staticmethod
    def mlp(config: ModelConfig, layer: int) -> nn.Module:
        raw, experts = config.raw, num_experts(config)
        sparse = (experts > 0 and layer not in raw.get("mlp_only_layers", [])
                  and (layer + 1) % raw.get("decoder_sparse_step", 1) == 0)
        if not sparse:
            return LlamaMLP(config)
        return SparseMoeBlock(config.hidden_size, experts, raw["num_experts_per_tok"], raw["moe_intermediate_size"],
                              raw.get("norm_topk_prob", False))
