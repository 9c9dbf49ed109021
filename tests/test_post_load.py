"""Post-load processing: each module's hook runs once its parameters have every key their module declares
(runtime/tsdev_runtime/weights/keys.py: never element counts or sizes), children before parents, and again into the same
storage after a weight update."""
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tsdev_kernels.ops.rope import rope_cos_sin_cache, rope_settings
from tsdev_runtime.config import ModelConfig
from tsdev_runtime.layers.linear import MergedLinear
from tsdev_runtime.layers.rotary import RotaryEmbedding
from tsdev_runtime.models import MODELS
from tsdev_runtime.weights.loader import load_weights

SHARDS = {"q": 4, "k": 2, "v": 2}


class ScaledQKV(MergedLinear):
    """A fused q|k|v projection with a derived tensor, as fp8 will have: the weight's absolute maximum."""

    def __init__(self, log: list, tag: str):
        super().__init__(8, SHARDS)
        self.log, self.tag = log, tag
        self.register_buffer("amax", torch.zeros(()))

    def process_weights_after_loading(self) -> None:
        self.amax.copy_(self.weight.abs().amax())
        self.log.append(self.tag)


class Block(nn.Module):
    def __init__(self, log: list, i: int):
        super().__init__()
        self.log, self.tag = log, f"block{i}"
        self.qkv_proj = ScaledQKV(log, f"qkv{i}")

    def process_weights_after_loading(self) -> None:
        self.log.append(self.tag)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.log: list[str] = []
        self.layers = nn.ModuleList(Block(self.log, i) for i in range(2))

    def process_weights_after_loading(self) -> None:
        self.log.append("model")


def shard(i: int, s: str, value: float = 0.0, seed: int = 0) -> tuple[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + i * 10 + len(s))
    return f"layers.{i}.{s}_proj.weight", torch.rand(SHARDS[s], 8, generator=g) + value


@pytest.fixture
def toy(tmp_path):
    """A Toy whose checkpoint was loaded once (`toy.weights`: what that load recorded), with its log cleared."""
    save_file(dict(shard(i, s) for i in range(2) for s in SHARDS), tmp_path / "model.safetensors")
    model = Toy()
    model.weights = load_weights(model, tmp_path)
    assert model.log == ["qkv0", "block0", "qkv1", "block1", "model"]  # file order; children before parents
    model.log.clear()
    return model


def load_with_declared_size_trigger(model: Toy, loads) -> None:
    """The trigger this design rejects (vLLM's layerwise reload): process a module once the elements
    loaded into it reach its declared size; loads after that do not process it again."""
    loaded, processed = {}, set()
    for name, tensor in loads:  # layers.{i}.{shard}_proj.weight
        _, i, proj, _ = name.split(".")
        module = model.layers[int(i)].qkv_proj
        module.load_weight("weight", (proj.removesuffix("_proj"),), tensor)
        loaded[module] = loaded.get(module, 0) + tensor.numel()
        if module not in processed and loaded[module] >= module.weight.numel():
            module.process_weights_after_loading()
            processed.add(module)


def test_a_repeated_load_reaches_the_declared_size_early_but_not_the_declared_keys(toy, tmp_path):
    """q (4x8) loaded twice makes 64 elements, qkv_proj's declared size: the declared-size trigger derives
    amax before k and v arrive and leaves it stale; the declared keys wait for k and v."""
    update = [shard(0, "q", seed=1), shard(0, "q", seed=1), shard(0, "k", seed=1), shard(0, "v", 100.0, seed=1),
              *(shard(1, s, seed=1) for s in SHARDS)]
    declared = Toy()
    declared.load_state_dict(toy.state_dict())
    load_with_declared_size_trigger(declared, update)
    toy.weights.load_tensors(update)
    for model in (declared, toy):
        assert torch.equal(model.layers[0].qkv_proj.weight, toy.layers[0].qkv_proj.weight)
    fresh = toy.layers[0].qkv_proj.weight.abs().amax()
    assert fresh > 100
    assert declared.layers[0].qkv_proj.amax < 100  # derived from q and the old k, v: stale
    assert toy.layers[0].qkv_proj.amax == fresh  # the declared keys


def test_hooks_run_as_modules_complete_out_of_order_and_repeated(toy):
    loads = [shard(1, "v"), shard(1, "q"), shard(1, "k"), shard(0, "v"), shard(0, "q"), shard(0, "q"), shard(0, "k")]
    before_each = []

    def stream():
        for name, tensor in loads:
            before_each.append(list(toy.log))
            yield name, tensor

    toy.weights.load_tensors(stream())
    assert before_each[3] == ["qkv1", "block1"]  # layer 1 complete first
    assert before_each[6] == ["qkv1", "block1"]  # layer 0's q twice: not complete without k
    assert toy.log == ["qkv1", "block1", "qkv0", "block0", "model"]  # each parent after its children


def test_a_load_after_its_module_was_processed_reprocesses_it_and_its_ancestors(toy):
    late = shard(1, "q", 50.0, seed=2)
    toy.weights.load_tensors([*(shard(i, s) for i in range(2) for s in SHARDS), late])
    assert toy.log == ["qkv0", "block0", "qkv1", "block1", "model", "qkv1", "block1", "model"]
    assert toy.layers[1].qkv_proj.amax == toy.layers[1].qkv_proj.weight.abs().amax() > 50


def test_an_update_missing_a_load_fails_naming_it(toy):
    with pytest.raises(ValueError, match=r"layers.0.qkv_proj.weight \(has \['k', 'q'\], expects \['k', 'q', 'v'\]\)"):
        toy.weights.load_tensors([shard(0, "q"), shard(0, "k"), *(shard(1, s) for s in SHARDS)])


def test_a_hook_that_rebinds_a_derived_tensor_fails_on_reprocessing(toy, monkeypatch):
    def rebind(self):
        self.amax = self.weight.abs().amax()  # a new tensor: graphs would keep reading the old one

    monkeypatch.setattr(ScaledQKV, "process_weights_after_loading", rebind)
    with pytest.raises(RuntimeError, match="ScaledQKV.process_weights_after_loading rebound amax"):
        toy.weights.reprocess()


# --- the real model: the rotary table is a derived tensor --------------------------------------------------


def test_rotary_table_is_derived_after_loading_and_refreshed_in_place(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)
    model = MODELS[config.architecture](config)
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert isinstance(rotary, RotaryEmbedding) and rotary is model.model.layers[1].self_attn.rotary_emb
    weights = load_weights(model, tiny_model_dir)
    theta, scaling = rope_settings(config.raw)
    expected = rope_cos_sin_cache(config.head_dim, config.max_position_embeddings, theta, scaling=scaling)
    assert torch.equal(rotary.cos_sin_cache, expected)
    address = rotary.cos_sin_cache.data_ptr()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}

    rotary.cos_sin_cache.zero_()  # e.g. discarded by a deep sleep
    weights.reprocess()
    assert torch.equal(rotary.cos_sin_cache, expected) and rotary.cos_sin_cache.data_ptr() == address

    rotary.cos_sin_cache.zero_()
    from safetensors.torch import load_file

    tensors = sorted(load_file(tiny_model_dir / "model.safetensors").items(), reverse=True)
    weights.load_tensors([*tensors, tensors[0], tensors[-1]])  # reversed, two repeated
    assert torch.equal(rotary.cos_sin_cache, expected) and rotary.cos_sin_cache.data_ptr() == address
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name
