"""RoPE scaling (linear, llama3, yarn) against transformers' own rope functions, and reading it from config.json.

The oracle is transformers itself: a LlamaConfig carrying the scaling, its ROPE_INIT_FUNCTIONS entry for the
inverse frequencies and attention factor, and cos/sin formed as its rotary embedding forms them.
"""
import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tsdev_kernels.ops import rope
from tsdev_runtime.layers.rotary import RotaryEmbedding

TIGHT = {"atol": 1e-6, "rtol": 1e-6}
POSITIONS = 12000  # table rows checked: past every case's original context, short of 131072 (kept fast)

# (head_dim, theta, max_position_embeddings, rope_scaling)
CASES = {
    "default": (64, 10000.0, 2048, None),
    "linear-4": (64, 10000.0, 8192, {"rope_type": "linear", "factor": 4.0}),
    "linear-legacy-type": (128, 1e6, 4096, {"type": "linear", "factor": 2.0}),
    "llama3.2": (64, 500000.0, 131072, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama3.1": (128, 500000.0, 131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn-4": (128, 1e6, 16384, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    "yarn-betas-no-truncate": (64, 10000.0, 8192, {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16,
                                                   "beta_slow": 2, "truncate": False,
                                                   "original_max_position_embeddings": 1024}),
    "yarn-mscale": (64, 10000.0, 163840, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                          "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                                          "original_max_position_embeddings": 4096}),
    "yarn-attention-factor": (32, 10000.0, 8192, {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.8,
                                                  "original_max_position_embeddings": 4096}),
}


def hf_config(head_dim: int, theta: float, max_positions: int, scaling: dict | None) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                                    num_hidden_layers=1, intermediate_size=8, vocab_size=16,
                                    max_position_embeddings=max_positions, rope_theta=theta,
                                    rope_scaling=dict(scaling) if scaling else None)


def hf_inv_freq(config: transformers.LlamaConfig) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))


@pytest.mark.parametrize("name", CASES)
def test_table_matches_transformers(name):
    head_dim, theta, max_positions, scaling = CASES[name]
    inv_freq, attention_scaling = hf_inv_freq(hf_config(head_dim, theta, max_positions, scaling))
    freqs = torch.arange(POSITIONS)[:, None].float() * inv_freq
    want = torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], dim=-1)

    got_inv_freq, got_scale = rope.rope_inv_freq(head_dim, theta, scaling)
    assert torch.equal(got_inv_freq, inv_freq)
    assert got_scale == attention_scaling
    torch.testing.assert_close(rope.rope_cos_sin_cache(head_dim, POSITIONS, theta, scaling=scaling), want, **TIGHT)


@pytest.mark.parametrize("name", ["default", "llama3.2", "yarn-mscale"])
def test_rotary_module_matches_transformers_rotary_embedding(name):
    """The whole path: config.json -> rope_settings -> RotaryEmbedding's table, against LlamaRotaryEmbedding."""
    head_dim, theta, max_positions, scaling = CASES[name]
    config = hf_config(head_dim, theta, max_positions, scaling)
    positions = torch.randint(0, POSITIONS, (1, 257))
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)

    got_theta, got_scaling = rope.rope_settings(config.to_dict())
    module = RotaryEmbedding(head_dim, POSITIONS, got_theta, got_scaling)
    module.process_weights_after_loading()
    table = module.cos_sin_cache[positions[0]]
    torch.testing.assert_close(table[:, : head_dim // 2], cos[0, :, : head_dim // 2], **TIGHT)
    torch.testing.assert_close(table[:, head_dim // 2:], sin[0, :, : head_dim // 2], **TIGHT)


def test_yarn_attention_factor_scales_the_table():
    head_dim, theta, max_positions, scaling = CASES["yarn-4"]
    _, attention_scaling = hf_inv_freq(hf_config(head_dim, theta, max_positions, scaling))
    assert attention_scaling > 1.0  # the case would not tell anything otherwise
    table = rope.rope_cos_sin_cache(head_dim, 8, theta, scaling=scaling)
    torch.testing.assert_close(table[0, : head_dim // 2], torch.full((head_dim // 2,), attention_scaling))


def saved_config(tmp_path, **kwargs) -> dict:
    transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=8,
                             vocab_size=16, **kwargs).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("name", [name for name in CASES if name != "default"])
def test_rope_settings_of_configs_transformers_saved(tmp_path, name):
    head_dim, theta, max_positions, scaling = CASES[name]
    raw = saved_config(tmp_path, head_dim=head_dim, max_position_embeddings=max_positions, rope_theta=theta,
                       rope_scaling=dict(scaling))
    assert "rope_parameters" in raw and "rope_scaling" not in raw  # what transformers 5 writes
    got_theta, got_scaling = rope.rope_settings(raw)
    assert got_theta == theta
    expected = {key: value for key, value in scaling.items() if key != "type"}
    expected["rope_type"] = scaling.get("rope_type", scaling.get("type"))
    assert got_scaling == expected
    # and the table built from it is the one transformers computes from its reloaded config
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path)
    inv_freq, _ = hf_inv_freq(reloaded)
    assert torch.equal(rope.rope_inv_freq(head_dim, got_theta, got_scaling)[0], inv_freq)


def test_rope_settings_of_unscaled_configs_transformers_saved(tmp_path):
    assert rope.rope_settings(saved_config(tmp_path / "a", rope_theta=1e6)) == (1e6, None)
    assert rope.rope_settings(saved_config(tmp_path / "b")) == (10000.0, None)


def test_rope_settings_fills_the_pretraining_length_as_transformers_does(tmp_path):
    raw = saved_config(tmp_path, max_position_embeddings=32768, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert rope.rope_settings(raw)[1]["original_max_position_embeddings"] == 32768
    hub = {"max_position_embeddings": 32768, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert rope.rope_settings(hub) == (1e6, {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32768})


def test_rope_settings_of_hub_style_configs():
    llama32 = {"rope_theta": 500000.0, "max_position_embeddings": 131072,
               "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    assert rope.rope_settings(llama32) == (500000.0, llama32["rope_scaling"])
    assert rope.rope_settings({"rope_theta": 1000000, "rope_scaling": None}) == (1e6, None)
    assert rope.rope_settings({"rope_theta": 1e6, "rope_scaling": {}}) == (1e6, None)
    assert rope.rope_settings({}) == (10000.0, None)
    assert rope.rope_settings({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}) == (5e5, None)
    assert rope.rope_settings({"rope_scaling": {"type": "linear", "factor": 2.0}}) == (
        10000.0, {"rope_type": "linear", "factor": 2.0})


def test_rope_settings_agrees_with_transformers_when_both_spellings_appear():
    raw = {"rope_theta": 7e5, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
           "rope_scaling": {"rope_type": "linear", "factor": 3.0}}
    config = transformers.LlamaConfig.from_dict({"hidden_size": 64, "num_attention_heads": 2, **raw})
    theta, scaling = rope.rope_settings(raw)
    assert (theta, scaling["factor"]) == (config.rope_parameters["rope_theta"], config.rope_parameters["factor"])


def test_the_input_dict_is_left_alone():
    raw = {"rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": 8}
    rope.rope_settings(raw)
    assert raw == {"rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": 8}


@pytest.mark.parametrize("scaling,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"'dynamic'.*default, linear, llama3, yarn"),
    ({"type": "longrope", "factor": 2.0}, r"'longrope'.*supported"),
    ({"rope_type": "linear"}, r"'factor'"),
    ({"rope_type": "linear", "factor": None}, r"'factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
     r"'high_freq_factor'"),
    ({"rope_type": "yarn", "factor": 4.0}, r"'original_max_position_embeddings'"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, r"partial_rotary_factor"),
])
def test_bad_scaling_names_the_type_or_field(scaling, message):
    with pytest.raises(ValueError, match=message):
        rope.rope_cos_sin_cache(64, 16, 10000.0, scaling=scaling)


def test_partial_rotary_is_not_silently_dropped():
    _, scaling = rope.rope_settings({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope.rope_cos_sin_cache(64, 16, 10000.0, scaling=scaling)
