"""Hugging Face's `kernels` package (a dependency of transformers from 5.25) has the top-level name of this
project's kernels; where it comes first on sys.path, importing the runtime says so instead of failing later."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_import(tmp_path: Path, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    return subprocess.run([sys.executable, "-c", "import runtime.engine.llm_engine"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_foreign_kernels_package_first_on_the_path_is_named_at_import(tmp_path):
    (tmp_path / "other" / "kernels").mkdir(parents=True)
    (tmp_path / "other" / "kernels" / "__init__.py").write_text("class CUDAProperties: ...\n")
    shadowed = run_import(tmp_path, [tmp_path / "other", ROOT])
    assert shadowed.returncode != 0
    assert "Hugging Face's `kernels` package" in shadowed.stderr and str(tmp_path / "other" / "kernels") in shadowed.stderr
    ours_first = run_import(tmp_path, [ROOT, tmp_path / "other"])
    assert ours_first.returncode == 0, ours_first.stderr
