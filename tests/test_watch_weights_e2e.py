"""`tsdev watch --weights DIR --no-tui` end to end: a real child server on the tiny model; a trainer-style publish
of new weights into DIR is loaded in place and changes the greedy output."""
import pytest
import os
import re
import signal
import subprocess
import sys

from test_watch_e2e import Output
from tsdev.launch.child import free_port

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)


def test_a_checkpoint_published_into_dir_updates_the_served_weights(tmp_path, tiny_model_dir):
    from tsdev_runtime.weights.default_model import SHAPES, write_checkpoint

    weights, port = tmp_path / "ckpts", free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsdev", "watch", str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024",
         "--cudagraph-capture-sizes", "1", "--port", str(port), "--no-tui", "--probe-batch", "2", "--probe-steps",
         "8", "--settle-ms", "100", "--weights", str(weights), "--server-log", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=os.getcwd())
    out = Output(proc)
    try:
        assert "--allowed-weight-dir" in out.next(r"starting the server: ", timeout=30).string
        out.next(r"for new checkpoints \(now: no complete checkpoint", timeout=120)
        # new weights of the same shapes (another seed), written aside, then renamed into DIR
        (weights / "step-1.tmp").mkdir()
        write_checkpoint(weights / "step-1.tmp", {**SHAPES["tiny"], "max_position_embeddings": 1024}, seed=2, std=0.2)
        os.rename(weights / "step-1.tmp", weights / "step-1")
        line = out.next(r"weights #1 (ok|FAILED).*", timeout=60).string
        assert f"weights #1 ok (weights {weights.resolve()}/step-1): update_weights direct" in line, line
        assert re.search(r"golden: output changed at token \d+ of 24 \(new weights\)", line), line
        assert "golden retaken on the new weights" in line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
