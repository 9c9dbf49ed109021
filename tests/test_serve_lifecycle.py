"""`tsdev serve`'s lifecycle as a user meets it: the port is taken before the model loads, the listening line
means it, a big body does not stall the server, and Ctrl-C stops it at once and quietly.

One subprocess server for the module; the last test stops it with SIGINT.
"""
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tsdev.launch.child import ServerProcess

LISTENING = "listening on http://"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """A started server, and whether a connection made the moment its listening line appeared was served."""
    log = tmp_path_factory.mktemp("lifecycle") / "serve.log"
    process = ServerProcess([str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024"], log_path=log)
    process.start()
    deadline = time.monotonic() + 90
    while LISTENING not in process.output():
        assert process.proc.poll() is None and time.monotonic() < deadline, process.tail()
        time.sleep(0.005)
    port = int(process.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # at once, no retry
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        process.first_answer = sock.recv(1024).decode()
    process.tiny_model_dir, process.port = tiny_model_dir, port
    yield process
    process.stop()


@pytest.mark.slow
def test_the_listening_line_comes_last_and_is_served_at_once(server):
    assert server.first_answer.startswith("HTTP/1.1 200"), server.first_answer
    lines = server.output().strip().splitlines()
    assert lines[-1].startswith(LISTENING) and lines[-1].split()[2] == server.url, lines


@pytest.mark.slow
def test_a_second_server_on_the_port_exits_2_before_loading_anything_naming_the_port(server):
    command = ["-X", "importtime", "-m", "tsdev", "serve", str(server.tiny_model_dir), "--device", "cpu", "--port",
               str(server.port)]
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert f"port {server.port} is in use" in output and "--port" in output
    assert LISTENING not in output and "loaded" not in output
    # before loading anything: none of the engine, the models, the kernels or the HTTP stack was even imported (what
    # the process imported, from `-X importtime`: CPU-time bounds flaked on the loaded CI machine)
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "tsdev.cli" in imported, sorted(imported)[:20]  # the listing is read right
    heavy = ("tsdev_runtime.engine", "tsdev_runtime.models", "tsdev_kernels", "triton", "uvicorn", "fastapi")
    assert not sorted(m for m in imported if m.split(".")[0] in heavy or m.startswith(heavy))


@pytest.mark.parametrize("what", ["content-length", "chunked", "long prompt"])
def test_health_answers_while_a_big_body_is_refused(server, what):
    if what == "content-length":
        body, status = b"x" * 10_000_000, 413
    elif what == "chunked":
        body, status = (b"x" * 65536 for _ in range(160)), 413
    else:  # under the body limit, but far longer than the context: refused without tokenizing it
        body, status = json.dumps({"prompt": "word " * 700_000}).encode(), 400
    answer = {}

    def send():
        answer["response"] = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                                        headers={"content-type": "application/json"})

    sender = threading.Thread(target=send)
    sender.start()
    slowest = 0.0
    with httpx.Client(base_url=server.url) as client:
        while sender.is_alive() or slowest == 0.0:
            start = time.monotonic()
            assert client.get("/health", timeout=5).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
    sender.join()
    response = answer["response"]
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert slowest < 0.2


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
def test_a_body_over_the_limit_is_answered_413_as_soon_as_the_limit_passes(server, framing):
    """The client is still sending (a chunked body never terminated, a declared length never reached): the 413
    arrives anyway, at once."""
    limit = 4 * 1024 * 1024
    head = (b"Transfer-Encoding: chunked\r\n" if framing == "chunked"
            else f"Content-Length: {limit * 4}\r\n".encode())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head
                     + b"\r\n")
        start = time.monotonic()
        piece = b"x" * (limit + 1)
        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if framing == "chunked" else piece)
        answer = sock.recv(4096).decode(errors="replace")
        elapsed = time.monotonic() - start
    assert answer.startswith("HTTP/1.1 413"), answer
    assert elapsed < 1.5, elapsed  # not after a drain of the rest (which never comes)


def test_sigint_stops_the_server_at_once_without_a_traceback(server):
    """With an events stream open and a completion streaming: both end, the stream with finish reason abort."""
    got: dict[str, list] = {"events": [], "completion": []}
    first_token = threading.Event()

    def read(name: str, method: str, path: str, **kwargs) -> None:
        with httpx.stream(method, server.url + path, timeout=30, **kwargs) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got[name].append(line.removeprefix("data: "))
                    if name == "completion":
                        first_token.set()

    readers = [threading.Thread(target=read, args=("events", "GET", "/v1/rl/engine/events")),
               threading.Thread(target=read, args=("completion", "POST", "/v1/completions"), kwargs={"json": {
                   "prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "stream": True}})]
    for reader in readers:
        reader.start()
    assert first_token.wait(30)
    time.sleep(0.2)  # the events stream is open too
    start = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    code = server.proc.wait(10)
    elapsed = time.monotonic() - start
    for reader in readers:
        reader.join(5)
    output = server.output()
    assert code == 0 and elapsed < 2, (code, elapsed, output)
    assert "Traceback" not in output and "Error" not in output, output
    assert got["events"] and json.loads(got["events"][0])["type"] == "hello"
    assert got["completion"][-1] == "[DONE]"
    assert json.loads(got["completion"][-2])["choices"][0]["finish_reason"] == "abort"


def test_the_servers_connections_send_small_writes_at_once():
    """Nagle's algorithm off on every accepted connection (asyncio sets TCP_NODELAY on sockets that say they are TCP):
    with it on, a stream's first chunks waited for the client's delayed ACK, ~40 ms, and arrived bunched."""
    import asyncio

    from tsdev.launch.serve import bind

    async def accepted_nodelay() -> int:
        seen = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = bind("127.0.0.1", 0)
        server = await asyncio.start_server(on_connect, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        try:
            return await asyncio.wait_for(seen, 5)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
