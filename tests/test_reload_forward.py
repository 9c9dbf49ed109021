"""reload_forward against a `tsdev serve --allow-reload-forward` subprocess running a temporary copy of the project."""
import re
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from typer.testing import CliRunner

from tsdev_runtime.control_protocol import (ModulesReply, PauseReply, ReloadFinished, ReloadReply, ReloadStarted,
                                      ReloadStep, WorkerReport, parse_event)
from serve_process import copy_project, serve
from tsdev.cli import app
from tsdev.client import iter_sse_data

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)

PROMPT = {"prompt": [5, 17, 300, 42, 9, 77, 123], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
ACTIVATION = "kernels/tsdev_kernels/ops/activation.py"
SILU_LINE = "    return F.silu(gate) * up\n"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="module")
def server(project, tiny_model_dir):
    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024", "--allow-reload-forward",
            "--cudagraph-capture-sizes", "1", "4"]
    with serve(args, project / "serve.log", cwd=project) as url:
        yield url


@contextmanager
def edited(project, path, old, new):
    file = project / path
    original = file.read_text()
    assert old in original
    file.write_text(original.replace(old, new))
    try:
        yield
    finally:
        file.write_text(original)


def complete(url, **overrides):
    r = httpx.post(url + "/v1/completions", json={**PROMPT, **overrides}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def reload(url, id_, **body) -> ReloadReply:
    r = httpx.post(url + "/v1/rl/engine/reload_forward", json={"id": id_, **body}, timeout=120)
    assert r.status_code == 200, r.text
    for worker in r.json()["workers"]:  # the wire carries every field of the protocol's worker report, no other
        assert set(worker) == set(WorkerReport.model_fields), worker
    return ReloadReply.model_validate_json(r.content)


_ids = iter(range(10**6))


def new_id() -> str:
    return f"t{next(_ids)}-{time.monotonic_ns()}"


def test_edit_changes_output_and_revert_restores_it(server, project):
    before = complete(server)["text"]
    with edited(project, ACTIVATION, SILU_LINE, "    return -F.silu(gate) * up\n"):
        reply = reload(server, new_id())
        assert reply.ok, reply
        worker = reply.workers[0]
        assert worker.reloaded == ["tsdev_kernels.ops.activation"]
        assert "tsdev_runtime.layers.activation" in worker.dependents and worker.patched > 0
        assert worker.rebuilt == [] and "rebuild" not in worker.timings  # no __init__ changed
        assert set(worker.timings) >= {"drain", "flush", "reload", "warm", "recapture", "jit", "total", "pause",
                                          "recapture_decode", "recapture_prefill"}
        changed = complete(server)["text"]
        assert changed != before
    assert reload(server, new_id()).ok
    assert complete(server)["text"] == before


def test_a_buffer_compiled_ahead_reloads_nothing_and_its_save_reloads_as_any(server, project):
    """`tsdev reload --ahead` (an editor's unsaved buffer, through the API process's relay): nothing reloads, the old
    code keeps serving; the save of that text then reloads. On the CPU nothing is built (Triton's interpreter)."""
    before = complete(server)["text"]
    negated = (project / ACTIVATION).read_text().replace(SILU_LINE, "    return -F.silu(gate) * up\n")
    ahead = CliRunner().invoke(app, ["reload", "--url", server, "--ahead", str(project / ACTIVATION), "--stdin"],
                               input=negated)
    assert ahead.exit_code == 0 and "nothing to compile ahead: on cpu" in ahead.output, ahead.output
    assert complete(server)["text"] == before
    with edited(project, ACTIVATION, SILU_LINE, "    return -F.silu(gate) * up\n"):
        worker = reload(server, new_id()).workers[0]
        assert worker.ok and worker.reloaded == ["tsdev_kernels.ops.activation"]
        assert complete(server)["text"] != before
    assert reload(server, new_id()).ok and complete(server)["text"] == before


def test_syntax_error_is_reported_and_old_code_keeps_serving(server, project):
    before = complete(server)["text"]
    with edited(project, ACTIVATION, SILU_LINE, "    return F.silu(gate) * up)\n"):
        reply = reload(server, new_id())
        assert reply.ok is False
        error = reply.workers[0].error
        assert "activation.py:" in error and "SyntaxError" in error
        assert complete(server)["text"] == before
    assert reload(server, new_id()).ok  # the reverted file still differs from nothing: a no-op reload


def test_error_in_warm_up_rolls_back(server, project):
    before = complete(server)["text"]
    with edited(project, ACTIVATION, SILU_LINE, "    raise RuntimeError('kernel exploded')\n"):
        reply = reload(server, new_id())
        assert reply.ok is False
        assert "kernel exploded" in reply.workers[0].error and "activation.py:" in reply.workers[0].error
        assert complete(server)["text"] == before


def test_edit_outside_reloadable_packages_needs_restart(server, project):
    with edited(project, "runtime/tsdev_runtime/engine/scheduler.py", '"""Continuous batching',
                '"""Edited. Continuous batching'):
        worker = reload(server, new_id()).workers[0]
        assert worker.needs_restart == ["tsdev_runtime.engine.scheduler"]
        assert worker.reloaded == []


def test_forced_module_reloads_without_a_change(server):
    worker = reload(server, new_id(), modules=["tsdev_kernels.ops.norm"]).workers[0]
    assert worker.ok and worker.reloaded == ["tsdev_kernels.ops.norm"] and worker.dependents
    assert "tsdev_runtime.layers.norm" in worker.dependents and worker.rebuilt == []  # re-executed, same __init__
    bad = reload(server, new_id(), modules=["no.such.module"])
    assert bad.ok is False and "no.such.module" in bad.workers[0].error


def test_the_server_logs_one_line_per_reload_with_its_outcome(server, project):
    ok, failed = new_id(), new_id()
    worker = reload(server, ok, modules=["tsdev_kernels.ops.norm"]).workers[0]
    with edited(project, ACTIVATION, SILU_LINE, "    return F.silu(gate) * up)\n"):
        assert not reload(server, failed).ok
    log = (project / "serve.log").read_text()
    assert (f"reload {ok} ok: tsdev_kernels.ops.norm + {len(worker.dependents)} dependent(s), "
            f"paused {worker.timings['pause']:.2f} s\n") in log
    line = next(line for line in log.splitlines() if line.startswith(f"reload {failed} "))
    assert line.startswith(f"reload {failed} FAILED in reload: ") and "activation.py:" in line and "SyntaxError" in line


def test_modules_route_lists_what_a_reload_can_force(server):
    modules = ModulesReply.model_validate_json(httpx.get(server + "/v1/rl/engine/modules").content).modules
    assert {"tsdev_kernels.ops.activation", "tsdev_runtime.layers.norm", "tsdev_runtime.models.qwen3"} <= set(modules)
    assert not any(m.startswith("tsdev_runtime.engine") for m in modules)


def test_same_id_returns_the_first_outcome_without_reloading_again(server):
    rid = new_id()
    first = reload(server, rid, modules=["tsdev_kernels.ops.norm"])
    second = reload(server, rid, modules=["tsdev_kernels.ops.norm"])
    assert first == second  # timings included: it did not run twice


def stream_completion(url, results, index, **overrides):
    text, reasons = "", []
    with httpx.stream("POST", url + "/v1/completions", json={**PROMPT, "stream": True, **overrides}, timeout=120) as r:
        for event in iter_sse_data(r):
            if "error" in event:
                reasons.append("error")
                continue
            text += event["choices"][0]["text"]
            if event["choices"][0]["finish_reason"]:
                reasons.append(event["choices"][0]["finish_reason"])
    results[index] = (text, reasons)


def start_streams(url, n, **overrides):
    results = [None] * n
    threads = [threading.Thread(target=stream_completion, args=(url, results, i), kwargs=overrides) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    return threads, results


def test_streams_in_flight_complete_across_a_reload(server):
    threads, results = start_streams(server, 4, max_tokens=300)
    reply = reload(server, new_id(), modules=["tsdev_kernels.ops.activation"])
    late = complete(server, max_tokens=5)  # arrives after the reload: served by the new code
    for t in threads:
        t.join(60)
    assert reply.ok
    assert [r[1] for r in results] == [["length"]] * 4, results  # each ended once, by length, no error
    assert late["finish_reason"] == "length"


def test_abort_mode_aborts_running_requests_with_a_reason(server):
    threads, results = start_streams(server, 3, max_tokens=900)
    reply = reload(server, new_id(), modules=["tsdev_kernels.ops.activation"], mode="abort")
    for t in threads:
        t.join(60)
    assert reply.ok
    assert all(reasons == ["abort"] for _, reasons in results), results


def test_drain_timeout_gives_up_cleanly_and_names_the_step(server):
    threads, results = start_streams(server, 1, max_tokens=900)
    reply = reload(server, new_id(), modules=["tsdev_kernels.ops.activation"], timeout_s=0.2)
    for t in threads:
        t.join(60)
    assert reply.ok is False and "drain" in reply.workers[0].error
    assert results[0][1] == ["length"]  # the running request was not disturbed


def test_concurrent_reloads_run_one_after_the_other(server):
    events = []
    marker = new_id()

    def listen():
        with httpx.stream("GET", server + "/v1/rl/engine/events", timeout=60) as r:
            for data in iter_sse_data(r):
                events.append(event := parse_event(data))
                if getattr(event, "id", None) == marker:
                    return

    listener = threading.Thread(target=listen)
    listener.start()
    time.sleep(0.3)
    ids = [new_id(), new_id()]
    replies = [None, None]
    workers = [threading.Thread(target=lambda i=i: replies.__setitem__(
                   i, reload(server, ids[i], modules=["tsdev_kernels.ops.norm"])))
               for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    reload(server, marker, modules=["tsdev_kernels.ops.norm"])  # its first event ends the listener
    listener.join(30)
    assert all(r.ok for r in replies)
    mine = [e for e in events if getattr(e, "id", None) in ids]
    starts = [i for i, e in enumerate(mine) if isinstance(e, ReloadStarted)]
    ends = [i for i, e in enumerate(mine) if isinstance(e, ReloadFinished) and e.type == "reload_finished"]
    assert len(starts) == 2 and len(ends) == 2 and ends[0] < starts[1]  # serialized
    steps = [e.step for e in mine[: ends[0]] if isinstance(e, ReloadStep) and e.state == "done"]
    assert steps == ["jit", "drain", "flush", "reload", "warm", "recapture"]
    assert all(e.seconds >= 0 for e in mine if isinstance(e, ReloadStep) and e.state != "started")


def test_pause_is_kept_across_a_reload_and_continue_resumes(server):
    assert PauseReply.model_validate_json(httpx.post(server + "/v1/rl/engine/pause_generation",
                                                     json={"mode": "keep"}).content).paused
    results = [None]
    t = threading.Thread(target=stream_completion, args=(server, results, 0), kwargs={"max_tokens": 3})
    t.start()
    assert reload(server, new_id(), modules=["tsdev_kernels.ops.norm"]).ok
    time.sleep(0.5)
    assert results[0] is None  # still paused: the request is held
    httpx.post(server + "/v1/rl/engine/continue_generation", json={})
    t.join(30)
    assert results[0][1] == ["length"]


def test_reload_is_refused_without_the_flag(tiny_model_dir, tmp_path):
    with serve([str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024"], tmp_path / "log") as url:
        threads, results = start_streams(url, 1, max_tokens=200)
        r = httpx.post(url + "/v1/rl/engine/reload_forward", json={"id": "x"})
        assert r.status_code == 403 and "--allow-reload-forward" in r.json()["error"]["message"]
        assert httpx.get(url + "/v1/rl/engine/modules").status_code == 403
        refused = tsdev_reload(url)
        assert refused.exit_code == 2 and "403" in refused.output and "--allow-reload-forward" in refused.output
        threads[0].join(60)
        assert results[0][1] == ["length"]


def until(server, holds, timeout_s: float = 60.0) -> None:
    """Wait until `holds(server_info, load)`: what the server says, not a sleep that a loaded machine outlasts."""
    deadline = time.monotonic() + timeout_s  # a hang guard, not a speed bound
    while not holds(httpx.get(server + "/server_info").json(), httpx.get(server + "/load").json()):
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.01)


def requests_running(server) -> int:
    """The engine's admitted requests (/metrics' tsdev_requests_running): /load counts the queued ones too."""
    metrics = httpx.get(server + "/metrics").text
    return int(float(next(line.split()[-1] for line in metrics.splitlines()
                          if line.startswith("tsdev_requests_running"))))


def test_continue_generation_cancels_a_reload_that_has_not_started(server):
    """A second reload waiting for its turn while the first drains a stream is cancelled by continue_generation. The
    wait only lasts while the stream runs: on a loaded machine the stream may end first (then the second reload just
    runs), so the scene is set up again, up to three times, until the second is seen waiting."""
    for attempt in range(3):
        threads, results = start_streams(server, 1, max_tokens=1000)  # keeps the first reload draining a while
        # admitted before the first reload holds admission (a stream still queued then left nothing to drain)
        until(server, lambda info, load: requests_running(server) == 1)
        replies = {}
        first = threading.Thread(target=lambda: replies.__setitem__(
            "first", reload(server, new_id(), modules=["tsdev_kernels.ops.norm"])))
        first.start()
        until(server, lambda info, load: info["state"] == "holding" or "first" in replies)  # it drains the stream
        second = threading.Thread(target=lambda: replies.__setitem__(
            "second", reload(server, new_id(), modules=["tsdev_kernels.ops.norm"])))
        second.start()
        until(server, lambda info, load: load.get("reloads_waiting") == 1 or "second" in replies)
        waiting = "second" not in replies  # seen waiting for its turn (not yet answered)
        if waiting:
            assert httpx.post(server + "/v1/rl/engine/continue_generation", json={}, timeout=60).status_code == 200
        for t in (first, second, *threads):
            t.join(60)
        if waiting:
            break
    assert waiting, "in three tries the stream never outlasted the second reload's arrival"
    assert replies["first"].ok
    assert replies["second"].ok is False and "cancelled" in replies["second"].workers[0].error


# --- `tsdev reload`: exit status and what it shows while it waits -------------------------------------------

SCHEDULER = "runtime/tsdev_runtime/engine/scheduler.py"
SCHEDULER_DOC = ('"""Continuous batching', '"""Edited. Continuous batching')


def tsdev_reload(url, *args):
    return CliRunner().invoke(app, ["reload", "--url", url, *args])


def test_reload_exit_status_0_when_reloaded_or_nothing_changed(server, project):
    before = complete(server)["text"]
    with edited(project, ACTIVATION, SILU_LINE, "    return -F.silu(gate) * up\n"):
        done = tsdev_reload(server)
        assert done.exit_code == 0 and done.output.startswith("reloaded tsdev_kernels.ops.activation"), done.output
        assert complete(server)["text"] != before
    revert = tsdev_reload(server)
    assert revert.exit_code == 0 and revert.output.startswith("reloaded tsdev_kernels.ops.activation"), revert.output
    assert complete(server)["text"] == before  # the revert's effect: the output before the edit
    nothing = tsdev_reload(server)
    assert nothing.exit_code == 0 and nothing.output.startswith("nothing to reload"), nothing.output


def test_reload_of_a_file_saved_unchanged_says_nothing_changed(server, project):
    same = tsdev_reload(server, "--file", str(project / ACTIVATION))
    assert same.exit_code == 0 and same.output.startswith(f"nothing changed: {project / ACTIVATION} holds the code "
                                                          "the server runs"), same.output
    with edited(project, ACTIVATION, SILU_LINE, "    return -F.silu(gate) * up\n"):
        saved = tsdev_reload(server, "--file", str(project / ACTIVATION))
        assert saved.exit_code == 0 and saved.output.startswith("reloaded tsdev_kernels.ops.activation"), saved.output
    assert tsdev_reload(server, "--file", str(project / ACTIVATION)).output.startswith("reloaded")  # the revert


def test_reload_exit_status_1_when_the_reload_failed(server, project):
    with edited(project, ACTIVATION, SILU_LINE, "    return F.silu(gate) * up)\n"):
        failed = tsdev_reload(server, "--file", str(project / ACTIVATION))  # as an editor hook runs it
        assert failed.exit_code == 1, failed.output
        assert failed.output.startswith("reload failed") and "activation.py:" in failed.output
    assert tsdev_reload(server).exit_code == 0


def test_reload_exit_status_3_when_an_edit_needs_a_restart_even_if_others_reloaded(server, project):
    with edited(project, SCHEDULER, *SCHEDULER_DOC):
        alone = tsdev_reload(server, "--file", str(project / SCHEDULER))
        assert alone.exit_code == 3, alone.output
        assert alone.output.startswith("needs restart: tsdev_runtime.engine.scheduler changed outside the reloadable "
                                       "packages; restart the server") and "reloaded" not in alone.output
        with edited(project, ACTIVATION, SILU_LINE, "    return -F.silu(gate) * up\n"):
            both = tsdev_reload(server)
            assert both.exit_code == 3, both.output
            assert both.output.startswith("needs restart: tsdev_runtime.engine.scheduler")
            assert "reloaded tsdev_kernels.ops.activation" in both.output  # the reloadable edit did reload
    assert tsdev_reload(server).exit_code == 0  # the reverts: back to the code the server started with


def test_reload_exit_status_2_when_no_server_answers():
    down = tsdev_reload("http://127.0.0.1:9")
    assert down.exit_code == 2 and "cannot reach http://127.0.0.1:9" in down.output


def test_reload_shows_the_drain_waiting_for_running_requests(server):
    threads, results = start_streams(server, 2, max_tokens=900)
    waited = tsdev_reload(server, "--modules", "tsdev_kernels.ops.norm")
    for t in threads:
        t.join(60)
    assert waited.exit_code == 0, waited.output
    lines = waited.output.splitlines()  # not a terminal: plain lines, the first after 0.5 s of draining
    assert re.match(r"draining \d+\.\d s: waiting for 2 running request\(s\) to finish before reloading",
                    lines[0]), lines
    assert re.fullmatch(r"drained in \d+\.\d s", lines[-3]) and lines[-2].startswith("reloaded tsdev_kernels.ops.norm")
    immediate = tsdev_reload(server, "--modules", "tsdev_kernels.ops.norm")
    assert immediate.output.startswith("reloaded tsdev_kernels.ops.norm")  # nothing extra when nothing waits


NORM = "runtime/tsdev_runtime/layers/norm.py"
NORM_WEIGHT = "        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)\n"
NORM_SCALED = NORM_WEIGHT + '        self.register_buffer("scale", torch.full((hidden_size,), 2.0), persistent=False)\n'
NORM_FORWARD = "            return norm_ops.rms_norm(x, self.weight, self.eps)\n"


def test_layer_init_edit_rebuilds_the_model_and_matches_a_fresh_server(server, project, tiny_model_dir):
    """A buffer computed in __init__: the reload rebuilds the norms with the new code, loads the checkpoint again
    and serves what a server started on the edited code serves; reverting rebuilds back."""
    before = complete(server)["text"]
    with edited(project, NORM, NORM_WEIGHT, NORM_SCALED), \
            edited(project, NORM, NORM_FORWARD,
                   "            return norm_ops.rms_norm(x, self.weight * self.scale, self.eps)\n"):
        reply = reload(server, new_id())
        assert reply.ok, reply
        worker = reply.workers[0]
        assert "model.norm" in worker.rebuilt and any(n.endswith("input_layernorm") for n in worker.rebuilt)
        assert "rebuild" in worker.timings and worker.needs_restart == []
        assert not [s for s in worker.stale if s.name == "tsdev_runtime.layers.norm.RMSNorm"]
        rebuilt = complete(server)["text"]
        assert rebuilt != before
        args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024",
                "--cudagraph-capture-sizes", "1", "4"]
        with serve(args, project / "fresh.log", cwd=project) as fresh:
            assert complete(fresh)["text"] == rebuilt
    reply = reload(server, new_id())
    assert reply.ok and reply.workers[0].rebuilt, reply
    assert complete(server)["text"] == before


def test_layer_shape_edit_needs_restart_and_old_model_keeps_serving(server, project):
    before = complete(server)["text"]
    with edited(project, NORM, "torch.ones(hidden_size)", "torch.ones(hidden_size + 1)"):
        reply = reload(server, new_id())
        assert reply.ok is False
        worker = reply.workers[0]
        assert worker.needs_restart == ["tsdev_runtime.layers.norm"]
        assert "needs restart" in worker.error and "shape" in worker.error, worker.error
        assert complete(server)["text"] == before
    assert reload(server, new_id()).ok
    assert complete(server)["text"] == before
