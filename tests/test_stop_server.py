"""A server that stops itself (`stop_server`) first gives its children, the tensor-parallel ranks, a moment to exit
and say why they stop, and no more than that."""
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
