"""Model definitions, by Hugging Face architecture name."""
import torch
from torch import nn

from runtime.config import ModelConfig
from runtime.layers.linear import Linear, check_quantization
from runtime.models.qwen3 import Qwen3ForCausalLM

MODELS = {"Qwen3ForCausalLM": Qwen3ForCausalLM}


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                quantization: str | None = None) -> nn.Module:
    """The model of `config` with its parameters allocated (not loaded) on `device` in `dtype`: under tensor
    parallelism (`runtime.distributed` initialised), this rank's part of it.

    `quantization` ("fp8"): every projection (`Linear`: q|k|v, o, gate|up, down; not the embedding or the
    logits) derives quantized weights at each load and runs on them; a device that cannot run them fails
    here, before any weight loads."""
    if quantization is not None:
        check_quantization(quantization, device)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MODELS[config.architecture](config)
            if quantization is not None:
                for module in model.modules():
                    if isinstance(module, Linear):
                        module.quantize(quantization)
            return model
    finally:
        torch.set_default_dtype(default_dtype)
