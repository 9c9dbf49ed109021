"""Pinned staging load: checkpoint byte ranges -> one page-locked host buffer -> the device, overlapped.

The plain path (safetensors' `get_tensor`, then `param.copy_`) reads each tensor with one thread into
pageable memory, which the driver copies again through its own small bounce buffer. Here, in four small
steps, each testable on its own:

* plan (`plan_chunks`): the tensors, in file order, packed into chunks of at most one slot (half the
  staging buffer); a tensor larger than a slot is split across chunks and reassembled on the device.
* read (`read_chunk`): several threads `preadv` 16 MiB blocks of a chunk's byte ranges straight into the
  host slot, through the page cache (so a second load of the same checkpoint reads memory, not disk).
* pin (`HostBuffer`): an anonymous mapping, pre-faulted from several threads (MADV_POPULATE_WRITE), then
  page-locked (`host_register`: cuMemHostRegister, or cudaHostRegister through torch), so copies from it
  are asynchronous DMA. Unregistered and unmapped after the load.
* copy (`StagedLoad`): two slots; while a side stream copies chunk i to the device and the loaders copy
  its tensors into the parameters, the threads read chunk i+1 into the other slot. Events order it: the host waits for a
  slot's previous upload before
  refilling it; the side stream waits for the loaders (current stream) to be done with the device slot
  before overwriting it; the current stream waits for the upload before the loaders read it.

The loaders get device tensors, views of a device slot that stay valid until the loader returns (copy
from them, keep no reference), so fused and sharded loads are device-to-device copies. Pinning that is
unavailable or fails raises `PinningUnavailable` before any tensor is produced; the loader then falls
back to the plain path.
"""
import ctypes
import mmap
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from tsdev_runtime.weights.checkpoint import TensorEntry, read_into

# Per slot (within the limit). Small slots start sooner: pre-faulting and registering 2 x 64 MiB took
# ~30 ms on the H200, 2 x 1 GiB ~430 ms; with reads cut to keep every thread busy, 64 MiB slots loaded the
# 16 GB 8B shape as fast as 128 or 256 MiB ones (~17 GB/s) and the 1.2 GB default model faster.
SLOT_BYTES = 64 << 20
ALIGN = 256  # each tensor starts at a multiple of this in a slot, so any dtype can view it
READ_BLOCK = 16 << 20  # the largest read task; a slot is cut into at least two per thread
READ_THREADS = min(8, os.cpu_count() or 1)
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23  # Linux; POPULATE_WRITE since 5.14 (older kernels: skipped)


class PinningUnavailable(RuntimeError):
    """Page-locking the staging buffer is not possible here; the load falls back to the plain path."""


@dataclass(frozen=True)
class Piece:
    """Bytes [start, start + nbytes) of one tensor, at offset `at` of a slot."""
    entry: TensorEntry
    start: int
    nbytes: int
    at: int

    @property
    def whole(self) -> bool:
        return self.nbytes == self.entry.nbytes


@dataclass
class Chunk:
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return max((p.at + p.nbytes for p in self.pieces), default=0)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_bytes_for(entries: list[TensorEntry], memory_limit: int) -> int:
    """Two slots within `memory_limit`, each at most SLOT_BYTES and no larger than the whole checkpoint."""
    if memory_limit < 2 * ALIGN:
        raise ValueError(f"--load-memory-limit {memory_limit} bytes leaves no room for a staging buffer: "
                         "give at least a few MiB (the default is 16GiB)")
    total = sum(_align(e.nbytes) for e in entries)
    return max(ALIGN, min(SLOT_BYTES, memory_limit // 2, total) // ALIGN * ALIGN)


def plan_chunks(entries: list[TensorEntry], slot_bytes: int) -> list[Chunk]:
    """Pack tensors, in order, into chunks of at most `slot_bytes`. A tensor that fits a slot is never split
    (it opens a new chunk when the current one is too full); a larger one fills whole chunks, and its
    tail shares the last with the tensors after it."""
    chunks, current = [], Chunk()
    for entry in entries:
        if entry.nbytes <= slot_bytes:
            at = _align(current.nbytes)
            if at + entry.nbytes > slot_bytes:
                chunks.append(current)
                current, at = Chunk(), 0
            current.pieces.append(Piece(entry, 0, entry.nbytes, at))
            continue
        for start in range(0, entry.nbytes, slot_bytes):
            if current.nbytes:
                chunks.append(current)
                current = Chunk()
            current.pieces.append(Piece(entry, start, min(slot_bytes, entry.nbytes - start), 0))
    if current.pieces:
        chunks.append(current)
    return chunks


def read_chunk(chunk: Chunk, host: memoryview, fds: dict, pool: ThreadPoolExecutor,
               block: int = READ_BLOCK) -> list[Future]:
    """Start reading every piece of `chunk` into `host` (a slot), in tasks of at most `block` bytes over the
    pool; wait for the returned futures before using the slot."""
    jobs = []
    for p in chunk.pieces:
        for b in range(0, p.nbytes, block):
            n = min(block, p.nbytes - b)
            jobs.append(pool.submit(read_into, fds[p.entry.path], host[p.at + b : p.at + b + n],
                                    p.entry.offset + p.start + b, f"{p.entry.path.name}: {p.entry.name}"))
    return jobs


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _madvise(addr: int, length: int, advice: int) -> bool:
    """madvise through ctypes, which releases the GIL (mmap.madvise does not), so threads fault in parallel."""
    return _libc is not None and _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0


def check_pinnable(device: torch.device) -> None:
    """Raise PinningUnavailable where page-locking cannot help: a CPU device is host memory already."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise PinningUnavailable(f"the device is {device}: there is nothing to pin for")


def host_register(ptr: int, nbytes: int) -> Callable[[], None]:
    """Page-lock [ptr, ptr + nbytes) for CUDA; returns the matching unregister.

    The driver API (cuda-bindings) is preferred: a failed cudaHostRegister also leaves the runtime's last
    error set, which torch's next kernel-launch check reports as its own failure (measured on the H200),
    so that path clears it."""
    try:
        from cuda.bindings import driver
    except ImportError:
        driver = None
    if driver is not None:
        err = driver.cuMemHostRegister(ptr, nbytes, 1)[0]  # CU_MEMHOSTREGISTER_PORTABLE; returns (CUresult,)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise PinningUnavailable(f"cuMemHostRegister of {nbytes / 2**20:.0f} MiB failed: {err.name}")
        return lambda: driver.cuMemHostUnregister(ptr)
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 1))  # cudaHostRegisterPortable
    if err:
        try:  # torch binds no cudaGetLastError: a kernel launch's check reads (and so clears) the error
            torch.zeros(1, device="cuda")
        except RuntimeError:
            pass
        raise PinningUnavailable(f"cudaHostRegister of {nbytes / 2**20:.0f} MiB failed with cudaError {err}")
    return lambda: cudart.cudaHostUnregister(ptr)


class HostBuffer:
    """Page-aligned host memory (an anonymous mapping): pre-faulted from several threads, then page-locked."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes)
        self.view = memoryview(self._map)  # what the readers fill
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # what the copies read
        self._unregister: Callable[[], None] | None = None

    def populate(self, pool: ThreadPoolExecutor, threads: int) -> None:
        """Fault every page in now, from `threads` threads, rather than one by one inside the register."""
        base, n = self.tensor.data_ptr(), self.nbytes
        _madvise(base, n, MADV_HUGEPAGE)  # best effort: fewer pages to fault and to lock
        per_thread = -(-n // threads)
        step = -(-per_thread // HUGE_PAGE) * HUGE_PAGE  # whole huge pages per thread
        list(pool.map(lambda a: _madvise(base + a, min(step, n - a), MADV_POPULATE_WRITE), range(0, n, step)))

    def pin(self) -> None:
        self._unregister = host_register(self.tensor.data_ptr(), self.nbytes)

    def close(self) -> None:
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        self.tensor = None
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a view is still referenced (e.g. by a traceback): unmapped when it goes
            pass


class StagedLoad:
    """One staged load of `entries` onto `device`: `with StagedLoad(...) as load: for name, tensor in load`.

    Setup (buffer, pre-fault, pin) happens in the constructor, so a PinningUnavailable comes before any
    tensor is produced. `pin=False` stages through unpinned memory (the CPU tests' path)."""

    def __init__(self, entries: list[TensorEntry], device: torch.device, memory_limit: int, pin: bool = True):
        begin = time.perf_counter()
        self.entries, self.device = entries, torch.device(device)
        if pin:
            check_pinnable(self.device)
        self.slot = slot_bytes_for(entries, memory_limit)
        self.block = min(READ_BLOCK, max(1 << 20, self.slot // (2 * READ_THREADS)))  # every thread busy
        self.chunks = plan_chunks(entries, self.slot)
        slots = max(1, min(2, len(self.chunks)))
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tsdev-load")
        self.host: HostBuffer | None = None
        try:
            self.device_slots = [torch.empty(self.slot, dtype=torch.uint8, device=self.device) for _ in range(slots)]
            self.host = HostBuffer(slots * self.slot)
            self.host.populate(self.pool, READ_THREADS)
            if pin:
                self.host.pin()
        except (OSError, torch.cuda.OutOfMemoryError) as exc:  # no room for the staging buffers
            self.close()
            raise PinningUnavailable(f"no room for {slots} x {self.slot / 2**20:.0f} MiB of staging buffers on the "
                                     f"host and the device: {exc}") from exc
        except BaseException:
            self.close()
            raise
        self.partial: dict[str, torch.Tensor] = {}  # tensors split over chunks, being reassembled
        self.setup_seconds = time.perf_counter() - begin
        self.read_wait = self.upload_wait = 0.0  # where the loading thread waited: the pipeline's bound

    def describe(self) -> str:
        size = f"{self.slot / 2**20:.0f} MiB" if self.slot >= 2**20 else f"{self.slot / 2**10:.0f} KiB"
        return (f"{len(self.device_slots)} x {size} staging, {len(self.chunks)} chunk(s), "
                f"{READ_THREADS} reader threads, setup {self.setup_seconds * 1e3:.0f} ms, waited on reads "
                f"{self.read_wait * 1e3:.0f} ms, on uploads {self.upload_wait * 1e3:.0f} ms")

    def __enter__(self) -> "StagedLoad":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)  # no reader may still write into the host buffer we unmap,
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # and no copy still read it
        if self.host is not None:
            self.host.close()
            self.host = None
        self.device_slots, self.partial = [], {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the device slots back: the KV pool is sized from free memory

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.uploaded: list[torch.cuda.Event | None] = [None] * len(self.device_slots)
        consumed = None  # current-stream event after the loaders of the last chunk
        fds = {path: os.open(path, os.O_RDONLY) for path in {e.path for e in self.entries}}
        reading: list[Future] = []
        try:
            reading = self._start_reading(0, fds)
            for i, chunk in enumerate(self.chunks):
                s = i % len(self.device_slots)
                self.read_wait += _wait_for(reading)
                self.uploaded[s] = self._upload(chunk, s, side, consumed)
                if i + 1 < len(self.chunks):  # read ahead while the loaders copy this chunk
                    reading = self._start_reading(i + 1, fds)
                yield from self._tensors(chunk, s)
                if side is not None:
                    consumed = torch.cuda.current_stream(self.device).record_event()
        finally:
            for job in reading:  # no reader may still use a descriptor we close
                job.cancel()
            wait(reading)
            for fd in fds.values():
                os.close(fd)

    def _start_reading(self, i: int, fds: dict) -> list[Future]:
        """Read chunk i into its host slot once that slot's previous upload is done."""
        s = i % len(self.device_slots)
        if self.uploaded[s] is not None:
            begin = time.perf_counter()
            self.uploaded[s].synchronize()
            self.upload_wait += time.perf_counter() - begin
        chunk = self.chunks[i]
        return read_chunk(chunk, self.host.view[s * self.slot : s * self.slot + chunk.nbytes], fds, self.pool,
                          self.block)

    def _upload(self, chunk: Chunk, s: int, side, consumed) -> "torch.cuda.Event | None":
        """Copy the host slot to the device slot and reassemble split tensors; on CUDA, on the side stream."""
        host = self.host.tensor[s * self.slot : s * self.slot + chunk.nbytes]
        dev = self.device_slots[s]
        for p in chunk.pieces:  # allocated on the current stream, which frees them after the loaders
            if not p.whole and p.start == 0:
                self.partial[p.entry.name] = torch.empty(p.entry.nbytes, dtype=torch.uint8, device=self.device)
        if side is None:
            self._fill(chunk, host, dev, non_blocking=False)
            return None
        if consumed is not None:
            side.wait_event(consumed)  # the loaders are done with this device slot (and with freed tensors)
        with torch.cuda.stream(side):
            self._fill(chunk, host, dev, non_blocking=True)
            event = side.record_event()
        torch.cuda.current_stream(self.device).wait_event(event)
        return event

    def _fill(self, chunk: Chunk, host: torch.Tensor, dev: torch.Tensor, non_blocking: bool) -> None:
        dev[: chunk.nbytes].copy_(host, non_blocking=non_blocking)
        for p in chunk.pieces:
            if not p.whole:
                self.partial[p.entry.name][p.start : p.start + p.nbytes].copy_(dev[p.at : p.at + p.nbytes])

    def _tensors(self, chunk: Chunk, s: int) -> Iterator[tuple[str, torch.Tensor]]:
        for p in chunk.pieces:
            if p.whole:
                data = self.device_slots[s][p.at : p.at + p.nbytes]
            elif p.start + p.nbytes == p.entry.nbytes:
                data = self.partial.pop(p.entry.name)
            else:
                continue
            yield p.entry.name, data.view(p.entry.dtype).view(p.entry.shape)


def _wait_for(jobs: list[Future]) -> float:
    """Wait for every job (raising the first failure); the seconds waited."""
    begin = time.perf_counter()
    for job in jobs:
        job.result()
    return time.perf_counter() - begin
