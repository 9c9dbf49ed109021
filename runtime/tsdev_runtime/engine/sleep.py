"""Sleep and wake (vLLM's semantics): give the device memory of the weights and the KV pool back, and take it again.

* level 1: the weights are copied to (pinned, on CUDA) host memory, then their device memory is freed; the KV
  pool is discarded. Waking copies them back: bit-identical, derived tensors included.
* level 2: the weights are discarded too. Waking re-materialises them (zeros) in place; they are not valid until
  a weight load (`reload_weights`) fills them and reruns the post-load hooks, which refill every derived tensor.

Memory is freed by resizing each tensor's *storage* to zero bytes and back (as FSDP does): every tensor object,
parameter and view (the attention layers' `k_cache`/`v_cache` views of the KV pool, shards of fused weights) stays
the same object and sees the new memory when it comes back. The addresses change, so the CUDA graphs cannot
survive: sleeping frees the decode and prefill graphs and their pools too, and waking recaptures them (once the
weights and the KV pool are both back). Recapturing takes about as long as at startup, and it keeps this module free
of CUDA virtual memory management; graphs captured after a wake read the new addresses, and from then on weight
loads write in place (no recapture).
"""
import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from tsdev_runtime.weights.layout import named_tensors

WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each distinct storage once (tied weights, views and shared modules share theirs), in first-seen order."""
    seen, storages = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            storages.append(storage)
    return storages


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (its dtype and shape too)."""
    # a copy: numpy() of the tensor itself would leave its storage not resizable (sleep resizes storages)
    data = t.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + data).hexdigest()


def weights_checksum(model: nn.Module, derived: bool = True) -> dict[str, str]:
    """name -> sha256 of every parameter and buffer, derived ones (rotary table, fp8 scales) included; with
    `derived=False` of the parameters and persistent buffers only (what a checkpoint fills)."""
    named = named_tensors(model, derived)
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:  # copies and sha256 release the GIL
        digests = pool.map(tensor_digest, [t for _, t in sorted(named.items())])
        return dict(zip(sorted(named), digests))


def overall_digest(checksums: dict[str, str]) -> str:
    """One sha256 over the sorted `name digest` lines."""
    return hashlib.sha256("".join(f"{n} {d}\n" for n, d in sorted(checksums.items())).encode()).hexdigest()


class _Freed:
    """Storages whose device memory is freed: their sizes, and a host copy when they must come back as they were."""

    def __init__(self, storages: list[torch.UntypedStorage], keep: bool):
        self.storages = storages
        self.sizes = [s.nbytes() for s in storages]
        self.backup: list[torch.UntypedStorage] | None = None
        if keep:
            pin = storages[0].device.type == "cuda" if storages else False
            self.backup = []
            for s in storages:
                host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
                host.copy_(s, non_blocking=pin)
                self.backup.append(host)
            if pin:
                torch.cuda.synchronize(storages[0].device)
        for s in storages:
            s.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def restore(self) -> None:
        """Give every storage its memory back: the saved bytes, else zeros."""
        for i, (s, n) in enumerate(zip(self.storages, self.sizes)):
            s.resize_(n)
            if self.backup is not None:
                s.copy_(self.backup[i], non_blocking=True)
            else:
                s.fill_(0)
        if self.storages and self.storages[0].device.type == "cuda":
            torch.cuda.synchronize(self.storages[0].device)
        self.backup = None


class SleepState:
    """What is asleep (`asleep`: tags whose memory is freed), at which level (whether the weights hold a load
    after a level-2 sleep: runtime/tsdev_runtime/engine/control.py)."""

    def __init__(self):
        self.level: int | None = None
        self.asleep: set[str] = set()
        self._freed: dict[str, _Freed] = {}

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)

    def sleep(self, level: int, weights: list[torch.Tensor], kv: list[torch.Tensor]) -> int:
        """Free the memory of `weights` (kept on the host at level 1) and `kv` (discarded): bytes freed."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: use 1 (weights kept in host memory) or 2 (weights discarded)")
        if self.sleeping:
            raise RuntimeError(f"already sleeping (level {self.level}): wake up first")
        self._freed[KV_CACHE] = _Freed(unique_storages(kv), keep=False)
        self._freed[WEIGHTS] = _Freed(unique_storages(weights), keep=level == 1)
        self.level, self.asleep = level, {WEIGHTS, KV_CACHE}
        return sum(f.nbytes for f in self._freed.values())

    def wake(self, tags: Iterable[str] | None = None) -> list[str]:
        """Give the memory of `tags` (default: all) back; the tags woken now."""
        tags = list(TAGS if tags is None else tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"unknown tag(s) {unknown}: use {', '.join(TAGS)}")
        woken = [t for t in TAGS if t in tags and t in self.asleep]
        for tag in woken:
            self._freed.pop(tag).restore()
            self.asleep.discard(tag)
        if not self.asleep:
            self.level = None
        return woken


def free_cached_memory(device: torch.device) -> None:
    """Return the caching allocator's free blocks (freed storages, graph pools) to the driver."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def device_free_bytes(device: torch.device) -> int | None:
    """Free device memory per cudaMemGetInfo; None off CUDA."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None

