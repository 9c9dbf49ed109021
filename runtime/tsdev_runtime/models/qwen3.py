"""Qwen3 (dense): Llama with a per-head RMSNorm of q and k before the rotation (fused with it in one kernel)."""
import torch

from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.norm import RMSNorm
from tsdev_runtime.layers.rotary import QKNormRope, RotaryEmbedding
from tsdev_runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding):
        super().__init__(config, rope)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm_rope = QKNormRope(self.q_norm, self.k_norm, rope)

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.qk_norm_rope(positions, q, k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen3ForCausalLM",)
    model_class = Qwen3Model
