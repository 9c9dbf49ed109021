"""Run a function on N gloo ranks, each in its own spawned process (the CPU stand-in for N GPUs)."""
import multiprocessing
import os
import traceback

from tsdev.server_process import free_port


def _rank_main(fn, rank: int, world_size: int, port: int, args: tuple, results, device: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tsdev_runtime import distributed

    try:
        distributed.init(rank, world_size, device, timeout_s=60)
        results.put((rank, "ok", fn(*args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        distributed.shutdown()


def run_ranks(fn, world_size: int = 2, *args, timeout: float = 180, device: str = "cpu") -> list:
    """fn(*args) on every rank (an importable, module-level function); its results in rank order. A rank's
    exception fails the caller with that rank's traceback. `device` cuda: one GPU per rank, over NCCL."""
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results, device)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        outcome = {}
        for _ in procs:
            rank, status, value = results.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            outcome[rank] = value
        return [outcome[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
