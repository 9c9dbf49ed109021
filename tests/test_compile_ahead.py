"""Compiling ahead on an editor's unsaved buffer (POST /v1/rl/engine/compile_ahead, `tsdev reload --ahead`,
runtime/tsdev_runtime/engine/buffers.py): refused without --allow-reload-forward and for a file outside the reloadable
packages; a syntax error is an answer, not a 500; the reloader's compile_ahead gets the buffer's text as its module's
source and nothing is reloaded (the served tokens and the reload count unchanged) until a save of that text, which
reloads as any save; a newer buffer of a file supersedes its older one still waiting; the control's lock is free while
the pool compiles, and a reload of the text being built waits for it. On the CPU Triton's interpreter builds nothing:
a stand-in reloader says what a GPU's would have built. No wall-clock assertions."""
import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import tsdev_kernels.ops.activation as activation_module
from tsdev_runtime.control_protocol import CompileAheadReply, ErrorBody
from tsdev_runtime.server.app import build_app
from tsdev.cli import app as cli
from tsdev.hotreload import Reloader
from tsdev.hotreload.ahead import Ahead

PACKAGES = ["tsdev_kernels.ops", "tsdev_runtime.layers", "tsdev_runtime.models", "tsdev_runtime.sampling"]
ROUTE = "/v1/rl/engine/compile_ahead"
ACTIVATION = Path(activation_module.__file__).resolve()
MODULE = "tsdev_kernels.ops.activation"
SILU_LINE = "    return F.silu(gate) * up\n"
PROMPT = [5, 17, 300, 42]


class Spy:
    """The toolkit's reloader, recording what compile_ahead and reload are given; `saved` stands for files written
    (read_sources returns them in place of the checkout's, which a test must not touch); `built` what a GPU's
    compile_ahead would return (None: the real one's, which on the CPU builds nothing)."""

    def __init__(self):
        self.reloader, self.saved, self.built = Reloader(PACKAGES), {}, None
        self.aheads, self.reloads = [], 0

    def __getattr__(self, name):
        return getattr(self.reloader, name)

    def read_sources(self):
        return {**self.reloader.read_sources(), **self.saved}

    def compile_ahead(self, sources=None, modules=None, prepared=None):
        self.aheads.append(dict(sources))
        done = self.reloader.compile_ahead(sources, modules, prepared)
        return done if self.built is None else self.built

    def reload(self, modules=None, sources=None):
        self.reloads += 1
        return self.reloader.reload(modules=modules, sources=sources)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=128, kv_pages=64))


def post(client, path: str, text: str) -> httpx.Response:
    return client.post(ROUTE, json={"path": str(path), "text": text})


def negated() -> str:
    source = ACTIVATION.read_text()
    assert SILU_LINE in source, f"{ACTIVATION} no longer holds {SILU_LINE!r}: update this test's edit"
    return source.replace(SILU_LINE, "    return -F.silu(gate) * up\n")


def tokens(client) -> str:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_without_the_flag_the_route_is_refused(engine):
    with TestClient(build_app(engine, "tiny")) as client:
        r = post(client, ACTIVATION, ACTIVATION.read_text())
    assert r.status_code == 403 and "--allow-reload-forward" in ErrorBody.model_validate_json(r.content).error.message


def test_a_file_outside_the_reloadable_packages_is_refused_naming_the_field(engine, tmp_path):
    scheduler = Path(ACTIVATION).parents[3] / "runtime" / "tsdev_runtime" / "engine" / "scheduler.py"
    sneaky = tmp_path / "activation.py"
    sneaky.symlink_to(ACTIVATION.parent.parent / "checks.py")  # a link that leads out of the packages
    with TestClient(build_app(engine, "tiny", Spy())) as client:
        for path in (scheduler, tmp_path / "elsewhere.py", sneaky, "../../etc/passwd"):
            r = post(client, path, "x = 1\n")
            assert r.status_code == 400, (path, r.text)
            error = ErrorBody.model_validate_json(r.content).error
            assert error.param == "path" and "reloadable packages" in error.message, error


def test_a_syntax_error_in_the_buffer_is_an_answer_and_nothing_is_compiled(engine):
    spy = Spy()
    with TestClient(build_app(engine, "tiny", spy)) as client:
        r = post(client, ACTIVATION, negated().replace("-F.silu(gate) * up", "-F.silu(gate) * up)"))
    assert r.status_code == 200, r.text
    reply = CompileAheadReply.model_validate_json(r.content)
    assert (reply.outcome, reply.ok, reply.module) == ("failed", False, MODULE)
    assert f"{ACTIVATION}:" in reply.error and "SyntaxError" in reply.error
    assert spy.aheads == [] and spy.reloads == 0


def test_the_buffer_is_built_as_its_modules_source_nothing_reloads_until_it_is_saved(engine):
    spy, text = Spy(), negated()
    with TestClient(build_app(engine, "tiny", spy)) as client:
        before = tokens(client)
        r = post(client, ACTIVATION, text)
        assert r.status_code == 200, r.text
        reply = CompileAheadReply.model_validate_json(r.content)
        assert (reply.outcome, reply.ok, reply.module, reply.path) == ("nothing", True, MODULE, str(ACTIVATION))
        assert "interpreter" in reply.reason  # the CPU: no binaries to build
        [sources] = spy.aheads
        assert sources[MODULE] == text.encode()  # the buffer, as the module's source
        assert {m: s for m, s in sources.items() if m != MODULE} == {
            m: s for m, s in spy.reloader.read_sources().items() if m != MODULE}  # the rest as on disk
        assert tokens(client) == before and spy.reloads == 0 and engine.control.reloads == 0

        spy.built = Ahead(3, 0.5, 0.4, (f"{MODULE}.silu_and_mul_kernel",))  # what a GPU's would have built
        r = client.post(ROUTE, json={"path": str(ACTIVATION), "text": text, "id": "watch-1-early-1"})
        reply = CompileAheadReply.model_validate_json(r.content)
        assert (reply.outcome, reply.compiled, reply.kernels) == ("compiled", 3, [f"{MODULE}.silu_and_mul_kernel"])
        assert reply.id == "watch-1-early-1"  # the caller's name for its build, echoed (tsdev watch knows its own)
        assert reply.seconds == 0.5 and reply.slowest == 0.4 and tokens(client) == before and spy.reloads == 0
        spy.built = Ahead(0, 0.01, 0.0, on_disk=3)  # a version built before: its binaries in Triton's cache
        reply = CompileAheadReply.model_validate_json(post(client, ACTIVATION, text).content)
        assert reply.outcome == "nothing" and "(3) are in Triton's cache already" in reply.reason, reply
        # the save's own build: 2 binaries the buffer built, in Triton's cache now, and one specialisation serving
        # compiled since (the reload counts all 3 as ready before its pause)
        spy.built = Ahead(1, 0.2, 0.2, (f"{MODULE}.silu_and_mul_kernel",), on_disk=2)

        spy.saved = {MODULE: text.encode()}  # the save: the same text, on disk now
        try:
            reloaded = client.post("/v1/rl/engine/reload_forward", json={"id": "save"}).json()
            assert reloaded["ok"] and reloaded["workers"][0]["reloaded"] == [MODULE], reloaded
            assert reloaded["workers"][0]["jit_kernels"] == 3, reloaded
            assert tokens(client) != before and engine.control.reloads == 1
            again = CompileAheadReply.model_validate_json(post(client, ACTIVATION, text).content)
            assert again.outcome == "nothing" and "runs this text" in again.reason  # it serves that text now
        finally:
            spy.saved = {}  # the checkout's file again, and the server runs it
            assert client.post("/v1/rl/engine/reload_forward", json={"id": "revert"}).json()["ok"]
        assert tokens(client) == before


class Blocking:
    """A reloader whose compile_ahead says `prepared`, then waits until let go: what it was given, in order."""

    def __init__(self, modules: dict[str, Path]):
        self.files, self.started, self.go = modules, [], threading.Event()
        self.ahead_started = threading.Event()

    def modules(self):
        return list(self.files)

    def read_sources(self):
        return {m: b"" for m in self.files}

    def plan(self, sources=None, modules=None):
        class Plan:
            reloaded = [m for m, text in (sources or {}).items() if text]
            needs_restart = []
        return Plan()

    def compile_ahead(self, sources=None, modules=None, prepared=None):
        self.started.append({m: t.decode() for m, t in sources.items() if t})
        prepared()
        self.ahead_started.set()
        assert self.go.wait(30)
        return Ahead(1, 0.0, 0.0, ("k",))


def test_a_newer_buffer_supersedes_the_waiting_one_of_its_file_and_the_lock_is_free_while_the_pool_compiles(engine):
    from tsdev_runtime.engine.buffers import BufferCompiles

    a, b = Path(ACTIVATION), Path(ACTIVATION).with_name("norm.py")
    blocking = Blocking({"tsdev_kernels.ops.activation": a, "tsdev_kernels.ops.norm": b})

    class Control:  # what a build uses of the engine's control
        config, lock, reloader = engine.config, asyncio.Lock(), blocking

        class loop:
            published = []
            publish = published.append

    async def scenario():
        control = Control()
        buffers = BufferCompiles(control)
        buffers.files = lambda: {a: "tsdev_kernels.ops.activation", b: "tsdev_kernels.ops.norm"}
        first = asyncio.create_task(buffers.compile(a, "a = 1\n"))
        await asyncio.to_thread(blocking.ahead_started.wait, 30)
        for _ in range(3000):  # `prepared` hands the release to this loop (call_soon_threadsafe): let it run
            if not control.lock.locked():
                break
            await asyncio.sleep(0.01)
        assert not control.lock.locked()  # the pool still compiles (it waits for `go`): a reload may take its turn
        sources = {"tsdev_kernels.ops.activation": b"a = 1\n", "tsdev_kernels.ops.norm": b""}
        same = asyncio.create_task(buffers.settled(sources))  # a reload of the text being built waits for it
        other = asyncio.create_task(buffers.settled({**sources, "tsdev_kernels.ops.activation": b"a = 9\n"}))
        await asyncio.sleep(0.05)
        assert other.done() and not same.done()
        older = asyncio.create_task(buffers.compile(a, "a = 2\n"))
        norm = asyncio.create_task(buffers.compile(b, "b = 1\n"))
        await asyncio.sleep(0)
        newer = asyncio.create_task(buffers.compile(a, "a = 3\n"))
        superseded = await older
        assert superseded.outcome == "superseded" and superseded.ok and not first.done()
        blocking.go.set()
        replies = [await first, await norm, await newer]
        await same
        return replies, control.loop.published

    (first, norm, newer), published = asyncio.run(scenario())
    assert [r.outcome for r in (first, norm, newer)] == ["compiled"] * 3
    assert blocking.started == [{"tsdev_kernels.ops.activation": "a = 1\n"}, {"tsdev_kernels.ops.norm": "b = 1\n"},
                                {"tsdev_kernels.ops.activation": "a = 3\n"}]  # one at a time, oldest file first
    assert [e.reply.path for e in published] == [str(a), str(b), str(a)]  # the watch daemon hears of each


def test_tsdev_reload_ahead_sends_the_buffer_from_stdin_and_says_what_was_built(engine, tmp_path):
    from test_security import served

    spy, text = Spy(), negated()
    spy.built = Ahead(2, 0.61, 0.52, (f"{MODULE}.silu_and_mul_kernel",))
    with served(build_app(engine, "tiny", spy)) as url:
        done = CliRunner().invoke(cli, ["reload", "--url", url, "--ahead", str(ACTIVATION), "--stdin"], input=text)
        assert done.exit_code == 0, done.output
        assert "compiled ahead" in done.output and "2 binaries" in done.output and "silu_and_mul_kernel" in done.output
        assert spy.aheads[-1][MODULE] == text.encode() and spy.reloads == 0
        broken = CliRunner().invoke(cli, ["reload", "--url", url, "--ahead", str(ACTIVATION), "--stdin"],
                                    input=text.replace("-F.silu(gate) * up", "-F.silu(gate) * up)"))
        assert broken.exit_code == 1 and "SyntaxError" in broken.output and "activation.py:" in broken.output
        from_file = CliRunner().invoke(cli, ["reload", "--url", url, "--ahead", str(ACTIVATION)])  # as saved
        assert from_file.exit_code == 0 and "runs this text" in from_file.output, from_file.output
    outside = tmp_path / "notes.py"
    outside.write_text("x = 1\n")
    ignored = CliRunner().invoke(cli, ["reload", "--url", "http://127.0.0.1:9", "--ahead", str(outside)])
    assert ignored.exit_code == 0 and "nothing to compile ahead" in ignored.output, ignored.output
    refused_app = build_app(engine, "tiny")
    with served(refused_app) as url:
        refused = CliRunner().invoke(cli, ["reload", "--url", url, "--ahead", str(ACTIVATION)])
    assert refused.exit_code == 2 and "--allow-reload-forward" in refused.output, refused.output
