"""`tsdev check` beside serving (issue 68): the server runs one (op, shape) case per call of its engine thread, only
while no request runs, so a completion waits for one case at most; the client going away stops the check between two
cases; /load and /health name the check while it runs, a second one is refused (409); `tsdev check` shows the case
running. Under Triton's interpreter on the CPU, with the tiny model's small shapes (the cases take ~0.1 s each).

The in-process server (uvicorn in a thread) lets the tests count the cases the engine thread runs and hold one until
they have looked (`Held`); the last test goes through `tsdev serve`'s API process, whose relay must pass the client's
going away on to the engine process."""
import json
import re
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from typer.testing import CliRunner

from serve_process import serve
from tsdev_runtime.control_protocol import KERNEL_CHECK_ROUTE, KernelCheckReply
from tsdev_kernels import checks

OPS = ["rms_norm", "silu_and_mul"]  # 4 serving shapes each here; quick under the interpreter


@contextmanager
def served(app):
    """The app behind a real socket (uvicorn in a thread): real connections, which a client can drop. Yields its URL
    and how many connections it has open."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    until(lambda: server.started or not thread.is_alive(), "the in-process server to start")
    assert thread.is_alive(), "the in-process server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", lambda: len(server.server_state.connections)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def until(condition, what: str, deadline_s: float = 120) -> None:
    """Wait for `condition` (looked at every 20 ms); the deadline only keeps a broken server from hanging the run."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"still waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from tsdev.hotreload import Reloader
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine
    from tsdev_runtime.server.app import build_app

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256, max_running=4,
                                    kv_pages=128, cudagraph_capture_sizes=[1, 2], prefill_graph_capture_sizes=[16],
                                    max_batched_tokens=64))
    with served(build_app(engine, "tiny", Reloader(["tsdev_kernels.ops"]))) as (url, connections):
        yield url, engine, connections


class Held:
    """Counts the cases the engine thread runs (and the requests beside each), holding case `at` (1-based) until
    `release` is set: what a test looks at happens while the check is surely running. It hooks the inputs' draw,
    which each case makes once (kernels/tsdev_kernels/checks.py's run_all)."""

    def __init__(self, monkeypatch, engine, at: int):
        self.calls: list[tuple[str, int]] = []  # (op, requests running or waiting when the case began)
        self.reached, self.release = threading.Event(), threading.Event()
        original = checks.draw

        def draw(check, shape, dtype, device):
            stats = engine.stats()
            self.calls.append((check.op, stats.running + stats.waiting))
            if len(self.calls) == at:
                self.reached.set()
                assert self.release.wait(120), "the test never released the held case"
            return original(check, shape, dtype, device)

        monkeypatch.setattr(checks, "draw", draw)


def checking(url: str, ops: list[str], answer: dict, stream: bool) -> threading.Thread:
    """A check's request in a thread: its reply (and with `stream`, its progress events) land in `answer`."""

    def run():
        response = httpx.post(url + KERNEL_CHECK_ROUTE, json={"ops": ops, "stream": stream}, timeout=120)
        data = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]
        answer["events"] = data[:-1]  # the progress events
        answer["reply"] = KernelCheckReply.model_validate(data[-1] if data else response.json())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def complete(url: str) -> dict:
    reply = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3},
                       timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


@contextmanager
def posted(url: str, path: str, body: dict):
    """A POST whose client goes away (its connection closed) when the block ends, whatever the server did."""
    address = httpx.URL(url)
    data = json.dumps(body).encode()
    with socket.create_connection((address.host, address.port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {address.host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        yield


@pytest.mark.parametrize("stream", [True, False])
def test_the_client_going_away_stops_the_check_before_its_next_case(server, monkeypatch, stream):
    """A stream's end cancels the check at once; the plain reply's route sees its client gone after the case."""
    url, engine, connections = server
    held = Held(monkeypatch, engine, at=2)
    with posted(url, KERNEL_CHECK_ROUTE, {"ops": OPS, "stream": stream}):
        assert held.reached.wait(120)  # case 2 of 8 runs on the engine thread: the client goes away now
    until(lambda: connections() == 0, "the server to see the client gone")
    held.release.set()
    until(lambda: "kernel_check" not in httpx.get(url + "/load").json(), "the check to stop")
    complete(url)  # runs on the engine thread after the held case: it has finished
    assert [op for op, _ in held.calls] == ["silu_and_mul"] * 2  # none after the client went away
    rerun = CliRunner().invoke(app(), ["check", *OPS, "--url", url])  # not refused: nothing runs any more
    assert rerun.exit_code == 0, rerun.output
    assert len(held.calls) == 2 + 8


def test_a_completion_is_served_between_two_cases_of_a_check(server, monkeypatch):
    url, engine, _ = server
    held = Held(monkeypatch, engine, at=1)
    answer: dict = {}
    check = checking(url, OPS, answer, stream=True)
    assert held.reached.wait(120)
    served_after: list[int] = []
    completion = threading.Thread(target=lambda: (complete(url), served_after.append(len(held.calls))))
    completion.start()
    until(lambda: engine.stats().waiting + engine.stats().running > 0, "the completion to reach the engine")
    held.release.set()  # the completion's steps go next, then the check's next case
    completion.join(120)
    check.join(120)
    reply: KernelCheckReply = answer["reply"]
    assert reply.ok and len(reply.checks) == 8
    assert served_after and served_after[0] < 8  # done before the check's last case
    assert all(beside == 0 for _, beside in held.calls[1:]), held.calls  # no case ran beside the request
    assert [e["waiting_for"] for e in answer["events"] if e["op"] is None]  # it said it waited for the request
    assert answer["events"][-1]["done"] == 7


def test_load_and_health_name_a_running_check_and_a_second_check_is_refused(server, monkeypatch):
    url, engine, _ = server
    held = Held(monkeypatch, engine, at=3)
    answer: dict = {}
    check = checking(url, OPS, answer, stream=False)  # the plain reply: what curl gets
    try:
        assert held.reached.wait(120)
        load, health = httpx.get(url + "/load").json(), httpx.get(url + "/health")
        assert load["server_load"] == 1 and load["kernel_check"]["total"] == 8, load
        assert (load["kernel_check"]["done"], load["kernel_check"]["op"]) == (2, "silu_and_mul"), load
        assert health.status_code == 200 and health.json()["kernel_check"]["done"] == 2, health.text
        second = CliRunner().invoke(app(), ["check", "--url", url])
        assert second.exit_code == 2 and "409: a kernel check is running (2 of 8" in second.output, second.output
    finally:
        held.release.set()
        check.join(120)
    assert answer["reply"].ok
    assert httpx.get(url + "/load").json() == {"server_load": 0}
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_tsdev_check_prints_the_case_running_and_then_its_summary(server):
    url, _, _ = server
    result = CliRunner().invoke(app(), ["check", "rms_norm", "--url", url])
    assert result.exit_code == 0, result.output
    progress = result.stderr.splitlines()
    assert progress == [f"checking rms_norm [{n} x 64] ({i}/4)" for i, n in enumerate((1, 2, 16, 64), 1)], progress
    assert result.stdout.splitlines()[0].startswith("rms_norm: err ") and "4 check(s) in" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_through_the_api_process_a_dropped_check_stops_in_the_engine_process(tmp_path, tiny_model_dir, stream):
    """`tsdev serve`'s HTTP front relays the check to the engine process: the client going away must reach it, also
    while the plain reply's head has not come (it comes at the check's end)."""
    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "256", "--max-running", "4",
            "--allow-reload-forward", "--cudagraph-capture-sizes", "1", "2", "--prefill-graph-capture-sizes", "16",
            "--max-batched-tokens", "64"]
    with serve(args, tmp_path / "serve.log") as url:
        with posted(url, KERNEL_CHECK_ROUTE, {"stream": stream}):
            until(lambda: httpx.get(url + "/load").json().get("kernel_check", {}).get("done", 0) >= 1,
                  "the check's first case to finish")
        until(lambda: "kernel_check" not in httpx.get(url + "/load").json(), "the engine process to stop the check")
        log = (tmp_path / "serve.log").read_text()
        stopped = re.search(r"kernel check stopped after (\d+) of (\d+) case\(s\): its client went away", log)
        assert stopped and int(stopped[1]) < int(stopped[2]), log[-2000:]
        assert "all ok" in CliRunner().invoke(app(), ["check", "rms_norm", "--url", url]).output


def app():
    from tsdev.cli import app as cli

    return cli
