"""How the engine reports a failure: `describe_error` ('file:line: Type: message', the deepest frame of the project's
own code: the same text on every rank for the same failure), and the one way the server stops itself when it
cannot go on safely (ranks out of step, graphs that cannot be recaptured after a failed reload): `stop_server`
says why on stderr and exits at once with FATAL_EXIT_STATUS, which `tsdev watch` answers with a restart; the
other ranks exit with rank 0."""
import os
import sys
import traceback

FATAL_EXIT_STATUS = 70


def stop_server(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(FATAL_EXIT_STATUS)


def describe_error(exc: BaseException) -> str:
    """'file:line: Type: message', pointing at the deepest frame of the project's own code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" not in f.filename
              and not f.filename.startswith(sys.base_prefix)]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(exc).__name__}: {exc}"
