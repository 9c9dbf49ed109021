"""On a GPU machine, tests/test_kernels_interpreter.py, test_mla_kernels.py and test_mla_decode.py cannot run in
pytest's process (their kernels are compiled for the GPU there): they run in a process that sees no GPU, so a plain
`pytest` checks every kernel against its reference on any machine. A CPU machine runs those files directly (this test
is for machines with a GPU only)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2])


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="without a GPU, pytest runs test_kernels_interpreter.py itself")
@pytest.mark.skipif(triton_version() < (3, 9), reason="Triton < 3.9's interpreter fails on NumPy 2 scalars (\"only "
                    "0-dimensional arrays can be converted\", seen with Triton 3.6 on the H200 image): there "
                    "`pytest -m gpu tests/test_kernels_gpu.py` checks the kernels")
@pytest.mark.timeout(900)
def test_a_gpu_machine_runs_the_interpreter_kernel_tests_in_a_process_that_sees_no_gpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
                           "tests/test_kernels_interpreter.py", "tests/test_mla_kernels.py",
                           "tests/test_mla_decode.py"],
                          cwd=Path(__file__).parent.parent, env=env,
                          capture_output=True, text=True, timeout=850)
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-4000:]
