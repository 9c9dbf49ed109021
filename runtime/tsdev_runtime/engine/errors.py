"""How the engine reports a failure: a request's (`EngineError` and kin, raised in its stream), `describe_error`
('file:line: Type: message', the deepest frame of the project's own code: the same text on every rank for the same
failure), and the one way the server stops itself when it
cannot go on safely (ranks out of step, graphs that cannot be recaptured after a failed reload): `stop_server`
says why on stderr and exits with FATAL_EXIT_STATUS, which `tsdev watch` answers with a restart; the other ranks
exit with rank 0."""
import os
import sys
import time
import traceback
from collections.abc import Callable


class EngineError(RuntimeError):
    """The engine failed while running a request; the request was aborted."""


class Unavailable(EngineError):
    """The server cannot serve now (sleeping, shutting down): the request was not started, or was aborted."""


class ShuttingDown(Unavailable):
    """The server is stopping: the request was not started."""


FATAL_EXIT_STATUS = 70
CHILDREN_REPORT_S = 1.0  # how long a stopping server waits for its ranks to say why they stop (they die with it)
# what a server stopping itself still removes (the API process's socket directory): os._exit runs no atexit
AT_FATAL_EXIT: list[Callable[[], None]] = []


def stop_server(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    for cleanup in AT_FATAL_EXIT:
        try:
            cleanup()
        except Exception:  # best effort: the exit goes on
            pass
    wait_for_children(CHILDREN_REPORT_S)
    os._exit(FATAL_EXIT_STATUS)


def wait_for_children(seconds: float) -> None:
    """Up to `seconds` for this process's children to exit: a rank whose collective with rank 0 just broke prints
    `rank N stops: ...` within milliseconds, and would otherwise be killed by rank 0's exit before it does (seen
    on a loaded 2-core machine). Returns at once without children."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return
        if pid == 0:
            time.sleep(0.01)


def describe_error(exc: BaseException) -> str:
    """'file:line: Type: message', pointing at the deepest frame of the project's own code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" not in f.filename
              and not f.filename.startswith(sys.base_prefix)]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(exc).__name__}: {exc}"
