"""A `tsdev serve` started ahead of need: the interpreter up and the heavy libraries imported (torch, Triton, the HTTP
stack), waiting for its arguments on stdin. `ServerProcess` keeps one beside a running server (`standby=True`, as
`tsdev watch` does) and hands it the next start, so a restart pays neither the interpreter nor those imports.

It imports nothing of the runtime or the CLI until the restart begins (only the constants it shares with
tsdev/launch/child.py): the edit that made the restart necessary (an engine file, say) is read from disk then. A
`prepare` line (sent as the old server is told to stop) imports the CLI and the runtime while the old server stops;
the arguments follow once it has exited (the GPU and the port are free). It allocates no GPU memory and, like a
server, dies with its parent. An empty stdin (the parent closed it or died) ends it quietly. On a GPU it creates its
CUDA context as it starts (TSDEV_STANDBY_DEVICE: the device the next start serves on), so that the start's load pays
none of it; the standby is started once the running server's checks are done, never beside them.

    python -m tsdev.launch.standby   # then one line on stdin: the JSON list of `tsdev` arguments, e.g. ["serve", ...]
                                     # (optionally after a line `prepare`)
"""
import json
import os
import sys
import time

from tsdev.launch.child import DEVICE_ENV, HANDED_OVER_ENV, PREPARE, warm_triton_key


def prepare() -> None:
    """Import the CLI and the runtime as they are on disk now (after the save that restarts the server), while the
    old server stops: the start then pays neither. An error is left to the start, which imports again and reports
    it as any start does."""
    try:
        import tsdev_runtime.engine.llm_engine  # noqa: F401
        import tsdev_runtime.server.app  # noqa: F401
        import tsdev.cli  # noqa: F401
    except BaseException:  # noqa: BLE001  (SystemExit included: the start reports it)
        pass


def init_cuda(device: str) -> bool:
    """The CUDA context, made now (a few hundred MB of the GPU's memory beside the running server): a start's `load`
    included it (0.5-1 s on the H200). Nothing on the CPU or without a GPU. False when it cannot be made now (a GPU
    in exclusive-process mode, held by the running server): torch keeps that error, so this process could not serve;
    it ends, and the restart is an ordinary start."""
    import torch

    if device.startswith("cpu") or not torch.cuda.is_available():
        return True
    try:
        torch.zeros(1, device=device or "cuda")
    except RuntimeError:
        return False
    return True


def main() -> int:
    import fastapi  # noqa: F401  what every start imports first, and the slow part of it
    import httpx  # noqa: F401  the CLI's, the server's and the chat template's libraries, not the project's
    import jinja2.sandbox  # noqa: F401
    import prometheus_client  # noqa: F401
    import rich.console  # noqa: F401
    import safetensors.torch  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import typer  # noqa: F401
    import uvicorn  # noqa: F401

    try:
        import triton  # noqa: F401
    except ImportError:  # a platform without it: the server says what it needs
        pass
    if (device := os.environ.get(DEVICE_ENV)) is not None and not init_cuda(device):
        return 0
    if device is not None and not device.startswith("cpu") and torch.cuda.is_available() and "triton" in sys.modules:
        warm_triton_key()
    line = sys.stdin.readline()
    if line.strip() == PREPARE:
        prepare()
        line = sys.stdin.readline()
    if not line.strip():
        return 0
    os.environ[HANDED_OVER_ENV] = repr(time.time())  # the server's startup line counts from here, not the wait
    from tsdev.cli import app

    app(args=json.loads(line), prog_name="tsdev")
    return 0


if __name__ == "__main__":
    sys.exit(main())
