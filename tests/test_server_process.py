"""The one server launcher (tsdev.launch.child) and the one SSE reader (tsdev.client), on their own."""
import sys

import httpx
import pytest

from tsdev.client import iter_sse_data
from tsdev.launch.child import ServerProcess, StartFailed


def test_argv_adds_reload_and_port_flags_once_and_wraps_a_prefix():
    server = ServerProcess(["m", "--port=9001", "--allow-reload-forward"], 8000, allow_reload_forward=True,
                           prefix=["nsys", "profile"])
    assert server.argv == ["nsys", "profile", sys.executable, "-m", "tsdev", "serve", "m", "--port=9001",
                           "--allow-reload-forward"]
    assert server.url == "http://127.0.0.1:9001"
    assert server.command_line == "tsdev serve m --port=9001 --allow-reload-forward"
    plain = ServerProcess(["--device", "cpu", "--host", "0.0.0.0"], 8123, allow_reload_forward=True)
    assert plain.serve_args[-3:] == ["--allow-reload-forward", "--port", "8123"]
    assert plain.url == "http://127.0.0.1:8123"
    assert ServerProcess(["--host", "::1"], 8124).url == "http://[::1]:8124"  # an IPv6 address needs brackets
    httpx.URL(ServerProcess(["--host", "::1"], 8124).url + "/health")


@pytest.mark.slow
def test_a_server_that_exits_during_startup_fails_early_with_its_last_output(tmp_path):
    server = ServerProcess([str(tmp_path), "--device", "cpu"], log_path=tmp_path / "serve.log")
    with pytest.raises(StartFailed, match=r"exited during startup \(exit status 2\):\n(.|\n)*no config.json"):
        with server.running(timeout=120):
            pass
    assert server.proc is None  # stopped


def test_sse_reader_yields_data_payloads_until_done():
    stream = b': comment\n\nevent: x\ndata: {"a": 1}\n\ndata:{"b": 2}\n\ndata: [DONE]\n\ndata: {"late": 3}\n\n'
    assert list(iter_sse_data(httpx.Response(200, content=stream))) == [{"a": 1}, {"b": 2}]
