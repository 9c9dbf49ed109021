"""Load a Hugging Face safetensors checkpoint (single file or sharded) into a model.

`load_weights` reads the checkpoint's headers first, so a checkpoint that does not fit the model fails
before any data is read, naming what is missing, extra or mis-shaped. The data then arrives one way or
the other (`--load-format`):

* `pinned`: staged through a page-locked buffer by several reader threads and copied to the device
  asynchronously (`runtime/tsdev_runtime/weights/pinned.py`); the loaders see device tensors, so fused loads are
  device-to-device copies. If pinning is not possible (a CPU device, a failed registration) it falls back
  to `plain` with one warning.
* `plain`: safetensors' own reader, one tensor at a time, copied into the parameter.
* `auto` (the default): `pinned` on CUDA, `plain` on CPU (where the device is host memory already).

Either way every parameter is bit-identical, and each module's post-load hook runs once its parameters
have every key their modules declare (`runtime/tsdev_runtime/weights/keys.py`,
`runtime/tsdev_runtime/weights/processing.py`). The first load returns a `LoadedWeights`, and every later load (a weight
update from disk, streamed tensors, a rerun of the hooks) goes through it, into the same storage.

Under tensor parallelism the checkpoint still holds full tensors and every rank reads it: a module split over the
ranks says, per parameter and key, which slice of the full tensor this rank holds (`weight_slice`, a
`layout.RankSlice`). The checkpoint is checked against the full shapes and each rank copies its slice only.
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

from tsdev_runtime.config import LOAD_FORMATS, EngineConfig
from tsdev_runtime.weights import layout
from tsdev_runtime.weights.checkpoint import TensorEntry, checkpoint_files, read_entries
from tsdev_runtime.weights.pinned import PinningUnavailable, StagedLoad
from tsdev_runtime.weights.keys import DeclaredLoading, Key, declared
from tsdev_runtime.weights.processing import Keys, LoadSession


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
                 memory_limit: int = EngineConfig.load_memory_limit) -> "LoadedWeights":
    """The first load of `model`: copy every checkpoint tensor into its parameter, run the post-load hooks, and
    return what it recorded (`LoadedWeights`: later updates go through it). Refuses hooks that replaced a
    parameter (`layout.record`)."""
    targets = _Targets(model)
    before = layout.snapshot(model)  # before any hook ran (the session runs the ready ones at once)
    report = _load(targets, model_dir, load_format, memory_limit, reprocessing=False)
    targets.recorded = layout.record(model, before)
    return LoadedWeights(targets, report)


def adopt_weights(model: nn.Module, tensors: dict[str, torch.Tensor], seconds: float = 0.0) -> "LoadedWeights":
    """The first load of `model` from another process's tensors instead of a checkpoint (a restart's hand-over:
    runtime/tsdev_runtime/weights/handover.py): every parameter and persistent buffer (`layout.named_tensors`)
    copied in by name, then every post-load hook run, as after a read. ValueError, before anything is copied, unless
    the names, shapes and dtypes are the model's."""
    begin = time.perf_counter()
    targets = _Targets(model)
    before = layout.snapshot(model)
    own = layout.named_tensors(model)
    misfit = sorted(set(own) ^ set(tensors)) or [n for n, t in own.items()
                                                 if (t.shape, t.dtype) != (tensors[n].shape, tensors[n].dtype)]
    if misfit:
        raise ValueError(f"the handed-over tensors do not fit the model built now, e.g. {', '.join(misfit[:3])}")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(tensors[name])
    LoadSession(model, {}, reprocessing=False)  # every module complete: each hook runs, children first
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    targets.recorded = layout.record(model, before)
    nbytes = sum(t.numel() * t.element_size() for t in own.values())
    return LoadedWeights(targets, LoadReport("handed over", nbytes, seconds + time.perf_counter() - begin,
                                             "from the server this one replaces"))


def check_checkpoint(model: nn.Module, model_dir: Path) -> None:
    """Raise (as `load_weights` would, before reading any data) unless `model_dir`'s checkpoint fits `model`."""
    _Targets(model).check(read_entries(checkpoint_files(model_dir)), model_dir)


class LoadedWeights:
    """What a model's first load recorded, and the way to every later load into the same storage.

    It holds the checkpoint layout of every tensor before any hook ran (`layout`: what a direct update views
    re-laid-out tensors back to), the keys each parameter's module declared (`keys`: what every later load must
    bring, all of them), and the first load's `report`."""

    def __init__(self, targets: "_Targets", report: LoadReport):
        self.model, self._targets, self.report = targets.model, targets, report
        self.layout: layout.Layout = targets.recorded
        self.keys: Keys = targets.keys
        # what the values depend on (handover.fingerprint), for a restart's hand-over; None once updated in place
        self.fingerprint: str | None = None

    def load(self, model_dir: Path, load_format: str = EngineConfig.load_format,
             memory_limit: int = EngineConfig.load_memory_limit) -> LoadReport:
        """A weight update from disk: every tensor again, in place (after `prepare_update`), hooks rerun into the
        same storage."""
        return _load(self._targets, model_dir, load_format, memory_limit, reprocessing=True)

    def prepare_update(self, model_dir: Path) -> int:
        """A weight update's `begin`: check that `model_dir`'s checkpoint fits the model and that every tensor's
        storage can hold its cold-start checkpoint layout (raising before anything is touched), then view
        re-laid-out tensors back into that layout, in place. Returns how many tensors were viewed back."""
        relaid = layout.check(self.model, self.layout)
        self._targets.check(read_entries(checkpoint_files(model_dir)), model_dir)
        layout.view_back(relaid)
        return len(relaid)

    def load_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-named tensors into the existing parameters, in any order, repeats allowed (a streamed
        weight update); each module's hook reruns, into the same storage, once it has every declared key. Ends
        with an error if some parameter did not get all of them."""
        session = LoadSession(self.model, self.keys, reprocessing=True)
        for name, tensor in tensors:
            self._targets.load(name, tensor, session)
        session.finish()

    def reprocess(self) -> None:
        """Run every module's hook again, children first, into the same storage (after the weights changed
        outside the loader, or derived tensors were discarded)."""
        LoadSession(self.model, {}, reprocessing=True).finish()


def _load(targets: "_Targets", model_dir: Path, load_format: str, memory_limit: int, reprocessing: bool) -> LoadReport:
    begin = time.perf_counter()
    entries = [e for e in read_entries(checkpoint_files(model_dir)) if not targets.skips(e.name)]
    targets.check(entries, model_dir)
    session = LoadSession(targets.model, targets.keys, reprocessing)
    device = next(targets.model.parameters()).device
    ranges = targets.byte_ranges(entries)
    with _tensor_source(ranges, device, load_format, memory_limit) as (fmt, describe, tensors):
        for name, tensor in tensors:
            targets.load(name, tensor, session)
        session.finish()
        detail = describe()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    read = sum(e.nbytes for e in (ranges if fmt == "pinned" else entries))
    return LoadReport(fmt, read, time.perf_counter() - begin, detail)


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
    """Where each checkpoint tensor goes in one model (a `_Target`), from what its modules declare."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.recorded: layout.Layout | None = None  # the cold-start layout, once there is one
        canonical = {id(p): name for name, p in model.named_parameters()}
        self.index: dict[str, _Target] = {}
        self.keys: Keys = {}
        self.names: dict[tuple[str, Key], str] = {}  # (parameter, key) -> its checkpoint name, for errors
        for path, module in model.named_modules(remove_duplicate=False):  # tied and shared modules under each name
            parent, _, attr = path.rpartition(".")
            spec = declared(module)
            for name, (attr_name, key) in spec.checkpoint_names(attr).items():
                param = getattr(module, attr_name)
                canonical_name = canonical[id(param)]
                full = f"{parent}.{name}" if parent else name
                try:
                    part = spec.weight_slice(attr_name, key)
                except ValueError as exc:  # a rank's part this module cannot hold: say which module
                    raise ValueError(f"{full}: {exc}") from None
                self.index.setdefault(full, _Target(canonical_name, param, spec, attr_name, key, part))
                self.keys[canonical_name] = self.keys.get(canonical_name, frozenset()) | {key}
                self.names.setdefault((canonical_name, key), full)

    def skips(self, name: str) -> bool:
        """Whether the model leaves this checkpoint tensor unread (`skips_checkpoint_tensor`: DeepSeek-V3's
        multi-token-prediction layer)."""
        skips = getattr(self.model, "skips_checkpoint_tensor", None)
        return skips is not None and skips(name)

    def check(self, entries: list[TensorEntry], model_dir: Path) -> None:
        """Fail, naming them, on tensors that are mis-shaped, missing (a declared key no tensor brings) or extra."""
        provided, unexpected = set(), []
        for entry in entries:
            if self.skips(entry.name):
                continue
            target = self.index.get(entry.name)
            if target is None:
                unexpected.append(entry.name)
                continue
            shape = target.part.shape if target.part else self.shape(target)
            if entry.shape != shape:
                raise ValueError(f"{entry.path.name}: {entry.name} has shape {entry.shape}, the model expects "
                                 f"{shape}: config.json and weights disagree")
            provided.add((target.name, target.key))
        missing = [name for pair, name in self.names.items() if pair not in provided]
        if missing:
            raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:5])}")
        if scales := [name for name in unexpected if name.endswith(".weight_scale_inv")]:
            module = scales[0].removesuffix(".weight_scale_inv")
            raise ValueError(f"{model_dir}: the checkpoint stores {module} as block FP8 ({scales[0]}), a module tsdev "
                             "holds in the model's dtype: it serves the projections and the experts as block FP8, the "
                             "embeddings, norms, routers and lm_head unconverted. Serve the model's bf16 release, or "
                             "store that module unquantized.")
        if unexpected:
            raise ValueError(f"{model_dir}: checkpoint has {len(unexpected)} tensor(s) this model does not use, "
                             f"e.g. {', '.join(unexpected[:5])}: is config.json's architecture right?")

    def shape(self, target: "_Target") -> tuple[int, ...]:
        """The checkpoint shape of a whole parameter: the recorded one (a hook may have re-laid the tensor out),
        else the current one."""
        if self.recorded and target.name in self.recorded.tensors:
            return self.recorded.tensors[target.name].shape
        return tuple(target.param.shape)

    def byte_ranges(self, entries: list[TensorEntry]) -> list[TensorEntry]:
        """What this rank reads of each tensor: under tensor parallelism, its rows where its slice is along the
        first dimension (one contiguous range of the file: q|k|v, gate|up, the vocabulary); whole tensors
        otherwise (o_proj's and down_proj's columns are strided: read whole, then narrowed)."""
        ranges = []
        for entry in entries:
            target = self.index.get(entry.name)
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
        target = self.index.get(ckpt_name)
        if target is None and self.skips(ckpt_name):
            return
        if target is None:
            raise ValueError(f"{ckpt_name}: this model has no parameter for it")
        part = target.part
        shape = part.shape if part else self.shape(target)
        if part and tuple(tensor.shape) == part.local_shape and part.local_shape != part.shape:
            pass  # read as this rank's slice already
        elif tuple(tensor.shape) != shape:
            raise ValueError(f"{ckpt_name} has shape {tuple(tensor.shape)}, the model expects {shape}")
        elif part:
            tensor = part.of(tensor)
        target.module.load_weight(target.attr, target.key, tensor)
        session.loaded(target.param, target.key)


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: the parameter (by its canonical name), the module that declared it (its
    protocol methods) and the parameter's name there, the key it fills, and this rank's slice of the tensor
    (None: all of it)."""
    name: str
    param: nn.Parameter
    module: DeclaredLoading
    attr: str
    key: Key
    part: layout.RankSlice | None
