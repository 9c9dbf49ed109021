"""`tsdev profile` on the H200: two reloads' worth of ranges give two nsys reports and two kernel summaries."""
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from serve_process import copy_project
from tsdev.launch.child import free_port, project_pythonpath
from tsdev.profile import find_nsys

pytestmark = pytest.mark.gpu
STORE = "    return act * up\n"


def wait_for_line(log, text, proc, timeout=400):
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"tsdev profile exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no line {text!r}:\n{log.read_text()}"
        time.sleep(1)


def test_profile_takes_one_report_per_reload(tmp_path):
    assert find_nsys()[0], "nsys not found: source scripts/device-setup.sh (sets $NSYS)"
    project = copy_project(tmp_path / "project")
    out, port = tmp_path / "prof", free_port()
    env = {**os.environ, "PYTHONPATH": project_pythonpath(project)}
    log = tmp_path / "profile.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tsdev", "profile", "--out", str(out), "--ranges", "2",
                                 "--num-steps", "10", "--port", str(port), "--max-running", "16",
                                 "--cudagraph-capture-sizes", "1", "8", "16"], cwd=project, env=env,
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_for_line(log, "range reload-0 taken", proc)
        source = project / "kernels/tsdev_kernels/ops/activation.py"
        source.write_text(source.read_text().replace(STORE, "    return -act * up\n"))
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/rl/engine/reload_forward", json={"id": "p1"},
                           timeout=300).json()
        assert reply["ok"], reply
        assert proc.wait(timeout=400) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    for name in ("reload-0", "reload-1"):
        assert (out / f"{name}.nsys-rep").stat().st_size > 0
        summary = (out / f"{name}.summary.md").read_text()
        assert "_silu_and_mul_kernel" in summary and "_decode" in summary, summary
    assert "vs previous" in (out / "reload-1.summary.md").read_text()
    if keep := os.environ.get("TSDEV_KEEP_PROFILE"):  # to refresh the parser's fixture from a real report
        for csv in out.glob("reload-1_*.csv"):
            shutil.copy(csv, keep)
