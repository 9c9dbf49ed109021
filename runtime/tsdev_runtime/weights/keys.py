"""The weight-loading protocol: the module that owns a parameter declares which checkpoint tensors fill it.

Each checkpoint tensor fills one *key* of one parameter: `()` for a whole tensor, `("q",)` for the q rows of a
fused q|k|v weight, later `(3, "gate")` for expert 3's gate rows of a stacked expert weight. A module declares,
by checkpoint name, the (parameter, key) each tensor fills (`checkpoint_names`), which slice of that tensor this
tensor-parallel rank holds (`weight_slice`), and copies one key's tensor into its place (`load_weight`). A
parameter is complete when every key declared for it has arrived: the loader never counts elements, so a key may
arrive in any order, any number of times (a repeat replaces), and none can stand in for another.

A module that does not subclass `DeclaredLoading` (an RMSNorm) loads each of its parameters whole from the
checkpoint tensor of the same name, as `DeclaredLoading`'s defaults say.

Worked example, a fused q|k|v projection (`tsdev_runtime.layers.linear.MergedLinear`) at `model.layers.0.self_attn.
qkv_proj`: its names are relative to its parent, `model.layers.0.self_attn`, so it declares
`{"q_proj.weight": ("weight", ("q",)), "k_proj.weight": ("weight", ("k",)), "v_proj.weight": ("weight", ("v",))}`;
`weight_slice("weight", ("k",))` is this rank's rows of the checkpoint's k_proj weight; `load_weight` copies them
to where the k rows start in its weight. docs/runtime.md ("Loading weights") has the whole flow.
"""
import torch
from torch import nn

from tsdev_runtime.weights.layout import RankSlice

Key = tuple  # () a whole tensor; ("q",) a shard; (expert, "gate") an expert's shard


def key_text(key: Key) -> str:
    """How errors show a key: q, 3.gate; a whole tensor as 'whole'."""
    return ".".join(map(str, key)) or "whole"


class DeclaredLoading:
    """Mixin for an `nn.Module` whose parameters load from the checkpoint in another shape than one tensor each,
    or only in part on this rank. Override what differs; the defaults load each own parameter whole."""

    def checkpoint_names(self, attr: str) -> dict[str, tuple[str, Key]]:
        """Checkpoint name, relative to the parent module (this module is the parent's `attr`) -> (parameter,
        key) it fills."""
        return {f"{attr}.{name}" if attr else name: (name, ())
                for name, _ in nn.Module.named_parameters(self, recurse=False)}

    def weight_slice(self, param: str, key: Key) -> RankSlice | None:
        """This rank's part of the checkpoint tensor for (param, key); None: all of it."""
        return None

    def load_weight(self, param: str, key: Key, tensor: torch.Tensor) -> None:
        """Copy `tensor` (this rank's slice of the checkpoint tensor, already cut) into its place in `param`."""
        target = getattr(self, param).data
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{param}: expected shape {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}")
        target.copy_(tensor)


def declared(module: nn.Module) -> DeclaredLoading:
    """The protocol's methods for `module`: its own, or the defaults for a plain module."""
    return module if isinstance(module, DeclaredLoading) else _Plain(module)


class _Plain(DeclaredLoading):
    def __init__(self, module: nn.Module):
        self.module = module

    def checkpoint_names(self, attr: str) -> dict[str, tuple[str, Key]]:
        return DeclaredLoading.checkpoint_names(self.module, attr)

    def load_weight(self, param: str, key: Key, tensor: torch.Tensor) -> None:
        DeclaredLoading.load_weight(self.module, param, key, tensor)
