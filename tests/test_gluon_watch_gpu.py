"""A Gluon kernel on the serving path (TSDEV_KERNELS=gluon:norm) edited under `tsdev watch` on the GPU: the edit of
its `@gluon.jit` helper reaches the served tokens, the reload line names the dialect, and the revert restores the
golden completion bit for bit. Prints both reload lines (pause, save -> serving) for docs/results.md."""
import os
import re
import subprocess
import sys

import pytest

from serve_process import copy_project
from test_watch_e2e import Output, edit
from tsdev.server_process import free_port

pytestmark = pytest.mark.gpu
NORM, HELPER = "kernels/ops/norm.py", "    return w * (x * gl.expand_dims(rstd, 1)).to(dt).to(gl.float32)\n"


def test_a_gluon_kernel_edit_reaches_the_served_tokens_and_its_revert_restores_them(tiny_model_dir, tmp_path):
    project = copy_project(tmp_path / "project")
    env = {**os.environ, "TSDEV_KERNELS": "gluon:norm",
           "PYTHONPATH": str(project) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsdev", "watch", str(tiny_model_dir), "--device", "cuda", "--max-model-len", "1024",
         "--port", str(free_port()), "--no-tui", "--server-log", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=project, env=env)
    out = Output(proc)
    try:
        out.next(r"golden completion: 24 tokens", timeout=300)
        edit(project, NORM, HELPER, HELPER.replace("gl.expand_dims(rstd, 1))", "gl.expand_dims(rstd, 1) * 1.5)"))
        changed = out.next(r"reload #\d+ (ok|FAILED).*", timeout=180).group(0)
        print(changed)
        assert " ok " in changed and "golden: output changed at token" in changed, changed
        assert re.search(r"kernel\(s\) \(gluon \d+[,)]", changed), changed  # the dialect, named
        assert re.search(r"rms_norm_gluon: err \S+ FAILED", changed), changed  # its kernel check caught the edit
        assert re.search(r"\| save → serving \d+\.\d\d s \|", changed) and re.search(r"\bpause \d+\.\d\d\b", changed)
        edit(project, NORM, HELPER.replace("gl.expand_dims(rstd, 1))", "gl.expand_dims(rstd, 1) * 1.5)"), HELPER)
        reverted = out.next(r"reload #\d+ (ok|FAILED).*", timeout=180).group(0)
        print(reverted)
        assert " ok " in reverted and "golden: same 24 tokens" in reverted, reverted
        assert re.search(r"rms_norm_gluon: err \S+ ok", reverted), reverted
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
