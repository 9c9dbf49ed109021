"""What a non-editable install (`pip install .`) gets: the wheel holds exactly the three packages, under their own
import names, with their data files; nothing lands in a folder another distribution owns (`kernels`, `runtime`)."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_holds_tsdev_tsdev_runtime_and_tsdev_kernels_with_their_data(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    names = zipfile.ZipFile(next(tmp_path.glob("tsdev-*.whl"))).namelist()
    assert {name.split("/")[0] for name in names if not name.startswith("tsdev-")} == {
        "tsdev", "tsdev_runtime", "tsdev_kernels"}
    for package in ("tsdev_runtime", "tsdev_kernels", "tsdev_runtime/engine", "tsdev_kernels/ops", "tsdev/watch"):
        assert f"{package}/__init__.py" in names, package
    assert "tsdev_runtime/weights/corpus.txt" in names
    for folder in ("moe_configs", "gemm_configs"):  # the tuned files `tsdev tune` made, shipped
        configs = {Path(name).name for name in names if name.startswith(f"tsdev_kernels/{folder}/")}
        assert configs == {path.name for path in (ROOT / "kernels/tsdev_kernels" / folder).glob("*.json")} != set()
