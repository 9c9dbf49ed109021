"""Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (none on o_proj), whatever config.json's
attention_bias says (Hugging Face's Qwen2Attention)."""
from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.rotary import RotaryEmbedding
from tsdev_runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int):
        super().__init__(config, rope, layer, attention_bias=(True, False))


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen2ForCausalLM",)

    def __init__(self, config: ModelConfig):
        super().__init__(config, Qwen2DecoderLayer)
