"""The one way the server stops itself: when it cannot go on safely (ranks out of step, graphs that cannot be
recaptured after a failed reload). It says why on stderr and exits at once with FATAL_EXIT_STATUS, which
`tsdev watch` answers with a restart; the other ranks exit with rank 0."""
import os
import sys

FATAL_EXIT_STATUS = 70


def stop_server(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(FATAL_EXIT_STATUS)
