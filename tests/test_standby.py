"""A restart of `tsdev watch`'s server is handed to a standby process (tsdev/launch/standby.py) that already runs the
interpreter with torch, Triton and the HTTP stack imported: it serves after the restart, a new standby is started
for the next one, and a standby that died is replaced by an ordinary start and a new standby."""
import pytest
import os
import signal
import subprocess
import sys

import httpx

from tsdev.launch.child import ServerProcess

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)

REQUEST = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def served(server: ServerProcess) -> list[int]:
    reply = httpx.post(server.url + "/v1/completions", json=REQUEST, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def restart(server: ServerProcess) -> None:
    server.stop()
    server.start("restart")
    server.wait_healthy(120)


def test_a_restart_is_served_by_the_standby_and_a_dead_standby_is_replaced(tiny_model_dir, tmp_path):
    server = ServerProcess([str(tiny_model_dir), "--device", "cpu", "--max-model-len", "128"], standby=True,
                           log_path=tmp_path / "serve.log")
    try:
        server.start()
        server.wait_healthy(120)
        assert not server.handed_over and server.standby is not None  # started once the server was healthy
        first, standby = served(server), server.standby
        server.prepare_standby()  # as tsdev watch does: it imports the project while the old server stops
        restart(server)
        assert server.handed_over and server.proc is standby  # the standby became the server
        assert served(server) == first
        log = (tmp_path / "serve.log").read_text()
        assert "weights for the restart: " in log and "tensors copied by the standby" in log  # the old server's
        assert "the weights handed over by the server it replaces" in log  # the new one's: nothing read again
        dead = server.standby
        assert dead is not None and dead is not standby  # the next one waits already
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(10)
        restart(server)
        assert not server.handed_over and served(server) == first  # an ordinary start
        assert server.standby is not None and server.standby.poll() is None and server.standby is not dead
    finally:
        server.stop()
        replacement = server.standby
        server.dismiss_standby()
    assert standby.poll() is not None and replacement.poll() is not None  # nothing left running


def test_a_restart_asks_the_old_server_which_graphs_to_capture_before_serving(make_engine):
    """What tsdev watch passes the start that replaces a server: the graphs it used since its last capture (from
    /server_info), else the smallest of each kind (tests/test_deferred_capture.py: the rest are captured after)."""
    import asyncio

    from tsdev_runtime.engine.sequence import SamplingParams
    from tsdev_runtime.server.app import build_app
    from tsdev.watch.link import ServerLink

    engine = make_engine(cudagraph_capture_sizes=[1, 2, 4, 8], prefill_graph_capture_sizes=[16, 32, 64])

    async def flags() -> list[str]:
        link = ServerLink("http://127.0.0.1", httpx.ASGITransport(build_app(engine, "tiny")))
        try:
            return await link.capture_first()
        finally:
            await link.aclose()

    assert asyncio.run(flags()) == ["--cudagraph-capture-first", "1", "--prefill-graph-capture-first", "16"]
    engine.generate([[5, 17, 300] * 12, [4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))  # 38 tokens, then 2
    assert asyncio.run(flags()) == ["--cudagraph-capture-first", "2", "--prefill-graph-capture-first", "64"]


def test_a_standby_prepared_before_a_broken_edit_reports_it_when_it_starts(tmp_path):
    """The `prepare` line imports the project ahead; an error there is left to the start, which reports it."""
    (tmp_path / "tsdev_runtime").mkdir()
    (tmp_path / "tsdev_runtime" / "__init__.py").write_text("raise RuntimeError('broken on purpose')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    standby = subprocess.run([sys.executable, "-m", "tsdev.launch.standby"],
                             input='prepare\n["serve", "--device", "cpu", "--port", "0"]\n',
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert standby.returncode != 0 and "broken on purpose" in standby.stderr


def test_tritons_own_cache_key_is_computed_ahead_once_per_process():
    """`warm_triton_key` (a standby while it waits, a first start beside its load) leaves Triton's install hash in
    its per-process cache, where the first kernel compiled or loaded from the disk cache finds it."""
    from triton.runtime.cache import triton_key

    from tsdev.launch.child import warm_triton_key

    triton_key.cache_clear()
    warm_triton_key()
    assert triton_key.cache_info().currsize == 1 and triton_key.cache_info().misses == 1
    warm_triton_key()
    assert triton_key.cache_info().hits == 1  # the next caller pays nothing


def test_prepare_imports_again_only_the_changed_module_and_its_importers(tmp_path, monkeypatch):
    """The standby imports the project as it starts; `prepare` (after the save that restarts the server) reads from
    disk again only the modules whose file changed and those importing them: the others are the objects imported
    before (not read twice)."""
    from tsdev.launch import standby

    package = tmp_path / "pkgx"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("VALUE = 1\n")
    (package / "b.py").write_text("from pkgx.a import VALUE\n")  # imports the edited module
    (package / "c.py").write_text("from . import d\n")  # does not
    (package / "d.py").write_text("")
    (package / "top.py").write_text("import pkgx.b\nimport pkgx.c\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(standby, "PROJECT_PACKAGES", ("pkgx",))
    monkeypatch.setattr(standby, "ENTRY_MODULES", ("pkgx.top",))
    try:
        project = standby.Project()
        project.import_now()
        before = {name: sys.modules[name] for name in ("pkgx", "pkgx.a", "pkgx.b", "pkgx.c", "pkgx.d", "pkgx.top")}
        assert project.changed() == set()
        (package / "a.py").write_text("VALUE = 22\n")  # the save
        stamp = os.stat(package / "a.py").st_mtime_ns - 10 ** 9  # another stamp (a coarse clock may not move)
        os.utime(package / "a.py", ns=(stamp, stamp))
        assert project.changed() == {"pkgx.a", "pkgx.b", "pkgx.top"}
        project.refresh()
        assert sys.modules["pkgx.b"].VALUE == 22 and sys.modules["pkgx.b"] is not before["pkgx.b"]
        assert sys.modules["pkgx.top"] is not before["pkgx.top"] and sys.modules["pkgx.top"].pkgx.b.VALUE == 22
        assert all(sys.modules[name] is before[name] for name in ("pkgx", "pkgx.c", "pkgx.d"))  # not read again
        assert project.changed() == set()  # what was imported again is noted as it is now
        (package / "d.py").write_text("X = 3\n")  # saved later, with no `prepare` (a crashed server's restart)
        os.utime(package / "d.py", ns=(stamp - 10 ** 9, stamp - 10 ** 9))
        project.refresh()  # as the arguments arrive
        assert sys.modules["pkgx.c"].d.X == 3 and sys.modules["pkgx.b"] is not before["pkgx.b"]
    finally:
        for name in [n for n in sys.modules if n == "pkgx" or n.startswith("pkgx.")]:
            del sys.modules[name]


def test_the_standby_receives_the_weights_while_it_imports_what_the_save_changed(make_engine, tmp_path, monkeypatch):
    """The stopping server waits for the standby's copy, not for its re-import of the edit's modules: the offer is
    answered while `refresh` is still running (a refresh that waits for the answer would never end)."""
    import threading

    from tsdev.launch import standby
    from tsdev_runtime.weights import handover

    engine, path = make_engine(), str(tmp_path / "w.sock")
    monkeypatch.setenv(handover.ENV, path)
    listener = handover.Listener(path)
    open(handover.restart_marker(path), "w").close()
    answered, outcome = threading.Event(), {}

    def stop_the_old_server():
        outcome["words"] = engine.runner.offer_weights(listener, engine.control.weights_loaded)
        answered.set()

    class Refreshing:
        def refresh(self):
            assert answered.wait(60), "the copy waited for the re-import"

    old = threading.Thread(target=stop_the_old_server)
    old.start()
    received = standby.prepare(Refreshing())
    old.join(60)
    assert received is not None and received.tensors
    assert outcome["words"].startswith(f"{len(received.tensors)} tensors copied by the standby")
