"""Load a Hugging Face safetensors checkpoint (single file or sharded) into a model."""
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{model_dir} has neither model.safetensors nor model.safetensors.index.json: "
        "pass a Hugging Face checkpoint directory with safetensors weights"
    )


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into its parameter; fail naming what is missing, extra or mis-shaped."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    expected = {name for name in params if not _is_tied(model, name)}
    for name, param in params.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if hasattr(module, "shard_offsets"):
            expected.discard(name)
            expected |= {f"{name}#{shard}" for shard in module.shard_offsets}
    loaded, unexpected = set(), []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for ckpt_name in f.keys():
                target, shard = _map_name(ckpt_name, packed)
                if target not in params:
                    unexpected.append(ckpt_name)
                    continue
                tensor = f.get_tensor(ckpt_name)
                param = params[target]
                if shard is not None:
                    model.get_submodule(target.rsplit(".", 1)[0]).load_shard(shard, tensor)
                    loaded.add(f"{target}#{shard}")
                    continue
                if param.shape != tensor.shape:
                    raise ValueError(f"{path.name}: {ckpt_name} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(param.shape)}: config.json and weights disagree")
                param.data.copy_(tensor)
                loaded.add(target)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:5])}")
    if unexpected:
        raise ValueError(f"{model_dir}: checkpoint has {len(unexpected)} tensor(s) this model does not use, "
                         f"e.g. {', '.join(unexpected[:5])}: is config.json's architecture right?")


def _map_name(name: str, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    for fragment, (merged, shard) in packed.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{merged}."), shard
    return name, None


def _is_tied(model: nn.Module, name: str) -> bool:
    if name != "lm_head.weight" or not hasattr(model, "lm_head"):
        return False
    return model.lm_head.weight is model.get_submodule("model.embed_tokens").weight
