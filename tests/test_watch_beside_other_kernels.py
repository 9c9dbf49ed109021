"""`tsdev watch` where other packages named `kernels` and `runtime` come first on the path (Hugging Face's `kernels`,
which transformers >= 5.25 installs, is one): it watches its own packages, by their absolute folders, its server
imports that same copy, and a saved kernel edit reloads and changes the served tokens. Run from a folder outside
the project (the project found on the path), and from a copy of the project that is not the installed one."""
import os
import subprocess
import sys

import pytest

from serve_process import copy_project
from test_watch_e2e import Output, edit
from tsdev.launch.child import free_port, project_pythonpath

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)

KERNEL, KERNEL_LINE = "kernels/tsdev_kernels/ops/activation.py", "    return F.silu(gate) * up\n"


@pytest.mark.parametrize("where", ["outside the project", "in a copy of the project"])
def test_watch_reloads_a_kernel_edit_of_the_copy_it_watches_past_other_kernels_and_runtime_packages(
        tmp_path, tiny_model_dir, where):
    project = copy_project(tmp_path / "project")
    elsewhere = tmp_path / "elsewhere"
    for name in ("kernels", "runtime"):  # what an unrelated install looks like: a plain package of that name
        (elsewhere / name / "ops").mkdir(parents=True)
        (elsewhere / name / "__init__.py").write_text(f'"""An unrelated package named {name}."""\n')
        (elsewhere / name / "ops" / "__init__.py").write_text("")
    if where == "outside the project":
        cwd, path = elsewhere, os.pathsep.join([str(elsewhere), project_pythonpath(project)])
    else:  # the installed tsdev_* packages are the checkout's: the server must import the copy all the same
        cwd, path = project, str(elsewhere)
    env = {**os.environ, "PYTHONPATH": path}
    assert subprocess.run([sys.executable, "-c", "import kernels, runtime; print(kernels.__file__, runtime.__file__)"],
                          cwd=cwd, env=env, capture_output=True, text=True).stdout.count(str(elsewhere)) == 2
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsdev", "watch", str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024",
         "--cudagraph-capture-sizes", "1", "4", "--port", str(free_port()), "--no-tui", "--probe-batch", "4",
         "--probe-steps", "16", "--server-log", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
    out = Output(proc)
    try:
        watching = out.next(r"watching (\S+), (\S+) \(reloadable", timeout=120)
        assert {watching.group(1), watching.group(2)} == {f"{project / 'kernels' / 'tsdev_kernels'}/",
                                                          f"{project / 'runtime' / 'tsdev_runtime'}/"}
        edit(project, KERNEL, KERNEL_LINE, KERNEL_LINE.replace("* up\n", "* up * 3\n"))
        line = out.next(r"reload #\d+ (ok|FAILED).*").group(0)
        assert "reload #1 ok" in line and "tsdev_kernels.ops.activation" in line, line
        assert "golden: output changed at token" in line, line
    finally:
        proc.kill()
        proc.wait()
