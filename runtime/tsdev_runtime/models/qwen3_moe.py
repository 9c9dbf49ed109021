"""Qwen3-MoE: Qwen3 whose MLPs are sparse (`runtime/tsdev_runtime/moe/`) except in `mlp_only_layers` and the layers
that `decoder_sparse_step` skips, as transformers decides."""
from torch import nn

from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.linear import NormedProjection
from tsdev_runtime.layers.rotary import RotaryEmbedding
from tsdev_runtime.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from tsdev_runtime.models.qwen3 import Qwen3DecoderLayer
from tsdev_runtime.moe.layer import SparseMoeBlock


def num_experts(config: ModelConfig) -> int:
    """`num_experts` (hub checkpoints) or `num_local_experts` (what transformers 5 writes)."""
    return int(config.raw.get("num_experts") or config.raw.get("num_local_experts") or 0)


def is_sparse(config: ModelConfig, layer: int) -> bool:
    raw, experts = config.raw, num_experts(config)
    return (experts > 0 and layer not in raw.get("mlp_only_layers", [])
            and (layer + 1) % raw.get("decoder_sparse_step", 1) == 0)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int):
        self.sparse = is_sparse(config, layer)
        super().__init__(config, rope, layer)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        if not self.sparse:
            return LlamaMLP(config)
        raw = config.raw
        return SparseMoeBlock(config.hidden_size, num_experts(config), raw["num_experts_per_tok"],
                              raw["moe_intermediate_size"], raw.get("norm_topk_prob", False))

    def make_mlp_input(self) -> NormedProjection:
        """A sparse MLP's router reads the normed input itself: the norm alone."""
        return NormedProjection(self.post_attention_layernorm) if self.sparse else super().make_mlp_input()


class Qwen3MoeModel(LlamaModel):
    decoder_layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)
    model_class = Qwen3MoeModel
