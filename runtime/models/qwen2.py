"""Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (none on o_proj)."""
from runtime.config import ModelConfig
from runtime.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(config: ModelConfig) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    attention = Qwen2Attention
