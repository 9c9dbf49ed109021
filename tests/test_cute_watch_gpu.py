"""The CuTe DSL silu_and_mul on the serving path (TSDEV_KERNELS=cute:activation) edited under `tsdev watch` on the
GPU: the edit reaches the served tokens, the reload line names the dialect, and the revert restores the golden
completion bit for bit. Needs the optional CuTe DSL package on the GPU machine (scripts/device-prep-cute.sh brings
its wheels in two halves); prints both reload lines (pause, save -> serving) for docs/results.md."""
import os
import re
import subprocess
import sys

import pytest

from serve_process import copy_project
from test_watch_e2e import Output, edit
from tsdev.server_process import free_port

pytestmark = pytest.mark.gpu
pytest.importorskip("cutlass.cute", reason="the optional CuTe DSL package (tsdev[cute]) is not installed")
KERNEL, LINE = "kernels/ops/activation_cute.py", "        out[row, col] = (act * up).to(out.element_type)\n"


def test_a_cute_kernel_edit_reaches_the_served_tokens_and_its_revert_restores_them(tiny_model_dir, tmp_path):
    project = copy_project(tmp_path / "project")
    env = {**os.environ, "TSDEV_KERNELS": "cute:activation",
           "PYTHONPATH": str(project) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsdev", "watch", str(tiny_model_dir), "--device", "cuda", "--max-model-len", "1024",
         "--port", str(free_port()), "--no-tui", "--server-log", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=project, env=env)
    out = Output(proc)
    try:
        out.next(r"golden completion: 24 tokens", timeout=300)
        edit(project, KERNEL, LINE, LINE.replace("(act * up)", "(act * up * 1.5)"))
        changed = out.next(r"reload #\d+ (ok|FAILED).*", timeout=180).group(0)
        print(changed)
        assert " ok " in changed and "golden: output changed at token" in changed, changed
        assert "cute" in changed and re.search(r"silu_and_mul_cute: err \S+ FAILED", changed), changed
        assert re.search(r"\| save → serving \d+\.\d\d s \|", changed) and re.search(r"\bpause \d+\.\d\d\b", changed)
        edit(project, KERNEL, LINE.replace("(act * up)", "(act * up * 1.5)"), LINE)
        reverted = out.next(r"reload #\d+ (ok|FAILED).*", timeout=180).group(0)
        print(reverted)
        assert " ok " in reverted and "golden: same 24 tokens" in reverted, reverted
        assert re.search(r"silu_and_mul_cute: err \S+ ok", reverted), reverted
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
