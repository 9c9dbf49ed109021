"""A model file reads like its model (issue 70): each family's decoder layer, attention and MLP are written out in its
own file, their forwards show what runs in order (norm -> attention -> norm -> MLP; gate|up -> silu(gate) * up ->
down), fusions are calls there (`norm_linear`, `qk_norm_rope`), and no model class is configured through override
hooks (`make_mlp`, `attention_class`, ...) that a subclass in another file replaces."""
import importlib
import inspect
import pkgutil

import pytest
from torch import nn

import tsdev_runtime.models

# what a family used to override to change a layer it did not define (issue 70)
OLD_HOOKS = {"attention_class", "decoder_layer_class", "model_class", "make_mlp", "make_attn_input", "make_mlp_input",
             "biases", "rotate", "rotary_dim", "attn_input", "mlp_input"}


def model_classes() -> list[type]:
    modules = [importlib.import_module(f"tsdev_runtime.models.{m.name}")
               for m in pkgutil.iter_modules(tsdev_runtime.models.__path__)] + [tsdev_runtime.models]
    return sorted({cls for module in modules for cls in vars(module).values()
                   if isinstance(cls, type) and issubclass(cls, nn.Module)
                   and cls.__module__.startswith("tsdev_runtime.models")}, key=lambda c: c.__qualname__)


def test_no_model_class_has_a_make_hook_or_overrides_a_method_of_another_model_class():
    classes = model_classes()
    assert len(classes) >= 15  # (the walk found them)
    for cls in classes:
        hooks = {name for name in dir(cls) if name.startswith("make_") or name in OLD_HOOKS}
        assert not hooks, f"{cls.__qualname__}: {sorted(hooks)}"
        for base in cls.__mro__[1:]:
            if base.__module__.startswith("tsdev_runtime.models"):
                overridden = set(vars(cls)) & set(vars(base)) - {"__init__", "__doc__", "__module__", "__qualname__",
                                                                "architectures"}
                assert not overridden, f"{cls.__qualname__} overrides {sorted(overridden)} of {base.__qualname__}"


@pytest.mark.parametrize("family, layer", [("llama", "LlamaDecoderLayer"), ("qwen3", "Qwen3DecoderLayer"),
                                           ("qwen3_moe", "Qwen3MoeDecoderLayer"), ("deepseek", "DeepseekDecoderLayer")])
def test_each_decoder_layers_forward_is_in_its_own_file_and_runs_norm_attention_norm_mlp(family, layer):
    cls = getattr(importlib.import_module(f"tsdev_runtime.models.{family}"), layer)
    assert "forward" in vars(cls) and "__init__" in vars(cls), f"{layer} defines its own forward and __init__"
    lines = inspect.getsource(cls.forward).splitlines()
    # the first line naming each: a norm fused into the block after it is named on that block's line
    order = [next(i for i, line in enumerate(lines) if name in line)
             for name in ("self.input_layernorm", "self.self_attn", "self.post_attention_layernorm", "self.mlp")]
    assert order == sorted(order), "\n".join(lines)


@pytest.mark.parametrize("family, attention, mlp", [("llama", "LlamaAttention", "LlamaMLP"),
                                                    ("qwen3", "Qwen3Attention", "Qwen3MLP"),
                                                    ("deepseek", "DeepseekAttention", "DeepseekMLP")])
def test_attention_and_mlp_forwards_show_their_projections_in_order(family, attention, mlp):
    module = importlib.import_module(f"tsdev_runtime.models.{family}")
    mlp_source = inspect.getsource(vars(getattr(module, mlp))["forward"])
    order = [mlp_source.index(name) for name in ("self.gate_up_proj", "self.act_fn", "self.down_proj")]
    assert order == sorted(order), mlp_source
    attention_source = inspect.getsource(vars(getattr(module, attention))["forward"])
    assert attention_source.index("self.attn(") < attention_source.index("self.o_proj("), attention_source
    if family == "qwen3":  # the fusions are calls in the forward, not modules or hooks elsewhere
        assert "norm_linear(norm, self.qkv_proj" in attention_source and "qk_norm_rope(" in attention_source
