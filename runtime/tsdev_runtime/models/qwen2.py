"""Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (none on o_proj)."""
from tsdev_runtime.config import ModelConfig
from tsdev_runtime.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    attention = Qwen2Attention
