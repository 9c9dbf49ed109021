"""Start `tsdev serve` in a subprocess for tests, optionally from a temporary copy of the project."""
import os
import shutil
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from tsdev.client import wait_until_healthy

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_project(dest: Path) -> Path:
    """The packages and pyproject, so a test can edit sources without touching the checkout."""
    for name in ("runtime", "kernels", "tsdev"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


@contextmanager
def serve(args: list[str], log_path: Path, cwd: Path | None = None, timeout: float = 90):
    """Yield the base URL of a healthy `tsdev serve`; stop it afterwards. Code is imported from `cwd` if given."""
    port = free_port()
    env = os.environ.copy()
    if cwd is not None:
        env["PYTHONPATH"] = str(cwd) + os.pathsep + env.get("PYTHONPATH", "")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tsdev", "serve", *args, "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, proc, timeout, log=log_path.read_text)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
