"""Every kernel on the decode path (and every Gluon kernel) compiles for the H200 (sm_90, through ptxas) on a machine
without a GPU: the interpreter runs the kernels' Python, not Triton's compiler, which refuses more (a name rebound to
another type inside an `if`, ops the interpreter lacks such as programmatic dependent launch's waits)."""
import pytest
import os
import subprocess
import sys
from pathlib import Path

from tsdev.launch.child import project_pythonpath

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_decode_path_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = project_pythonpath(ROOT, env.get("PYTHONPATH"))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "compile_kernels.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shared = {}
    for line in proc.stdout.splitlines():
        if line.startswith("compiled "):
            shared.setdefault(line.split()[1], set()).add(int(line.split()[3]))
    # each compile that ran succeeded (the exit status); the decode path's kernels were among them (a new one may join)
    assert {"_decode_kernel", "_gemv_kernel", "_gemv_norm_kernel", "_rope_kernel", "_store_kvcache_kernel",
            "_rms_norm_kernel", "_silu_and_mul_kernel", "_skinny_kernel", "_rms_norm_gluon_kernel"} <= set(shared)
    # the Gluon RMSNorm reduces each row within one warp: no shared memory, where Triton's sums across warps in it
    assert shared["_rms_norm_gluon_kernel"] == {0} and min(shared["_rms_norm_kernel"]) > 0
