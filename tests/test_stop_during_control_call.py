"""SIGINT or SIGTERM while a control call runs on the engine's thread (`tsdev check`, a reload whose strict kernel
check runs in the pause, a weight load: each under Triton's interpreter or on the CPU): the server exits without
finishing the call (which runs for many seconds), and the call answers that the server is stopping instead of holding
the exit. How fast it exits is a benchmark's figure (benchmarks/shutdown.py), not an assertion here: a loaded 2-core
machine took 2.5 s where an idle one takes 0.3."""
import signal
import threading
import time

import httpx
import pytest

from serve_process import copy_project
from tsdev.launch.child import ServerProcess

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)

ATTENTION, PREFILL_LINE = "kernels/tsdev_kernels/ops/attention.py", "    head = tl.program_id(0)\n    m_block ="


def started_call(url: str, call: str, answer: dict) -> threading.Thread:
    path, body = {"check": ("/v1/rl/engine/kernel_check", {}),
                  "reload": ("/v1/rl/engine/reload_forward", {"id": "stopped", "kernel_check": "strict"}),
                  "weights": ("/v1/rl/engine/update_weights", {"mode": "full"})}[call]

    def run():
        try:
            answer["reply"] = httpx.post(url + path, json=body, timeout=300)
        except httpx.HTTPError as exc:
            answer["reply"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("sig, call", [(signal.SIGINT, "check"), (signal.SIGTERM, "reload")])
def test_a_signal_during_a_control_call_stops_the_server_before_the_call_ends_and_the_call_says_so(
        tmp_path, tiny_model_dir, sig, call):
    project = copy_project(tmp_path / "project")
    server = ServerProcess([str(tiny_model_dir), "--device", "cpu", "--max-model-len", "512", "--max-running", "64",
                            "--allow-reload-forward", "--kernel-check", "strict", "--cudagraph-capture-sizes", "1",
                            "64"], cwd=project, pythonpath=project, log_path=tmp_path / "serve.log")
    server.start()
    server.wait_healthy(120)
    proc = server.proc
    try:
        if call == "reload":  # an attention kernel edit: strict checks it in the pause, interpreted (many seconds)
            file = project / ATTENTION
            assert PREFILL_LINE in file.read_text()
            file.write_text(file.read_text().replace(PREFILL_LINE, PREFILL_LINE.replace("(0)", "(0) + 0")))
        answer: dict = {}
        thread = started_call(server.url, call, answer)
        time.sleep(1.5)  # well inside the checks
        assert "reply" not in answer, answer
        proc.send_signal(sig)
        code = proc.wait(30)  # a hang guard: the checks alone run for longer
        thread.join(30)
        output = (tmp_path / "serve.log").read_text()
        assert code == 0, (code, output[-3000:])
        reply = answer["reply"]
        assert isinstance(reply, httpx.Response), reply
        assert "server is stopping" in reply.text, (reply.status_code, reply.text)
        assert reply.status_code == (503 if call == "check" else 200), reply.text
        assert "Traceback" not in output, output[-3000:]
    finally:
        server.stop()
