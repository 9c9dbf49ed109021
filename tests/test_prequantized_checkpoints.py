"""A checkpoint whose weights are stored in a quantized format tsdev does not load (AWQ, GPTQ, FP8 with per-tensor
scales; block FP8 loads: tests/test_fp8_block_checkpoints.py) is refused before anything loads, naming what it is
and what to serve instead -- not with "tensors this model does not use ... is config.json's architecture right?",
which is what such checkpoints got; a block-FP8 one whose stacked shards split its blocks says so."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tsdev_kernels.ops.fp8_block import quantize_fp8_blocks
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.weights.default_model import SHAPES, write_checkpoint


def quantized_copy(out, quantization: dict):
    write_checkpoint(out, {**SHAPES["tiny"], "max_position_embeddings": 1024}, seed=1, std=0.2)
    path = out / "model.safetensors"
    tensors = {}
    for name, tensor in load_file(str(path)).items():
        if name.endswith("proj.weight") and quantization["quant_method"] == "fp8":  # as the FP8 releases store them
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8_blocks(tensor)
        else:
            tensors[name] = tensor
    save_file(tensors, str(path))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return out


def test_a_block_fp8_checkpoint_whose_stacked_shards_split_its_blocks_is_refused_naming_them(tmp_path):
    model = quantized_copy(tmp_path, {"quant_method": "fp8", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"})  # the tiny shape: q 64 rows, k and v 32
    assert any(t.dtype == torch.float8_e4m3fn for t in load_file(str(model / "model.safetensors")).values())
    with pytest.raises(ValueError) as refused:
        LLMEngine(EngineConfig(model=str(model), device="cpu"))
    message = str(refused.value)
    assert "q: 64 rows" in message and "whole 128-row blocks" in message and "architecture" not in message


def test_fp8_with_per_tensor_scales_is_refused_naming_what_loads(tmp_path):
    model = quantized_copy(tmp_path, {"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(ValueError, match="per-tensor or per-channel scales.*weight_block_size \\[128, 128\\]"):
        LLMEngine(EngineConfig(model=str(model), device="cpu"))


def test_another_quantization_method_is_refused_by_name(tmp_path):
    model = quantized_copy(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128})
    with pytest.raises(ValueError, match="quant_method awq.*unquantized"):
        LLMEngine(EngineConfig(model=str(model), device="cpu"))
