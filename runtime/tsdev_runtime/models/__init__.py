"""Model definitions, one file per family; each model class names the Hugging Face architectures it serves."""
import torch
from torch import nn

from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.linear import Linear, check_quantization
from tsdev_runtime.models.llama import LlamaForCausalLM
from tsdev_runtime.models.qwen2 import Qwen2ForCausalLM
from tsdev_runtime.models.qwen3 import Qwen3ForCausalLM
from tsdev_runtime.models.qwen3_moe import Qwen3MoeForCausalLM
from tsdev_runtime.moe.experts import StackedExperts

MODELS: dict[str, type[nn.Module]] = {
    arch: cls for cls in (Qwen3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM) for arch in cls.architectures}


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                quantization: str | None = None) -> nn.Module:
    """The model of `config` with its parameters allocated (not loaded) on `device` in `dtype`: under tensor
    parallelism (`tsdev_runtime.distributed` initialised), this rank's part of it.

    `quantization` ("fp8"): every projection (`Linear`: q|k|v, o, gate|up, down; not the embedding, the logits or
    a router) and the experts (`StackedExperts`) derive quantized weights at each load and run on them; a device
    that cannot run them fails here, before any weight loads."""
    if quantization is not None:
        check_quantization(quantization, device)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MODELS[config.architecture](config)  # Checkpoint.open checked it is served
            if quantization is not None:
                for module in model.modules():
                    if isinstance(module, (Linear, StackedExperts)):
                        module.quantize(quantization)
            return model
    finally:
        torch.set_default_dtype(default_dtype)
