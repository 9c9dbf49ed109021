"""Model definitions, one file per family; each model class names the Hugging Face architectures it serves."""
import logging

import torch
from torch import nn

from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.linear import Linear, check_quantization
from tsdev_runtime.models.deepseek import DeepseekForCausalLM
from tsdev_runtime.models.llama import LlamaForCausalLM
from tsdev_runtime.models.qwen2 import Qwen2ForCausalLM
from tsdev_runtime.models.qwen3 import Qwen3ForCausalLM
from tsdev_runtime.models.qwen3_moe import Qwen3MoeForCausalLM
from tsdev_runtime.moe.experts import StackedExperts

log = logging.getLogger(__name__)

MODELS: dict[str, type[nn.Module]] = {
    arch: cls for cls in (Qwen3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM,
                          DeepseekForCausalLM)
    for arch in cls.architectures}


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                quantization: str | None = None) -> nn.Module:
    """The model of `config` with its parameters allocated (not loaded) on `device` in `dtype`: under tensor
    parallelism (`tsdev_runtime.distributed` initialised), this rank's part of it.

    `quantization` ("fp8"): every projection (`Linear`: q|k|v, o, gate|up, down; not the embedding, the logits or
    a router) and the experts (`StackedExperts`) derive quantized weights at each load and run on them; a device
    that cannot run them fails here, before any weight loads.

    A checkpoint stored as block-quantized FP8 (its config.json's `quantization_config`): every projection the
    config does not leave unconverted (`modules_to_not_convert`) holds its e4m3 weight and block scales as stored, and
    so do the sparse layers' experts."""
    blocks = config.fp8_blocks
    if quantization is not None and blocks:
        raise ValueError(f"--quantization {quantization}: this checkpoint is stored quantized already "
                         "(quantization_config in its config.json): leave --quantization out")
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
            if blocks:
                store_fp8_blocks(model, blocks, config.raw["quantization_config"].get("modules_to_not_convert") or [])
            return model
    finally:
        torch.set_default_dtype(default_dtype)


def store_fp8_blocks(model: nn.Module, block: tuple[int, int], unconverted: list[str]) -> None:
    """Every projection and every layer's experts but those under `unconverted` (checkpoint module names, or prefixes
    of them) hold block-FP8 weights; a layer with some experts converted and others not is refused."""
    def left(checkpoint_name: str) -> bool:
        return any(checkpoint_name == u or checkpoint_name.startswith(u + ".") for u in unconverted)
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not any(map(left, _checkpoint_names(name, module))):
            try:
                module.store_fp8_blocks(block)
            except ValueError as exc:  # say which layer
                raise ValueError(f"{name}: {exc}") from None
        elif isinstance(module, StackedExperts) and not left(name):
            if partly := [u for u in unconverted if u.startswith(name + ".")]:
                raise ValueError(f"{partly[0]} is left unconverted in a block-FP8 checkpoint whose other experts of "
                                 "that layer are converted: tsdev serves a layer's experts all alike")
            module.store_fp8_blocks(block)


def _checkpoint_names(name: str, module: Linear) -> list[str]:
    """The checkpoint's module names for `module` (a stacked q|k|v is q_proj, k_proj and v_proj)."""
    shards = getattr(module, "shard_slices", None)
    if not shards:
        return [name]
    parent = name.rpartition(".")[0]
    return [f"{parent}.{module.checkpoint_name.format(shard)}" for shard in shards]
