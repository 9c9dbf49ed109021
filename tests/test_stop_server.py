"""A server that stops itself (`stop_server`) first gives its children, the tensor-parallel ranks, a moment to exit
and say why they stop, and no more than that."""
import pytest
import subprocess
import sys

PROBE = """
import subprocess, sys, time
from tsdev_runtime.engine.errors import wait_for_children
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep({sleep})"])
start = time.monotonic()
wait_for_children({wait})
print(round(time.monotonic() - start, 2), child.poll() is not None)
child.kill()
"""


def waited(sleep: float, wait: float) -> tuple[float, bool]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(sleep=sleep, wait=wait)], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    return float(out[0]), out[1] == "True"


def test_it_returns_once_the_children_have_exited():
    seconds, exited = waited(sleep=0.3, wait=20)
    assert exited and 0.2 <= seconds < 10


def test_it_gives_up_after_its_time_while_a_child_lives_on():
    seconds, exited = waited(sleep=30, wait=0.5)
    assert not exited and 0.4 <= seconds < 5


FAIL_FAST = """
import subprocess, sys, time
from tsdev.launch.tensor_ranks import fail_fast
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
with fail_fast([child]):
    time.sleep(60)  # rank 0 waiting for the rendezvous
print("never")
"""


@pytest.mark.slow
def test_a_rank_that_exits_before_the_ranks_meet_stops_rank_0_at_once():
    """The rendezvous waits minutes for a slow rank; one that died is not waited for."""
    import time

    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", FAIL_FAST], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "rank 1 exited (status 3) before the ranks met" in out.stderr, out.stderr
    assert "never" not in out.stdout and time.monotonic() - start < 30
