"""Who may call what (docs/security.md): the API key, the loopback rule for control routes, the refused start,
and file paths from requests confined to the server's directories."""
import asyncio
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from tsdev_runtime.config import ServerConfig
from tsdev_runtime.control_protocol import ErrorBody, ProfileRequest, ServerInfo
from tsdev_runtime.server.app import build_app
from tsdev_runtime.server.security import PathNotAllowed, SecurityPolicy, confine, is_local_client, startup_refusal
from tsdev.cli import app as cli
from tsdev.client import auth_headers, body

KEY = "s3cret-key"
REMOTE = ("10.0.0.5", 1234)
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=128, kv_pages=64))


def error_of(response: httpx.Response, status: int):
    assert response.status_code == status, response.text
    error = ErrorBody.model_validate_json(response.content).error
    assert error.code == status and error.param is None
    return error


def from_address(app, client: tuple[str, int], *requests: tuple) -> list[httpx.Response]:
    """(method, path[, headers]) requests sent to the app in-process from `client`'s address. Nothing here needs
    the engine's loop: refusals are answered before routing, /server_info and /health answer at once."""
    async def run():
        transport = httpx.ASGITransport(app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c:
            return [await c.request(method, path, headers=(rest or [None])[0]) for method, path, *rest in requests]

    return asyncio.run(run())


# --- the API key ---------------------------------------------------------------------------------------------


def test_a_keyed_server_answers_401_without_the_key_or_with_a_wrong_one_and_serves_with_it(engine):
    with TestClient(build_app(engine, "tiny", security=SecurityPolicy(api_key=KEY))) as client:
        for method, path, json in (("POST", "/v1/completions", COMPLETION), ("GET", "/server_info", None),
                                   ("POST", "/flush_cache", None), ("GET", "/v1/models", None)):
            missing = error_of(client.request(method, path, json=json), 401)
            assert missing.type == "authentication_error" and "Authorization: Bearer" in missing.message
            assert "--api-key" in missing.message and "TSDEV_API_KEY" in missing.message
            wrong = client.request(method, path, json=json, headers=auth_headers("not-the-key"))
            assert "not this server's" in error_of(wrong, 401).message
            assert wrong.headers["www-authenticate"].startswith("Bearer")
            basic = client.request(method, path, json=json, headers={"Authorization": f"Basic {KEY}"})
            assert basic.status_code == 401
            ok = client.request(method, path, json=json, headers=auth_headers(KEY))
            assert ok.status_code == 200, (path, ok.text)
        assert client.post("/v1/completions", json=COMPLETION,
                           headers={"authorization": f"bearer {KEY}"}).json()["usage"]["completion_tokens"] == 2
        assert client.get("/health").status_code == 200  # open: load balancers
        assert client.get("/metrics").status_code == 200  # open: Prometheus
        assert client.post("/sleep", headers=auth_headers("wrong")).status_code == 401  # a route wave 2 adds


def test_metrics_can_be_closed_behind_the_key(engine):
    policy = SecurityPolicy(api_key=KEY, metrics_require_api_key=True)
    with TestClient(build_app(engine, "tiny", security=policy)) as client:
        assert client.get("/health").status_code == 200
        error_of(client.get("/metrics"), 401)
        assert "tsdev_requests_running" in client.get("/metrics", headers=auth_headers(KEY)).text


def test_the_openai_client_sends_the_key(engine):
    import openai

    with TestClient(build_app(engine, "tiny", security=SecurityPolicy(api_key=KEY))) as http:
        good = openai.OpenAI(api_key=KEY, base_url="http://testserver/v1", http_client=http)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(api_key="wrong", base_url="http://testserver/v1", http_client=http).models.list()


# --- control routes answer loopback clients ------------------------------------------------------------------


CONTROL = [("GET", "/server_info"), ("POST", "/flush_cache"), ("POST", "/v1/rl/engine/pause_generation"),
           ("POST", "/v1/rl/engine/continue_generation"), ("POST", "/start_profile"), ("POST", "/stop_profile"),
           ("GET", "/v1/rl/engine/events"), ("GET", "/v1/rl/engine/modules"), ("POST", "/v1/rl/engine/reload_forward"),
           ("POST", "/v1/rl/engine/update_weights")]  # the last: wave 2's, refused before it exists


def test_control_routes_refuse_a_remote_client_while_completions_serve_it(engine):
    app = build_app(engine, "tiny")
    *refused, health, metrics = from_address(app, REMOTE, *CONTROL, ("GET", "/health"), ("GET", "/metrics"))
    for (method, path), response in zip(CONTROL, refused):
        error = error_of(response, 403)
        assert error.type == "permission_error" and "10.0.0.5" in error.message, (path, error)
        assert "--api-key" in error.message and "--allow-remote-control" in error.message
    assert health.status_code == 200 and metrics.status_code == 200
    error_of(from_address(app, ("2001:db8::7", 1), ("POST", "/flush_cache"))[0], 403)
    assert from_address(app, ("127.0.0.9", 1), ("GET", "/server_info"))[0].status_code == 200  # all of 127/8
    with TestClient(app, client=REMOTE) as remote:  # with the engine running: completions answer anyone
        assert remote.post("/v1/completions", json=COMPLETION).status_code == 200
        assert remote.get("/v1/models").status_code == 200


def test_reload_forward_without_the_flag_is_refused_as_every_403_is(engine):
    app = build_app(engine, "tiny")  # no reloader: --allow-reload-forward was not given
    error = error_of(from_address(app, ("127.0.0.1", 1), ("GET", "/v1/rl/engine/modules"))[0], 403)
    assert error.type == "permission_error" and "--allow-reload-forward" in error.message

    async def post(path: str, body: bytes):
        transport = httpx.ASGITransport(app, client=("127.0.0.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c:
            return await c.post(path, content=body, headers={"content-type": "application/json"})

    for path in ("/v1/rl/engine/reload_forward", "/v1/rl/engine/kernel_check"):
        for sent in (b"{}", b'{"id": 5}', b"[", b"", b'{"id": "x", "mode": "nope"}'):  # whatever the body: 403
            error = error_of(asyncio.run(post(path, sent)), 403)
            assert "--allow-reload-forward" in error.message, (path, sent, error)


@pytest.mark.parametrize("policy", [SecurityPolicy(api_key=KEY), SecurityPolicy(allow_remote_control=True)],
                         ids=["api-key", "allow-remote-control"])
def test_a_remote_client_may_call_control_routes_with_the_key_or_when_allowed(engine, policy):
    app = build_app(engine, "tiny", security=policy)
    response, = from_address(app, REMOTE, ("GET", "/server_info", auth_headers(policy.api_key)))
    assert ServerInfo.model_validate_json(response.content).model == "tiny"


@pytest.mark.parametrize("host, local", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
                                         ("::ffff:127.0.0.1", True), (None, True), ("10.0.0.5", False),
                                         ("192.168.1.20", False), ("::ffff:10.0.0.5", False), ("localhost", False),
                                         ("not-an-address", False)])
def test_which_clients_are_on_this_machine(host, local):
    assert is_local_client(host) is local  # a TCP peer is an address: a name proves nothing


# --- a refused start -----------------------------------------------------------------------------------------


def test_serve_refuses_reload_forward_on_a_public_host_without_a_key(monkeypatch):
    import tsdev_runtime.engine.llm_engine

    monkeypatch.setattr(tsdev_runtime.engine.llm_engine, "LLMEngine", lambda *a, **k: pytest.fail("the model loaded"))
    start = time.perf_counter()
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0", "--allow-reload-forward", "--device", "cpu"])
    assert result.exit_code == 2 and time.perf_counter() - start < 5
    text = " ".join(result.output.split())
    assert "--api-key" in text and "--host 127.0.0.1" in text and "0.0.0.0" in text


@pytest.mark.parametrize("host, key, refused", [("0.0.0.0", None, True), ("192.168.1.5", None, True),
                                                ("::", None, True), ("0.0.0.0", KEY, False), ("127.0.0.1", None, False),
                                                ("localhost", None, False), ("::1", None, False)])
def test_reload_forward_beyond_this_machine_needs_a_key(host, key, refused):
    server = ServerConfig(host=host, allow_reload_forward=True, api_key=key)
    assert (startup_refusal(server) is not None) is refused
    assert startup_refusal(ServerConfig(host=host)) is None  # without reloads any host may serve
    assert "--api-key" in startup_refusal(ServerConfig(metrics_require_api_key=True))


def test_a_started_server_gets_the_key_in_its_environment_not_its_argv():
    from tsdev.launch.child import ServerProcess

    server = ServerProcess(["--device", "cpu"], api_key=KEY)
    assert KEY not in " ".join(server.argv) and server.env["TSDEV_API_KEY"] == KEY
    assert ServerProcess(["--device", "cpu"]).env is None
    assert KEY not in repr(ServerConfig(api_key=KEY)) and KEY not in repr(SecurityPolicy(api_key=KEY))


# --- clients send the key ------------------------------------------------------------------------------------


@contextmanager
def served(app):
    """The app behind a real socket (uvicorn in a thread), for clients that take a URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_tsdev_reload_and_bench_reach_a_keyed_server_with_tsdev_api_key(engine, package):
    from tsdev.bench import BenchConfig, run_bench
    from tsdev.hotreload import Reloader

    app = build_app(engine, "tiny", Reloader([package.name]), security=SecurityPolicy(api_key=KEY))
    with served(app) as url:
        refused = CliRunner().invoke(cli, ["reload", "--url", url])
        assert refused.exit_code == 2 and "401" in refused.output and "--api-key" in refused.output
        reloaded = CliRunner().invoke(cli, ["reload", "--url", url], env={"TSDEV_API_KEY": KEY})
        assert reloaded.exit_code == 0, reloaded.output
        assert CliRunner().invoke(cli, ["reload", "--url", url, "--api-key", KEY]).exit_code == 0
        config = BenchConfig(url=url, num_prompts=2, input_len=4, output_len=2)
        result = asyncio.run(run_bench(config, api_key=KEY))
        assert result["metrics"]["successful_requests"] == 2 and KEY not in str(result)
        with pytest.raises(PermissionError, match="401"):
            asyncio.run(run_bench(config))


def test_the_watch_daemons_link_sends_the_key(engine):
    from tsdev.watch.link import ServerLink

    async def describe():
        app = build_app(engine, "tiny", security=SecurityPolicy(api_key=KEY))
        link = ServerLink("http://server", httpx.ASGITransport(app), KEY)
        try:
            return await link.describe()
        finally:
            await link.aclose()

    assert asyncio.run(describe()).model == "tiny"


def test_tsdev_watch_gives_its_server_the_key_in_the_environment_and_sends_it(tmp_path):
    from fake_server import make_project
    from tsdev.watch.args import WatchConfig
    from tsdev.watch.daemon import Daemon

    daemon = Daemon(WatchConfig(project=make_project(tmp_path), api_key=KEY), lambda event: None)
    assert daemon.server.env["TSDEV_API_KEY"] == KEY and KEY not in " ".join(daemon.server.argv)
    assert daemon.link.client.headers["authorization"] == f"Bearer {KEY}"
    asyncio.run(daemon.link.aclose())


# --- paths from requests -------------------------------------------------------------------------------------


@pytest.fixture
def dirs(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "inner").mkdir(parents=True)
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    (root / "alias").symlink_to(root / "inner")
    return root, outside


def test_confine_keeps_paths_inside_their_roots(dirs):
    root, outside = dirs
    assert confine(root / "inner" / "w.safetensors", [root], "") == (root / "inner" / "w.safetensors").resolve()
    assert confine("inner", [root], "") == (root / "inner").resolve()  # relative: from the first root
    assert confine(root / "alias" / "x", [root], "") == (root / "inner" / "x").resolve()  # a symlink inside
    assert confine(outside / "x", [root, outside], "") == (outside / "x").resolve()  # any of the roots
    for escaping in (outside / "x", root / ".." / "outside", "../outside/x", root / "escape" / "x", "/etc/passwd"):
        with pytest.raises(PathNotAllowed, match="pass --this-flag"):
            confine(escaping, [root], "pass --this-flag")


def test_weight_paths_lie_under_the_model_or_an_allowed_weight_dir(dirs, tmp_path):
    root, outside = dirs
    policy = SecurityPolicy(allowed_weight_dirs=(outside,))
    assert policy.weight_path(str(outside / "ckpt"), root) == (outside / "ckpt").resolve()
    assert policy.weight_path("inner", root) == (root / "inner").resolve()
    with pytest.raises(PathNotAllowed, match="--allowed-weight-dir") as refused:
        SecurityPolicy().weight_path(str(outside / "ckpt"), root)
    assert refused.value.param == "path"


@pytest.mark.parametrize("request_, param", [
    ({"output_dir": "{outside}"}, "output_dir"),  # absolute
    ({"output_dir": "../outside"}, "output_dir"),
    ({"output_dir": "sub/../../outside"}, "output_dir"),
    ({"output_dir": "escape"}, "output_dir"),  # a symlink out of the profile directory
    ({"name": "../outside/x"}, "name"),
    ({"name": "a/b"}, "name"),
    ({"name": ".."}, "name"),
    ({"name": "planted"}, "name"),  # planted.trace.json is a symlink to a file outside
    ({"output_dir": "afile"}, "output_dir"),  # a file, not a directory
])
def test_start_profile_refuses_paths_that_leave_the_profile_directory(engine, dirs, request_, param):
    root, outside = dirs
    (root / "planted.trace.json").symlink_to(outside / "victim.json")
    (root / "afile").write_text("")
    request = {k: v.format(outside=outside) for k, v in request_.items()}
    with TestClient(build_app(engine, "tiny", security=SecurityPolicy(profile_dir=root))) as client:
        response = client.post("/start_profile", json=body(ProfileRequest(activities=["TORCH"], num_steps=1,
                                                                          **request)))
        assert response.status_code == 400, response.text
        error = ErrorBody.model_validate_json(response.content).error
        assert error.param == param and ("profile directory" in error.message), error.message
        assert client.post("/stop_profile").status_code == 400  # no range was opened
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert list(outside.iterdir()) == []


def test_start_profile_writes_under_the_profile_directory(engine, dirs):
    root, outside = dirs
    with TestClient(build_app(engine, "tiny", security=SecurityPolicy(profile_dir=root))) as client:
        for output_dir in ("runs/a", None):
            started = client.post("/start_profile", json=body(ProfileRequest(
                activities=["TORCH"], num_steps=100, output_dir=output_dir, name="r")))
            assert started.status_code == 200, started.text
            trace = client.post("/stop_profile").json()["trace"]
            assert Path(trace) == (root / (output_dir or "") / "r.trace.json").resolve() and Path(trace).exists()
    assert list(outside.iterdir()) == [] and os.path.exists(root / "runs" / "a" / "r.trace.json")


@pytest.mark.parametrize("headers", [{"origin": "https://evil.example"}, {"origin": "null"},
                                     {"host": "evil.example:8000"}, {"host": "rebind.example"}],
                         ids=["cross-site", "opaque-origin", "rebinding-with-port", "rebinding"])
def test_a_web_page_cannot_drive_control_routes_through_the_developers_browser(engine, headers):
    app = build_app(engine, "tiny")  # no key: loopback clients are trusted, but a browser is a loopback client
    for method, path in (("POST", "/flush_cache"), ("POST", "/v1/rl/engine/pause_generation")):
        error = error_of(from_address(app, ("127.0.0.1", 1), (method, path, headers))[0], 403)
        assert error.type == "permission_error" and "--api-key" in error.message
    assert engine.can_step() is False and app.state.async_engine.control.paused is False  # nothing was paused


def test_programs_and_same_machine_pages_still_reach_control_routes(engine):
    app = build_app(engine, "tiny")
    for headers in ({}, {"origin": "http://127.0.0.1:8000"}, {"origin": "http://localhost:3000"},
                    {"host": "localhost:8000"}, {"host": "[::1]:8000"}):
        assert from_address(app, ("127.0.0.1", 1), ("GET", "/server_info", headers))[0].status_code == 200, headers
    keyed = build_app(engine, "tiny", security=SecurityPolicy(api_key=KEY))  # the key is the protection then
    response, = from_address(keyed, ("127.0.0.1", 1), ("GET", "/server_info",
                                                       {**auth_headers(KEY), "origin": "https://tool.example"}))
    assert response.status_code == 200
