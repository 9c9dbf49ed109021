"""The first reload after a start does in its pause only what every later reload does: what it does once (compiling
the reloadable modules' graph, imports, the compile pool) happens at startup or before the pause. Two distinct
never-seen kernel edits reloaded in one process (benchmarks/first_reload.py), the engine thread profiled during each
pause: the first calls no function the second does not, and hardly more calls in all. Counted calls, not seconds."""
import pytest
import json
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)

ROOT = Path(__file__).resolve().parent.parent


def test_the_first_reload_pauses_for_the_same_work_as_the_next(tmp_path):
    out = tmp_path / "calls.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/first_reload.py"), "--device", "cpu", "--edits", "2",
                          "--calls-json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = (reload["calls"] for reload in json.loads(out.read_text()))
    assert sorted(set(first) - set(second)) == []
    assert sum(first.values()) <= 1.05 * sum(second.values()), (sum(first.values()), sum(second.values()))
