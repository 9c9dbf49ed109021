"""A restart's weights, handed from the server that stops to the standby that takes its place (`tsdev watch`),
instead of read from the checkpoint a second time: on a GPU through CUDA IPC (torch's multiprocessing reductions: the
receiver maps the sender's memory and copies it device to device), on the CPU through shared memory.

`ServerProcess(standby=True)` names one Unix socket (`ENV`) for the server it starts and for its standby:

* the server, once loaded, listens on it (`Listener`); as it stops for a restart (SIGTERM after tsdev watch wrote
  `restart_marker`, after the engine has stopped) it frees the KV pool and the graphs, then `offer`s every
  parameter and persistent buffer with the load's fingerprint to the standby once it connects, and waits for its
  answer before the process exits (the sender's memory is what the receiver maps: it must live until the copy is
  done). The tensors go packed into one buffer where the freed pool leaves room for it and the standby's copy
  (`pack`): one allocation for the receiver to map and one copy to make, where each tensor offered as itself costs a
  mapping of its allocation, an IPC event and a copy of its own;
* the standby connects when it is told to prepare (`connect`, then `receive`; a standby still importing when the
  restart came connects once it is done, and the stopping server waits for it), copies what it is offered into its
  own memory and answers; the start that follows (`take`) builds its model and copies the tensors
  in (`loader.adopt_weights`: the post-load hooks then derive the rest, as after a read) -- only when its own
  fingerprint is the sender's: the same checkpoint files (sizes, modification times), the same configuration of the
  weights, and the same source of every file that builds or fills a model (an edit of a layer's code since the
  sender loaded means a read from disk). Anything else -- no server listening, a crash, a timeout, a mismatch, too
  little memory for the copy -- and the start reads the checkpoint as before; the load line says which it was.
  One process only (no tensor-parallel ranks, no data-parallel replicas); weights the server updated in place
  (the update_weights routes) or slept away are not offered: the restart reads the checkpoint the user names.
"""
import contextlib
import hashlib
import io
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tsdev_runtime.control_protocol import WEIGHTS_HANDOVER_ENV, restart_marker

ENV = WEIGHTS_HANDOVER_ENV  # the socket's path, set by ServerProcess for a server and its standby
OFFER_WAIT_S = 10.0  # how long a stopping server waits for the standby to connect (it may still be importing), and
# then for its answer (the copy of every tensor)
RECEIVE_WAIT_S = 20.0  # how long a standby waits for the offer once connected (the old server's stop comes first)
# the files whose code builds a model or fills its tensors: an edit of one since the sender loaded means a read
WEIGHT_SOURCES = ("tsdev_runtime/models", "tsdev_runtime/layers", "tsdev_runtime/moe", "tsdev_runtime/weights",
                  "tsdev_kernels/ops/fp8.py", "tsdev_kernels/ops/fp8_block.py", "tsdev_kernels/ops/rope.py")
WEIGHT_CONFIG = ("model", "dtype", "quantization", "world_size", "device")

log = logging.getLogger("tsdev_runtime.startup")


def fingerprint(model_dir: Path, config) -> str:
    """What a load's values depend on: the checkpoint's files (names, sizes, modification times), the configuration
    of the weights, and the source of `WEIGHT_SOURCES`."""
    import tsdev_kernels
    import tsdev_runtime

    digest = hashlib.sha256(repr([(k, getattr(config, k, None)) for k in WEIGHT_CONFIG]).encode())
    for path in sorted(Path(model_dir).iterdir()):
        if path.suffix in (".safetensors", ".json"):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    roots = {"tsdev_runtime": Path(tsdev_runtime.__file__).parent, "tsdev_kernels": Path(tsdev_kernels.__file__).parent}
    for source in WEIGHT_SOURCES:
        package, _, rest = source.partition("/")
        path = roots[package] / rest
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(f"{file.relative_to(roots[package])}\n".encode() + file.read_bytes())
    return digest.hexdigest()


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("<Q", len(payload)) + payload)


def _recv(sock: socket.socket) -> bytes:
    size = struct.unpack("<Q", _recv_exactly(sock, 8))[0]
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the other side closed the hand-over")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _dumps(value) -> bytes:
    """`value` pickled with torch's reductions: a CUDA tensor as its IPC handle, a CPU one as shared memory (the
    file-system strategy: the receiver opens it by name; file descriptors would need a channel of their own)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(value)
    return buffer.getvalue()


PACK_ALIGN = 256  # bytes: where each packed tensor starts (a view of any dtype, aligned as an allocation is)
PACK_SLACK = 512 << 20  # bytes a GPU keeps free beyond the packed copy and the standby's


def pack(tensors: dict[str, torch.Tensor]) -> dict | None:
    """Every tensor's bytes copied into one uint8 buffer on their device, with where each lies; None where they are
    not all on one device or the GPU has no room for the packed copy and the standby's copy of it both (then each is
    offered as itself: the standby's copy alone must fit)."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        return None
    places, size = {}, 0
    for name, tensor in tensors.items():
        places[name] = (size, tensor.dtype, tuple(tensor.shape))
        size += -(-tensor.numel() * tensor.element_size() // PACK_ALIGN) * PACK_ALIGN
    device = devices.pop()
    if not room_for_two_copies(device, size):
        log.info("weights offered one by one: no room for a packed copy of %.1f GiB beside the standby's", size / 2**30)
        return None
    try:
        packed = torch.empty(size, dtype=torch.uint8, device=device)
        for name, tensor in tensors.items():
            _unpacked(packed, places[name]).copy_(tensor)
    except RuntimeError as exc:  # (torch.OutOfMemoryError above all)
        log.info("weights offered one by one: no packed copy (%s)", str(exc).splitlines()[0][:120])
        return None
    return {"packed": packed, "places": places}


def room_for_two_copies(device: torch.device, size: int) -> bool:
    """Whether `device` has `size` bytes free twice over (the packed copy here, the standby's of it), and some;
    a CPU is not asked."""
    return device.type != "cuda" or torch.cuda.mem_get_info(device)[0] >= 2 * size + PACK_SLACK


def _unpacked(packed: torch.Tensor, place: tuple) -> torch.Tensor:
    offset, dtype, shape = place
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return packed[offset:offset + nbytes].view(dtype).view(shape)


class Listener:
    """The socket a loaded server listens on (`ENV`) until it stops and offers its weights (`open`: None where the
    environment names none, or with more than one rank)."""

    def __init__(self, path: str):
        self.path = path
        for stale in (path, restart_marker(path)):  # what a process that died left
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1)

    @classmethod
    def open(cls, world_size: int) -> "Listener | None":
        path = os.environ.get(ENV)
        if not path or world_size != 1:
            return None
        try:
            return cls(path)
        except OSError as exc:
            log.info("no weight hand-over for a restart (%s: %s)", path, exc)
            return None

    def offer(self, tensors: dict[str, torch.Tensor], load_fingerprint: str, wait_s: float = OFFER_WAIT_S) -> str:
        """For a restart (tsdev watch wrote `restart_marker`: a standby is preparing), send `tensors` and the
        fingerprint to the standby once it connects and wait for its answer; what happened, in words. Not a restart
        (the watch quits, or the server was stopped otherwise): nothing waits."""
        self.sock.settimeout(wait_s)
        begin = time.perf_counter()
        try:
            if not self.restarting:
                return "not a restart"
            offer = pack(tensors) or {"tensors": tensors}  # (while the standby may still be connecting)
            packed = time.perf_counter()
            peer, _ = self.sock.accept()
        except OSError:
            return f"no standby connected within {wait_s:.0f} s"
        finally:
            self.close()
        connected = time.perf_counter()
        with peer:
            peer.settimeout(wait_s)
            try:
                _send(peer, _dumps({"fingerprint": load_fingerprint, **offer}))
                sent = time.perf_counter()
                answer = _recv(peer).decode()
            except (OSError, ConnectionError) as exc:
                return f"the standby did not answer ({type(exc).__name__})"
        # where this server's stop waited: for the standby to connect (still importing), to receive (still
        # re-importing what the save changed), to copy
        answered = time.perf_counter()
        return (f"{answer}; this server waited {answered - begin:.2f} s (packing {packed - begin:.2f}, the standby "
                f"connecting {connected - packed:.2f}, the offer sent {sent - connected:.2f}, its answer "
                f"{answered - sent:.2f})")

    @property
    def restarting(self) -> bool:
        """Whether tsdev watch stops this server for a restart (its `restart_marker` is there)."""
        return os.path.exists(restart_marker(self.path))

    def close(self) -> None:
        self.sock.close()
        for path in (self.path, restart_marker(self.path)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@dataclass
class Received:
    fingerprint: str  # the sender's load's (`fingerprint`)
    tensors: dict[str, torch.Tensor]  # this process's own copies
    seconds: float  # the copy's


def connect(path: str | None = None) -> socket.socket | None:
    """In a standby told to prepare, first (before the old server can reach its offer): a connection to the server
    about to stop, or None when none listens (no socket, or one a dead process left)."""
    path = path or os.environ.get(ENV)
    if not path or not os.path.exists(path):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def receive(sock: socket.socket | None, wait_s: float = RECEIVE_WAIT_S) -> Received | None:
    """The offer on `connect`'s connection: every tensor copied into this process's memory, and the answer sent;
    None when nothing came (the server stopped without offering, or after `wait_s`) or the copy did not fit."""
    if sock is None:
        return None
    with sock:
        sock.settimeout(wait_s)
        try:
            payload = _recv(sock)
            mapped = time.perf_counter()
            offered = _loads(payload)  # (on a GPU: the sender's memory mapped, a handle per allocation)
        except Exception as exc:  # noqa: BLE001  (closed, timed out, a handle this process cannot open): a read
            log.debug("no weights handed over: %s", exc)
            return None
        begin = time.perf_counter()  # (the copy's time, not the wait for the old server's stop)
        del payload
        load_fingerprint, copies = offered["fingerprint"], None
        try:
            if "packed" in offered:  # one copy, then a view per tensor
                packed = offered["packed"].clone()
                copies = {name: _unpacked(packed, place) for name, place in offered["places"].items()}
                how = f"one buffer of {packed.numel() / 2**20:.0f} MiB"
            else:
                copies = {name: tensor.clone() for name, tensor in offered["tensors"].items()}
                how = "one by one"
            for device in {t.device for t in copies.values() if t.is_cuda}:  # the weights' GPU, not this thread's
                torch.cuda.synchronize(device)
            answer = (f"{len(copies)} tensors copied by the standby in {time.perf_counter() - begin:.2f} s ({how}, "
                      f"mapped in {begin - mapped:.2f} s)")
        except Exception as exc:  # noqa: BLE001  (no room for a second copy, above all): the start reads instead
            copies = None
            answer = f"the standby could not copy them ({str(exc).splitlines()[0][:120]})"
        del offered
        with contextlib.suppress(OSError):
            _send(sock, answer.encode())
    return None if copies is None else Received(load_fingerprint, copies, time.perf_counter() - begin)


def _loads(payload: bytes) -> dict:
    import pickle

    import torch.multiprocessing  # noqa: F401  (its reductions, which rebuild the tensors)

    return pickle.loads(payload)


_held: Received | None = None


def hold(received: Received | None) -> None:
    """Keep what a standby received for the start that follows (`take`)."""
    global _held
    _held = received


def take(model_dir: Path, config) -> tuple[Received | None, str]:
    """What is held for this start, if its tensors are what a read of `model_dir` with `config` would give (the same
    fingerprint), and why not otherwise (for the load line); taken once."""
    global _held
    held, _held = _held, None
    if held is None:
        return None, ""
    if held.fingerprint != fingerprint(model_dir, config):
        return None, "the checkpoint, its configuration or the model's code changed since the server loaded it"
    return held, ""
