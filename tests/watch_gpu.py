"""`tsdev watch --no-tui` on the GPU with one kernel choice (TSDEV_KERNELS): save an edit of one line, then its
revert, and return the two reload lines (tests/test_gluon_watch_gpu.py, tests/test_cute_watch_gpu.py)."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from serve_process import copy_project
from test_watch_e2e import Output, edit
from tsdev.launch.child import free_port, project_pythonpath


ROOT = Path(__file__).resolve().parents[1]


def line_in_function(path: str, function: str, pattern: str) -> str:
    """The one line of `function`'s body in `path` (relative to the checkout) that matches `pattern`, newline
    included: found by the function's name and what the line does, so that a refactor elsewhere in the file does
    not move the edit. Fails naming both when the function is gone or the pattern matches no line or several."""
    source = (ROOT / path).read_text()
    found = [node for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.FunctionDef) and node.name == function]
    assert len(found) == 1, f"{path} has {len(found)} function(s) named {function}: update this test's anchor"
    body = source.splitlines(keepends=True)[found[0].lineno - 1:found[0].end_lineno]
    lines = [line for line in body if re.search(pattern, line)]
    assert len(lines) == 1, (f"{len(lines)} line(s) of {path}:{function} match {pattern!r} (one expected): update "
                             f"this test's anchor to the line that now does that")
    return lines[0]


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
