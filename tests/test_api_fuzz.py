"""Every route of the app's OpenAPI schema, fuzzed with schemathesis (valid and invalid bodies, boundary values):
no 5xx, no hang, an OpenAI-style error body on every 4xx, and the server still serves afterwards.

In-process (the ASGI app on the tiny CPU model, a short context so any generation ends fast), a bounded number
of examples per route and a fixed seed, so CI sees the same requests every run.
"""
import asyncio
import importlib
import json
import os
import sys
from contextlib import AsyncExitStack

import hypothesis
import pytest
import schemathesis
from schemathesis.python import asgi

from tsdev_runtime.control_protocol import (CONTINUE_ROUTE, EVENTS_ROUTE, PAUSE_ROUTE, RELOAD_ROUTE,
                                      RELOAD_WEIGHTS_ROUTE, SLEEP_ROUTE, START_PROFILE_ROUTE, STOP_PROFILE_ROUTE,
                                      UPDATE_WEIGHTS_FROM_DISK_ROUTE, WAKE_UP_ROUTE, ErrorBody, Hello, parse_event)
from tsdev_runtime.server.app import build_app
from tsdev_runtime.server.security import SecurityPolicy

CALL_TIMEOUT_S = 10  # a request still unanswered by then is a hang: the test fails instead of blocking CI
# Generated examples per route (besides schemathesis's boundary-value and wrong-method cases); a deeper local run:
# TSDEV_FUZZ_EXAMPLES=300 pytest tests/test_api_fuzz.py. derandomize: the same requests on every run.
EXAMPLES = int(os.environ.get("TSDEV_FUZZ_EXAMPLES", 25))


class OneLifespan:
    """The app with one lifespan for the whole module. Schemathesis ends an ASGI app's lifespan after every test
    and starts it again on the next request, but an engine stopped once does not start again: here the first
    startup enters the app's lifespan, later startups and shutdowns are acknowledged, and `close()` ends it."""

    def __init__(self, app):
        self.app, self.state = app, app.state
        self.lifespan: AsyncExitStack | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        await receive()  # startup
        if self.lifespan is None:
            self.lifespan, self.loop = AsyncExitStack(), asyncio.get_running_loop()
            await self.lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        await send({"type": "lifespan.startup.complete"})
        await receive()  # shutdown
        await send({"type": "lifespan.shutdown.complete"})

    def close(self) -> None:
        if self.lifespan is not None:
            asyncio.run_coroutine_threadsafe(self.lifespan.aclose(), self.loop).result(timeout=30)


@pytest.fixture(scope="module")
def app(tiny_model_dir, tmp_path_factory):
    """The app on the tiny model (64-token context) with reload_forward enabled over a throwaway package, so
    fuzzed reloads can only re-execute that package, never the runtime modules other tests share."""
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine
    from tsdev.hotreload import Reloader

    root = tmp_path_factory.mktemp("fuzz-reload")
    (root / "fuzzpkg").mkdir()
    (root / "fuzzpkg" / "__init__.py").write_text("")
    (root / "fuzzpkg" / "step.py").write_text("def f():\n    return 1\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        importlib.invalidate_caches()
        importlib.import_module("fuzzpkg.step")
        # POST /v1/rl/engine/kernel_check answers 400 here (the kernels need CUDA or the interpreter): the fuzz
        # covers its contract; running the checks, minutes of interpreted kernels per call, is test_kernel_checks'
        mp.delenv("TRITON_INTERPRET", raising=False)
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=64, kv_pages=64))
        security = SecurityPolicy(profile_dir=tmp_path_factory.mktemp("profiles"))  # /start_profile writes there
        app = OneLifespan(build_app(engine, "tiny", reloader=Reloader(["fuzzpkg"]), security=security))
        try:
            yield app
        finally:
            app.close()  # ends the engine's thread
            for name in [m for m in sys.modules if m == "fuzzpkg" or m.startswith("fuzzpkg.")]:
                del sys.modules[name]


@pytest.fixture(scope="module")
def api_schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app).exclude(path=EVENTS_ROUTE)  # never ends: tested below


def assert_openai_error(response) -> None:
    """A 4xx carries {"error": {"message": str, "type": str, "param": ..., "code": <the status>}}."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = ErrorBody.model_validate(body).error
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert error.message and error.type and error.code == response.status_code, body


def stream_errors(response) -> list[dict]:
    """Error events inside a 200 SSE stream (a failure after the stream started)."""
    errors = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event)
    return errors


def operations(api_schema) -> list:
    found = [result.ok() for result in api_schema.get_all_operations()]
    labels = {op.label for op in found}  # the schema lists the routes: never a fuzz of nothing
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST " + RELOAD_ROUTE} <= labels, labels
    return found


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda mode: mode.value)
def test_every_route_answers_fuzzed_requests_without_a_server_error(api_schema, app, mode):
    """Valid (positive) and schema-violating (negative) requests for every operation. Hypothesis drives each
    operation's strategy directly: schemathesis's pytest plugin reaches into pytest internals that pytest 9.2
    removed (`Function._nodeid`), and this needs only the schema and hypothesis."""
    unsatisfiable = []
    for operation in operations(api_schema):
        if mode is schemathesis.GenerationMode.NEGATIVE and not list(operation.iter_parameters()) \
                and not operation.get_request_payload_content_types():
            continue  # nothing in the request can violate the schema
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        @hypothesis.settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        def fuzz(case):
            try:
                response = case.call(timeout=CALL_TIMEOUT_S)
                where = f"{case.method} {case.path} {case.body!r}"
                assert response.status_code < 500, f"{where} -> {response.status_code}: {response.text}"
                if response.status_code >= 400:
                    assert_openai_error(response)
                elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
                    assert not stream_errors(response), f"{where}: {response.text}"
            finally:  # leave the server serving for the next example: not paused, awake, no capture range open
                restore(app, case.path)
        try:
            fuzz()
        except hypothesis.errors.Unsatisfiable:  # no request can violate its schema (a free string in the path)
            unsatisfiable.append(operation.label)
    assert set(unsatisfiable) <= {"GET /v1/models/{model_id}"}, unsatisfiable


def restore(app, path: str) -> None:
    if path == PAUSE_ROUTE:
        post(app, CONTINUE_ROUTE)
    elif path in (SLEEP_ROUTE, WAKE_UP_ROUTE, RELOAD_WEIGHTS_ROUTE, UPDATE_WEIGHTS_FROM_DISK_ROUTE):
        post(app, WAKE_UP_ROUTE)
        post(app, RELOAD_WEIGHTS_ROUTE)  # after a level-2 sleep the weights must be loaded again
    elif path == START_PROFILE_ROUTE:
        post(app, STOP_PROFILE_ROUTE)


def test_a_wrong_method_on_every_route_is_a_405_with_an_openai_error(api_schema, app):
    with asgi.get_client(app) as client:
        for path in {operation.path for operation in operations(api_schema)}:
            if "{" in path:
                continue
            allowed = {op.method.upper() for op in operations(api_schema) if op.path == path}
            method = "PUT" if "PUT" not in allowed else "PATCH"
            response = client.request(method, path, timeout=CALL_TIMEOUT_S)
            assert response.status_code == 405, (method, path, response.text)
            assert_openai_error(response)


def post(app, path: str, body: bytes | None = None):
    """A request on the event loop the fuzz runs the app in (schemathesis's)."""
    with asgi.get_client(app) as client:
        return client.post(path, data=body, headers={"content-type": "application/json"}, timeout=CALL_TIMEOUT_S)


def test_the_events_stream_greets_a_new_subscriber(app):
    with asgi.get_client(app, max_stream_events=1) as client:
        r = client.get(EVENTS_ROUTE, timeout=CALL_TIMEOUT_S)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    first = next(line for line in r.text.splitlines() if line.startswith("data: "))
    hello = parse_event(first[len("data: "):])
    assert isinstance(hello, Hello) and hello.paused is False


@pytest.mark.parametrize("path, body, param", [
    (RELOAD_ROUTE, rb'{"id": "surrogate", "modules": ["\ud800"]}', "modules"),
    (START_PROFILE_ROUTE, rb'{"activities": ["TORCH"], "name": "\ud800"}', "name"),
    (START_PROFILE_ROUTE, rb'{"activities": ["TORCH"], "output_dir": "\udfff"}', "output_dir"),
])
def test_control_text_with_a_lone_surrogate_is_refused_not_a_server_error(app, path, body, param):
    """These were 500s: the reload's reply (naming the module) could not be encoded, nor the trace's path."""
    r = post(app, path, body)
    assert r.status_code == 400, r.text
    assert_openai_error(r)
    assert r.json()["error"]["param"] == param and "surrogate pair" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, needle", [
    (rb'{"activities": ["TORCH"], "output_dir": "a\u0000b"}', "output_dir: must not contain a NUL character"),
    (b'{"activities": ["TORCH"], "name": "' + b"x" * 250 + b'"}', "name: is too long for a file system (261 bytes"),
    (b'{"activities": ["TORCH"], "output_dir": "' + b"d/" * 600 + b'"}', "use at most 255 bytes per name and 1024"),
])
def test_a_profile_path_the_file_system_cannot_take_is_refused_before_the_range_opens(app, body, needle):
    """A NUL was a 500 at once; a name too long opened the range, then writing its trace failed: a 500 from
    /stop_profile, or, when the range closed after its steps, a failed engine step (aborting the requests)."""
    r = post(app, START_PROFILE_ROUTE, body)
    assert r.status_code == 400, r.text
    assert_openai_error(r)
    assert needle in r.json()["error"]["message"]
    assert app.state.async_engine.profiler.active is None


def test_the_server_still_serves_after_the_fuzz(app):
    with asgi.get_client(app) as client:
        assert client.get("/health", timeout=CALL_TIMEOUT_S).json() == {"status": "ok"}
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
                        timeout=CALL_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    async_engine = app.state.async_engine
    running = app.state.engine.stats().running
    assert (async_engine.control.paused, async_engine.profiler.active, running) == (False, None, 0)
