"""`tsdev watch --no-tui` on the GPU with one kernel choice (TSDEV_KERNELS): save an edit of one line, then its
revert, and return the two reload lines (tests/test_gluon_watch_gpu.py, tests/test_cute_watch_gpu.py)."""
import os
import subprocess
import sys

from serve_process import copy_project
from test_watch_e2e import Output, edit
from tsdev.server_process import free_port, project_pythonpath


def edit_and_revert_under_watch(tiny_model_dir, tmp_path, kernels: str, path: str, line: str,
                                edited: str) -> tuple[str, str]:
    """(the reload line after saving `edited` in place of `line` in `path`, the one after saving `line` back)."""
    project = copy_project(tmp_path / "project")
    env = {**os.environ, "TSDEV_KERNELS": kernels,
           "PYTHONPATH": project_pythonpath(project)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsdev", "watch", str(tiny_model_dir), "--device", "cuda", "--max-model-len", "1024",
         "--port", str(free_port()), "--no-tui", "--server-log", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=project, env=env)
    out = Output(proc)
    try:
        out.next(r"golden completion: 24 tokens", timeout=300)
        lines = []
        for old, new in ((line, edited), (edited, line)):
            edit(project, path, old, new)
            lines.append(out.next(r"reload #\d+ (ok|FAILED).*", timeout=180).group(0))
            print(lines[-1])
        return lines[0], lines[1]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
