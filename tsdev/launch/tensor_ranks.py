"""`tsdev serve --tp N`: the ranks other than 0 as child processes, and what each of them runs.

Rank 0 (the `tsdev serve` process) hosts HTTP and schedules; ranks 1..N-1 (`python -m tsdev.launch.tensor_ranks`)
each hold their shard of the model and follow rank 0 (`tsdev_runtime.engine.ranks`). They meet through torchrun's
environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK): `tsdev serve` sets it for the children it
starts, or torchrun / SLURM set it for every rank (then `tsdev serve` on a rank other than 0 follows instead of
serving).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading

from tsdev_runtime import distributed
from tsdev_runtime.config import EngineConfig
from tsdev.launch.child import die_with_parent, free_port

CONFIG_ENV = "TSDEV_RANK_CONFIG"  # the engine config and whether reloads are allowed, as JSON


def launched_rank() -> int | None:
    """This process's rank when a launcher (torchrun, SLURM through it) set RANK; None otherwise."""
    rank = os.environ.get(distributed.ENV_RANK)
    return int(rank) if rank is not None else None


@contextlib.contextmanager
def fail_fast(children: list[subprocess.Popen]):
    """While the ranks meet (the rendezvous waits minutes for a slow start): a rank that exits first ends this
    process at once, with the rank's status, instead of leaving rank 0 waiting for it."""
    joined = threading.Event()

    def watch() -> None:
        while not joined.wait(0.2):
            for rank, child in enumerate(children, start=1):
                if (status := child.poll()) is not None:
                    print(f"error: rank {rank} exited (status {status}) before the ranks met; its error is above. "
                          "The server stops.", file=sys.stderr, flush=True)
                    os._exit(2)

    threading.Thread(target=watch, daemon=True, name="rank-watch").start()
    try:
        yield
    finally:
        joined.set()


def start_ranks(config: EngineConfig, allow_reload_forward: bool) -> list[subprocess.Popen]:
    """Rank 0 of a fresh launch: point the ranks at this machine and start ranks 1..N-1."""
    os.environ.setdefault(distributed.ENV_MASTER_ADDR, "127.0.0.1")
    os.environ.setdefault(distributed.ENV_MASTER_PORT, str(free_port()))
    payload = json.dumps({"config": dataclasses.asdict(config), "allow_reload_forward": allow_reload_forward})
    children = []
    for rank in range(1, config.world_size):
        env = {**os.environ, distributed.ENV_RANK: str(rank), distributed.ENV_WORLD_SIZE: str(config.world_size),
               distributed.ENV_LOCAL_RANK: str(rank), CONFIG_ENV: payload}
        # Ctrl-C reaches rank 0 alone, which lets them go once the server has stopped; they die with it
        children.append(subprocess.Popen([sys.executable, "-m", "tsdev.launch.tensor_ranks"], env=env,
                                         preexec_fn=die_with_parent))
    return children


def stop_ranks(children: list[subprocess.Popen], timeout_s: float = 5.0) -> None:
    """After rank 0 let them go (or failed): wait for the children, then kill what is left."""
    for child in children:
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def follow(config: EngineConfig, allow_reload_forward: bool, rank: int) -> int:
    """A rank other than 0: join the others, load this rank's shard and follow rank 0 until it stops."""
    from tsdev_runtime.engine.llm_engine import serve_rank

    distributed.init(rank, config.world_size, config.device, config.rank_timeout_s)
    make_reloader = None
    if allow_reload_forward:
        from tsdev.hotreload import Reloader, default_packages

        def make_reloader():
            return Reloader(default_packages())
    try:
        serve_rank(config, make_reloader)
    except Exception as exc:  # rank 0 went away (it stopped or crashed), or this rank failed (rank 0 says why too)
        print(f"rank {rank} stops: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
              file=sys.stderr)
        return 1
    finally:
        distributed.shutdown()
    return 0


def main() -> int:
    payload = json.loads(os.environ[CONFIG_ENV])
    return follow(EngineConfig(**payload["config"]), payload["allow_reload_forward"], launched_rank())


if __name__ == "__main__":
    sys.exit(main())
