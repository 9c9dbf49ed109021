"""Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (none on o_proj)."""
from tsdev_runtime.config import ModelConfig
from tsdev_runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        return True, False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen2Attention


class Qwen2Model(LlamaModel):
    decoder_layer_class = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    model_class = Qwen2Model
