"""Start `tsdev serve` in a subprocess for tests, optionally from a temporary copy of the project."""
import shutil
from contextlib import contextmanager
from pathlib import Path

from tsdev.server_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent


def copy_project(dest: Path) -> Path:
    """The packages and pyproject, so a test can edit sources without touching the checkout."""
    for name in ("runtime", "kernels", "tsdev"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


@contextmanager
def serve(args: list[str], log_path: Path, cwd: Path | None = None, timeout: float = 90):
    """Yield the base URL of a healthy `tsdev serve`; stop it afterwards. Code is imported from `cwd` if given."""
    with ServerProcess(args, cwd=cwd, pythonpath=cwd, log_path=log_path).running(timeout) as server:
        yield server.url
