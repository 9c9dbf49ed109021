"""The floors hold (docs/architecture.md: tsdev -> tsdev_runtime -> tsdev_kernels, imports only go down):
`lint-imports` keeps every contract in pyproject.toml."""
import os
import subprocess
import sys
from pathlib import Path

from tsdev.launch.child import copy_project, project_pythonpath

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """import-linter's `lint-imports`, from this interpreter's environment, on the project in `cwd` (its packages
    first on the path, before the installed project)."""
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
               "--no-cache"]
    env = {**os.environ, "PYTHONPATH": project_pythonpath(cwd)}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def test_the_imports_keep_every_layering_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout, result.stdout


def test_a_runtime_module_that_imports_the_toolkit_breaks_the_contracts(tmp_path):
    copy_project(tmp_path)
    context = tmp_path / "runtime" / "tsdev_runtime" / "context.py"
    context.write_text(context.read_text() + "\nimport tsdev.client\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "tsdev_runtime.context -> tsdev.client" in result.stdout, result.stdout
    assert "The runtime and the kernels never import the toolkit BROKEN" in result.stdout, result.stdout
