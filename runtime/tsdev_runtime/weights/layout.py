"""The checkpoint layout of a model's tensors, recorded at cold start, and what a direct weight update needs of it.

At the first `load_weights` every parameter and persistent buffer is recorded as the checkpoint laid it out
(shape, stride, dtype, storage offset), before any post-load hook ran. A hook may derive into tensors of its own
or rewrite a tensor's values in place, but one that *replaces* a parameter object registered under a checkpoint
name is refused at cold start: a weight update loads into the objects (and the storage) the CUDA graphs
captured, so a replaced one would be loaded in vain.

A direct update (`begin`) checks, before anything is touched, that every tensor's storage can still hold its
recorded layout, and views any tensor that a hook re-laid out back to it, in the same storage: the loader then
writes in place and the hooks rerun into the same memory, so no address moves.

Under tensor parallelism every rank records its own tensors: the layouts are of this rank's slices (`RankSlice`),
while the checkpoint holds the full tensors.
"""
import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TensorLayout:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # storage offset, in elements

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorLayout":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.storage_offset())

    @property
    def nbytes_needed(self) -> int:
        """Bytes of storage this layout reaches (0 for an empty tensor)."""
        if math.prod(self.shape) == 0:
            return 0
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return (last + 1) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """name -> layout, and the tensor object registered under each name at cold start."""
    tensors: dict[str, TensorLayout]
    objects: dict[str, int]  # name -> id() of the parameter / buffer object


@dataclass(frozen=True)
class RankSlice:
    """The part of a checkpoint tensor of full `shape` that this tensor-parallel rank holds: `length` entries from
    `start` along `dim`. A module split over the ranks says it from `weight_slice(param, key)`; the loader
    checks the checkpoint against the full shape and copies only the slice."""
    shape: tuple[int, ...]
    dim: int
    start: int
    length: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape) // self.shape[self.dim] * self.length

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The slice's shape: `shape` with `length` along `dim`."""
        return (*self.shape[: self.dim], self.length, *self.shape[self.dim + 1 :])

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the checkpoint tensor (a view)."""
        return tensor.narrow(self.dim, self.start, self.length)


def block_part(part: RankSlice, block: int, what: str) -> RankSlice:
    """The blocks of FP8 scales that cover a rank's `part` of a tensor along `part.dim` (`block` entries each); a
    part that does not start and end on a block boundary (or the tensor's end) cannot be served: ValueError."""
    full = part.shape[part.dim]
    end = part.start + part.length
    if part.start % block or (end % block and end != full):
        raise ValueError(f"{what}: this rank's {part.length} of {full} starts at {part.start}, which splits a "
                         f"{block}-wide block of FP8 scales: serve with a --tp that divides the blocks evenly")
    blocks = -(-full // block)
    shape = tuple(blocks if d == part.dim else -(-size // block) for d, size in enumerate(part.shape))
    return RankSlice(shape, part.dim, part.start // block, -(-part.length // block))


def named_tensors(model: nn.Module, derived: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer (what a checkpoint may fill), by name; `derived`: every buffer too
    (rotary tables, fp8 scales: what sleep frees and the full checksum covers)."""
    named = dict(model.named_parameters())
    if derived:
        named.update(model.named_buffers())
        return named
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                named.setdefault(f"{module_name}.{name}" if module_name else name, buffer)
    return named


def snapshot(model: nn.Module) -> Layout:
    tensors = named_tensors(model)
    return Layout({n: TensorLayout.of(t) for n, t in tensors.items()}, {n: id(t) for n, t in tensors.items()})


def record(model: nn.Module, before: Layout) -> Layout:
    """After the cold-start load's hooks: refuse hooks that replaced a registered tensor, else return `before`
    (kept by the load's `LoadedWeights`)."""
    now = named_tensors(model)
    replaced = sorted(n for n, ident in before.objects.items() if n not in now or id(now[n]) != ident)
    if replaced:
        raise RuntimeError(
            f"post-load processing replaced {len(replaced)} parameter(s) or buffer(s) registered under a checkpoint "
            f"name: {', '.join(replaced[:8])}. Weight updates load into the objects (and memory) CUDA graphs captured: "
            "update in place instead (param.data.copy_(...), or derive into a buffer allocated at construction)")
    return before


class LayoutRefused(ValueError):
    """A direct update the model's storage cannot take (nothing was changed)."""


def check(model: nn.Module, layout: Layout) -> list[tuple[torch.Tensor, TensorLayout]]:
    """Whether every registered tensor's storage can hold its cold-start checkpoint `layout` again; raise
    LayoutRefused (nothing touched) if one cannot. Returns the tensors a hook re-laid out, to `view_back`."""
    now = named_tensors(model)
    problems, relaid = [], []
    for name, want in layout.tensors.items():
        t = now.get(name)
        if t is None or id(t) != layout.objects[name]:
            problems.append(f"{name} is no longer the tensor registered at startup")
        elif t.untyped_storage().nbytes() < want.nbytes_needed:
            problems.append(f"{name}'s storage holds {t.untyped_storage().nbytes()} bytes, its checkpoint layout "
                            f"needs {want.nbytes_needed}")
        elif TensorLayout.of(t) != want:
            relaid.append((t, want))
    if problems:
        raise LayoutRefused(f"{len(problems)} tensor(s) cannot take their checkpoint layout in place: "
                            f"{'; '.join(problems[:5])}: restart the server on the new checkpoint")
    return relaid


def view_back(relaid: list[tuple[torch.Tensor, TensorLayout]]) -> None:
    """View each re-laid-out tensor as its checkpoint layout, in the same storage (same address: the graphs'
    pointers stay valid)."""
    for t, want in relaid:
        t.data = torch.empty(0, dtype=want.dtype, device=t.device).set_(
            t.untyped_storage(), want.offset, want.shape, want.stride)
