"""Model definitions, by Hugging Face architecture name."""
from runtime.models.qwen3 import Qwen3ForCausalLM

MODELS = {"Qwen3ForCausalLM": Qwen3ForCausalLM}
