"""Qwen3-MoE: Qwen3 whose MLPs are sparse (`runtime/tsdev_runtime/moe/`) except in `mlp_only_layers` and the layers
that `decoder_sparse_step` skips, as transformers decides. A sparse MLP's router reads the normed state itself, so the
post-attention norm runs alone before it; a dense layer is Qwen3's."""
import torch
from torch import nn

from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.norm import RMSNorm
from tsdev_runtime.layers.rotary import RotaryEmbedding
from tsdev_runtime.models.llama import LlamaForCausalLM
from tsdev_runtime.models.qwen3 import Qwen3Attention, Qwen3MLP
from tsdev_runtime.moe.layer import SparseMoeBlock


def num_experts(config: ModelConfig) -> int:
    """`num_experts` (hub checkpoints) or `num_local_experts` (what transformers 5 writes)."""
    return int(config.raw.get("num_experts") or config.raw.get("num_local_experts") or 0)


def is_sparse(config: ModelConfig, layer: int) -> bool:
    raw, experts = config.raw, num_experts(config)
    return (experts > 0 and layer not in raw.get("mlp_only_layers", [])
            and (layer + 1) % raw.get("decoder_sparse_step", 1) == 0)


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int):
        super().__init__()
        self.sparse, raw = is_sparse(config, layer), config.raw
        self.self_attn = Qwen3Attention(config, rope)
        self.mlp = (SparseMoeBlock(config.hidden_size, num_experts(config), raw["num_experts_per_tok"],
                                   raw["moe_intermediate_size"], raw.get("norm_topk_prob", False))
                    if self.sparse else Qwen3MLP(config))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_layernorm -> self_attn -> post_attention_layernorm -> mlp, each norm adding the residual stream
        first (`norm=`: it runs in the kernel of the projection after it). Returns (this layer's output, the residual
        stream before it is added): the next norm adds them."""
        hidden, residual = self.self_attn(positions, hidden, residual, norm=self.input_layernorm)
        if not self.sparse:
            return self.mlp(hidden, residual, norm=self.post_attention_layernorm)
        hidden, residual = self.post_attention_layernorm(hidden, residual)  # alone: the router reads its output
        return self.mlp(hidden), residual


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)

    def __init__(self, config: ModelConfig):
        super().__init__(config, Qwen3MoeDecoderLayer)
