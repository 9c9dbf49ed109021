"""Ruff's checks hold over the project: pyflakes (rules F) -- a name a GPU-only branch uses but never imports fails
here, on the CPU, instead of first on the H200 (kernels/tsdev_kernels/ops/activation.py once called `use_cute`
without importing it) -- and lines of at most 120 characters (E501)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("tsdev", "runtime", "kernels", "tests", "benchmarks", "scripts")


def ruff_check(cwd: Path, *paths: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *paths]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_project_has_no_undefined_or_unused_names():
    result = ruff_check(ROOT, *CHECKED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_name_used_only_on_the_gpu_branch_and_never_imported_fails(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "ops.py").write_text("import torch\n\n\ndef op(x):\n    if x.is_cuda:\n"
                                     "        return use_cute(x)\n    return torch.relu(x)\n")
    result = ruff_check(tmp_path, "ops.py")
    assert result.returncode == 1 and "F821" in result.stdout and "use_cute" in result.stdout, result.stdout
