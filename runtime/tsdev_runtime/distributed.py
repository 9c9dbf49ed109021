"""The ranks of one engine (tensor parallelism), on torch.distributed: NCCL between GPUs, gloo on the CPU (so
CI runs the same code with two processes). One process per rank; rank 0 hosts HTTP and schedules.

Three groups: the default one carries the model's collectives (on the device: NCCL on CUDA, gloo on the CPU);
`calls`, gloo without a practical timeout, carries rank 0's messages to the others (each step's batch, reload
sources, calls: a rank waits there as long as the server is idle); `control`, gloo with the timeout, carries
the outcomes and agreements (`gather`, `agree`: a MIN over success flags), so a rank that fails or hangs in a
call is seen within that timeout rather than the NCCL watchdog's.

Nothing here is initialised in a single-process engine: `size()` is 1, `rank()` 0, and every collective is
the identity, so the model code calls them unconditionally.
"""
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# torchrun's variables; `tsdev serve --tp N` sets them for the ranks it spawns
ENV_RANK, ENV_WORLD_SIZE, ENV_LOCAL_RANK = "RANK", "WORLD_SIZE", "LOCAL_RANK"
ENV_MASTER_ADDR, ENV_MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
DEFAULT_TIMEOUT_S = 60.0
RENDEZVOUS_TIMEOUT_S = 600.0  # how long the ranks wait for each other to start
IDLE_TIMEOUT = timedelta(days=365)  # a follower waits for rank 0's next call as long as the server is idle


@dataclass
class _State:
    control: "dist.ProcessGroup | None" = None
    calls: "dist.ProcessGroup | None" = None
    timeout_s: float = DEFAULT_TIMEOUT_S


_state = _State()


def initialized() -> bool:
    """Whether the engine runs as ranks of a process group: then every collective runs, even with one rank (how
    the distributed path is measured against the plain one on a single GPU). `tsdev serve --tp 1` forms none."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def size() -> int:
    return dist.get_world_size() if initialized() else 1


def init(rank: int, world_size: int, device: torch.device | str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the engine's ranks (MASTER_ADDR / MASTER_PORT from the environment, as torchrun sets them). On CUDA
    each rank takes the GPU of its local rank (LOCAL_RANK, default `rank`)."""
    device = torch.device(device)
    for name in (ENV_MASTER_ADDR, ENV_MASTER_PORT):
        if name not in os.environ:
            raise RuntimeError(f"tensor parallelism needs {name} in the environment (as torchrun sets it); "
                               f"`tsdev serve --tp N` sets it for the ranks it starts")
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get(ENV_LOCAL_RANK, rank)))
        backend = "nccl"
    timeout = timedelta(seconds=timeout_s)
    # the rendezvous waits generously for the other ranks to start (a loaded machine imports torch and loads the
    # model slowly); `timeout_s` (--rank-timeout) governs the calls after it
    store = dist.TCPStore(os.environ[ENV_MASTER_ADDR], int(os.environ[ENV_MASTER_PORT]), world_size,
                          is_master=rank == 0, timeout=timedelta(seconds=max(RENDEZVOUS_TIMEOUT_S, timeout_s)))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _state.control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    _state.calls = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _state.timeout_s = timeout_s


def timeout_s() -> float:
    """How long a rank waits for the others' outcome of a call (`init`'s timeout)."""
    return _state.timeout_s


def shutdown() -> None:
    if initialized():
        dist.destroy_process_group()
    _state.control = _state.calls = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (the row-parallel projections' partial sums); returns it."""
    if initialized():
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension, in rank order (vocab-parallel logits)."""
    if not initialized():
        return x
    n = size()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast(obj=None):
    """Rank 0's `obj` on every rank (pickled over the calls group: the others wait for it without a timeout)."""
    if not initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_state.calls)
    return box[0]


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (the reply's per-rank reports)."""
    if not initialized():
        return [obj]
    out = [None] * size()
    dist.all_gather_object(out, obj, group=_state.control)
    return out


def agree(ok: bool) -> bool:
    """True when every rank says ok (a MIN over the control group); a single rank decides alone."""
    if not initialized():
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_state.control)
    return bool(flag.item())


def minimum(n: int) -> int:
    """The smallest of the ranks' `n` (e.g. the KV pages each rank's free memory allows: all must hold as many)."""
    if not initialized():
        return n
    value = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=_state.control)
    return int(value.item())


def shard(n: int, what: str) -> tuple[int, int]:
    """(start, length) of this rank's part of `n` things split evenly; `n` must divide by the ranks."""
    tp = size()
    if n % tp:
        raise ValueError(f"{what} ({n}) does not divide by the tensor-parallel size {tp}: choose a --tp that "
                         f"divides it")
    return rank() * (n // tp), n // tp


def shard_kv_heads(n: int) -> tuple[int, int]:
    """(first, count) of this rank's key/value heads. Split like the query heads when there are at least as many
    as ranks; fewer (Qwen2.5-1.5B's 2 under --tp 4) are replicated: each head on size()/n consecutive ranks, the
    ranks whose query heads attend with it (vLLM's rule), so the KV pool holds one head per rank."""
    tp = size()
    if n >= tp:
        return shard(n, "the key/value heads")
    if tp % n:
        raise ValueError(f"the key/value heads ({n}) does not divide by the tensor-parallel size {tp}, nor divide "
                         f"it (to be replicated): choose a --tp that divides them or that they divide")
    return rank() * n // tp, 1
