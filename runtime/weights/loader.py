"""Load a Hugging Face safetensors checkpoint (single file or sharded) into a model.

`load_weights` reads the checkpoint's headers first, so a checkpoint that does not fit the model fails
before any data is read, naming what is missing, extra or mis-shaped. The data then arrives one way or
the other (`--load-format`):

* `pinned`: staged through a page-locked buffer by several reader threads and copied to the device
  asynchronously (`runtime/weights/pinned.py`); the loaders see device tensors, so fused loads are
  device-to-device copies. If pinning is not possible (a CPU device, a failed registration) it falls back
  to `plain` with one warning.
* `plain`: safetensors' own reader, one tensor at a time, copied into the parameter.
* `auto` (the default): `pinned` on CUDA, `plain` on CPU (where the device is host memory already).

Either way every parameter is bit-identical, and each module's post-load hook runs once its parameters
are complete (`runtime/weights/processing.py`). `load_tensors` loads into the existing parameters again
(a weight update) and reruns the hooks in place.

Under tensor parallelism the checkpoint still holds full tensors and every rank reads it: a module split over the
ranks says, per parameter (and shard), which slice of the full tensor this rank holds (`checkpoint_slice`, a
`layout.RankSlice`). The checkpoint is checked against the full shapes, each rank copies its slice only, and the
loads are counted in the elements this rank receives.
"""
import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from runtime.config import LOAD_FORMATS, EngineConfig
from runtime.weights import layout
from runtime.weights.checkpoint import TensorEntry, checkpoint_files, read_entries
from runtime.weights.pinned import PinningUnavailable, StagedLoad
from runtime.weights.processing import Counts, LoadSession


@dataclass(frozen=True)
class LoadReport:
    format: str  # what ran: pinned or plain
    nbytes: int
    seconds: float
    detail: str = ""  # the staging's shape and setup time, for pinned

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9

    def __str__(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return (f"{self.format}: {self.nbytes / 1e9:.2f} GB in {self.seconds:.2f} s, "
                f"{self.gb_per_s:.1f} GB/s{extra}")


def load_weights(model: nn.Module, model_dir: Path, load_format: str = EngineConfig.load_format,
                 memory_limit: int = EngineConfig.load_memory_limit) -> LoadReport:
    """Copy every checkpoint tensor into its parameter and run the post-load hooks. The first load records the
    checkpoint layout (`layout.py`) and refuses hooks that replaced a parameter; a later one (a weight update)
    expects every tensor in that layout (`prepare_update`)."""
    begin = time.perf_counter()
    entries = read_entries(checkpoint_files(model_dir))
    targets = _Targets(model)
    cold = layout.recorded_layout(model) is None
    before = layout.snapshot(model) if cold else None  # before any hook ran (LoadSession runs the ready ones)
    session = LoadSession(model, targets.expected_loads(entries, model_dir))
    device = next(model.parameters()).device
    ranges = targets.byte_ranges(entries)
    with _tensor_source(ranges, device, load_format, memory_limit) as (fmt, describe, tensors):
        for name, tensor in tensors:
            targets.load(name, tensor, session)
        session.finish()
        detail = describe()
    if cold:
        layout.record(model, before)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    read = sum(e.nbytes for e in (ranges if fmt == "pinned" else entries))
    return LoadReport(fmt, read, time.perf_counter() - begin, detail)


def check_checkpoint(model: nn.Module, model_dir: Path) -> None:
    """Raise (as `load_weights` would, before reading any data) unless `model_dir`'s checkpoint fits `model`."""
    _Targets(model).expected_loads(read_entries(checkpoint_files(model_dir)), model_dir)


def prepare_update(model: nn.Module, model_dir: Path) -> int:
    """A weight update's `begin`: check that `model_dir`'s checkpoint fits the model and that every tensor's
    storage can hold its cold-start checkpoint layout (raising before anything is touched), then view re-laid-out
    tensors back into that layout, in place. `load_weights` then writes in place and reruns the hooks into the same
    storage. Returns how many tensors were viewed back."""
    relaid = layout.check(model)
    _Targets(model).expected_loads(read_entries(checkpoint_files(model_dir)), model_dir)
    layout.view_back(relaid)
    return len(relaid)


def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-named tensors into `model`'s existing parameters, in any order, repeats allowed (a
    weight update); each module's hook reruns, into the same storage, once its parameters have every
    load they had at the first `load_weights`. Ends with an error if some did not get all of them."""
    targets, session = _Targets(model), LoadSession(model)
    for name, tensor in tensors:
        targets.load(name, tensor, session)
    session.finish()


@contextlib.contextmanager
def _tensor_source(entries: list[TensorEntry], device: torch.device, load_format: str, memory_limit: int):
    """(format used, what it did (called after the load), iterator of (checkpoint name, tensor)), falling back
    from pinned to plain."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r}: use {', '.join(LOAD_FORMATS)}")
    if load_format == "pinned" or (load_format == "auto" and device.type == "cuda"):
        try:
            staged = StagedLoad(entries, device, memory_limit)
        except PinningUnavailable as exc:
            print(f"warning: pinned weight loading is not possible ({exc}); loading with --load-format plain",
                  file=sys.stderr)
        else:
            with staged:
                yield "pinned", staged.describe, iter(staged)
            return
    yield "plain", str, _plain_tensors(entries)


def _plain_tensors(entries: list[TensorEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    files: dict[Path, list[str]] = {}
    for entry in entries:
        files.setdefault(entry.path, []).append(entry.name)
    for path, names in files.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


class _Targets:
    """Where each checkpoint tensor goes in one model (a `_Target`)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))  # tied names too
        self.canonical = {id(p): name for name, p in model.named_parameters()}
        self.packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self._resolved: dict[str, _Target | None] = {}  # each name is resolved three times per load

    def resolve(self, ckpt_name: str) -> "_Target | None":
        if ckpt_name not in self._resolved:
            self._resolved[ckpt_name] = self._resolve(ckpt_name)
        return self._resolved[ckpt_name]

    def _resolve(self, ckpt_name: str) -> "_Target | None":
        target, shard = _map_name(ckpt_name, self.packed)
        if target not in self.params:
            return None
        param = self.params[target]
        module_name, param_name = target.rsplit(".", 1)
        module = self.modules[module_name]
        split = getattr(module, "checkpoint_slice", None)
        return _Target(self.canonical[id(param)], param, module, shard, split(param_name, shard) if split else None)

    def expected_loads(self, entries: list[TensorEntry], model_dir: Path) -> Counts:
        """The loads each parameter gets from these tensors; fails naming what is mis-shaped, missing or extra."""
        counts: Counts = {}
        unexpected = []
        for entry in entries:
            target = self.resolve(entry.name)
            if target is None:
                unexpected.append(entry.name)
                continue
            part = target.part
            shape = part.shape if part else self.shape(target.name, target.param)
            if entry.shape != shape:
                raise ValueError(f"{entry.path.name}: {entry.name} has shape {entry.shape}, the model expects "
                                 f"{shape}: config.json and weights disagree")
            counts.setdefault(target.name, {})[target.shard] = part.numel if part else entry.numel
        missing = [f"{name}#{shard}" if shard else name for name, shards in self._needed().items()
                   for shard in shards if shard not in counts.get(name, {})]
        if missing:
            raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:5])}")
        if unexpected:
            raise ValueError(f"{model_dir}: checkpoint has {len(unexpected)} tensor(s) this model does not use, "
                             f"e.g. {', '.join(unexpected[:5])}: is config.json's architecture right?")
        return counts

    def shape(self, name: str, param: nn.Parameter) -> tuple[int, ...]:
        """The checkpoint shape: the recorded one (a hook may have re-laid the tensor out), else the current one."""
        recorded = layout.recorded_layout(self.model)
        return recorded.tensors[name].shape if recorded and name in recorded.tensors else tuple(param.shape)

    def _needed(self) -> dict[str, list[str | None]]:
        needed = {}
        for name in self.canonical.values():
            module = self.modules[name.rsplit(".", 1)[0]]
            needed[name] = list(module.shard_offsets) if hasattr(module, "shard_offsets") else [None]
        return needed

    def byte_ranges(self, entries: list[TensorEntry]) -> list[TensorEntry]:
        """What this rank reads of each tensor: under tensor parallelism, its rows where its slice is along the
        first dimension (one contiguous range of the file: q|k|v, gate|up, the vocabulary); whole tensors
        otherwise (o_proj's and down_proj's columns are strided: read whole, then narrowed)."""
        ranges = []
        for entry in entries:
            target = self.resolve(entry.name)
            part = target.part if target else None
            if part is None or part.dim != 0 or not entry.shape:
                ranges.append(entry)
                continue
            row = entry.nbytes // entry.shape[0]
            ranges.append(dataclasses.replace(entry, shape=part.local_shape, offset=entry.offset + part.start * row,
                                              nbytes=part.length * row))
        return ranges

    def load(self, ckpt_name: str, tensor: torch.Tensor, session: LoadSession) -> None:
        """Copy `tensor` (the checkpoint's whole tensor, or this rank's slice of it read alone) into place."""
        target = self.resolve(ckpt_name)
        if target is None:
            raise ValueError(f"{ckpt_name}: this model has no parameter for it")
        param, part = target.param, target.part
        shape = part.shape if part else tuple(param.shape)
        if part and tuple(tensor.shape) == part.local_shape and part.local_shape != part.shape:
            pass  # read as this rank's slice already
        elif tuple(tensor.shape) != shape:
            raise ValueError(f"{ckpt_name} has shape {tuple(tensor.shape)}, the model expects {shape}")
        elif part:
            tensor = part.of(tensor)
        if target.shard is not None:
            target.module.load_shard(target.shard, tensor)
        elif part:  # a padded vocabulary's last rows are not in the checkpoint: the slice may be shorter
            param.data.narrow(part.dim, 0, part.length).copy_(tensor)
        else:
            param.data.copy_(tensor)
        session.loaded(param, target.shard, tensor.numel())


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: the parameter (by its canonical name), its module, the shard of a fused
    parameter (None: the whole parameter), and this rank's slice of the tensor (None: all of it)."""
    name: str
    param: nn.Parameter
    module: nn.Module
    shard: str | None
    part: layout.RankSlice | None


def _map_name(name: str, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    for fragment, (merged, shard) in packed.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{merged}."), shard
    return name, None
