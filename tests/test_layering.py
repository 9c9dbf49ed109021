"""The floors of DESIGN.md ("Layering") hold: `lint-imports` keeps every contract in pyproject.toml."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tsdev", "runtime", "kernels")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """import-linter's `lint-imports`, from this interpreter's environment, on the project in `cwd`."""
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
               "--no-cache"]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_imports_keep_every_layering_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout, result.stdout


def test_a_runtime_module_that_imports_the_toolkit_breaks_the_contracts(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    context = tmp_path / "runtime" / "context.py"
    context.write_text(context.read_text() + "\nimport tsdev.client\n")
    result = lint_imports(tmp_path)  # the copy in cwd comes first on sys.path, before the installed project
    assert result.returncode != 0, result.stdout + result.stderr
    assert "runtime.context -> tsdev.client" in result.stdout, result.stdout
    assert "The runtime and the kernels never import the toolkit BROKEN" in result.stdout, result.stdout
