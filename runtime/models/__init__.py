"""Model definitions, by Hugging Face architecture name."""
import torch
from torch import nn

from runtime.config import ModelConfig
from runtime.models.qwen3 import Qwen3ForCausalLM

MODELS = {"Qwen3ForCausalLM": Qwen3ForCausalLM}


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """The model of `config` with its parameters allocated (not loaded) on `device` in `dtype`."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return MODELS[config.architecture](config)
    finally:
        torch.set_default_dtype(default_dtype)
