"""Run a function on N gloo ranks, each in a process of its own (the CPU stand-in for N GPUs)."""
import multiprocessing
import os
import time
import traceback

from tsdev.launch.child import free_port


def _rank_main(fn, rank: int, world_size: int, port: int, args: tuple, results, device: str, start_after: float,
               rank_timeout_s: float, environ: dict) -> None:
    time.sleep(start_after)
    os.environ.clear()
    os.environ.update(environ)  # the caller's, as at the call (the fork server's is as when it started)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tsdev_runtime import distributed

    try:
        distributed.init(rank, world_size, device, timeout_s=rank_timeout_s)
        results.put((rank, "ok", fn(*args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        distributed.shutdown()


def rank_processes():
    """Ranks fork from a server process that imported torch, Triton and pydantic once (per test process): a rank
    starts in half a second instead of importing them again as a spawned one does (~3 s a rank on CI's two cores).
    None of the project is imported there: its kernels read TRITON_INTERPRET when they are defined, which a rank sets
    for itself."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "triton", "triton.experimental.gluon", "pydantic"])
    return ctx


def run_ranks(fn, world_size: int = 2, *args, timeout: float = 180, device: str = "cpu",
              start_after: tuple[float, ...] = (), rank_timeout_s: float = 60) -> list:
    """fn(*args) on every rank (an importable, module-level function); its results in rank order. A rank's
    exception fails the caller with that rank's traceback. `device` cuda: one GPU per rank, over NCCL.
    `start_after`: seconds each rank waits before it joins (a slow start); `rank_timeout_s`: --rank-timeout."""
    ctx = rank_processes()
    results, port = ctx.Queue(), free_port()
    delays = [*start_after, *[0.0] * world_size][:world_size]
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results, device, delays[r],
                                                  rank_timeout_s, dict(os.environ))) for r in range(world_size)]
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


def on_rank0_engine(config, inspect):
    """In a rank process: rank 0 builds an engine of `config` and returns `inspect(engine)` (then closes it); every
    other rank follows that engine (`serve_rank`) and returns None."""
    from tsdev_runtime import distributed
    from tsdev_runtime.engine.llm_engine import LLMEngine, serve_rank

    if distributed.rank() != 0:
        serve_rank(config)
        return None
    engine = LLMEngine(config)
    try:
        return inspect(engine)
    finally:
        engine.control.close()
