"""Start `tsdev serve` in a subprocess for tests, optionally from a temporary copy of the project."""
from contextlib import contextmanager
from pathlib import Path

from tsdev.launch.child import ServerProcess, copy_project  # noqa: F401 (the tests import it from here)


@contextmanager
def serve(args: list[str], log_path: Path, cwd: Path | None = None, timeout: float = 90):
    """Yield the base URL of a healthy `tsdev serve`; stop it afterwards. Code is imported from `cwd` if given. A
    test that fails inside prints the server's last lines (its report's captured output)."""
    with ServerProcess(args, cwd=cwd, pythonpath=cwd, log_path=log_path).running(timeout) as server:
        try:
            yield server.url
        except BaseException:
            print(f"--- the server's last lines ({log_path}):\n" + "\n".join(server.output().splitlines()[-60:]))
            raise
