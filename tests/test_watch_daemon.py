"""The watch daemon against an in-process fake server: what it asks the server for, and when."""
import asyncio

import pytest

from fake_server import URL, FakeServer, failed_worker, make_project, ok_worker, paced_probe, until
from tsdev_runtime.control_protocol import ReloadFinished, ReloadStarted, ReloadStep, StaleDefinition
from tsdev.watch.args import WatchConfig, split_server_args
from tsdev.watch.daemon import Daemon
from tsdev.watch.records import ReloadRecord

SERVE_FLAGS = {"--device": True, "--port": True, "--cudagraph-capture-sizes": True, "--enforce-eager": False,
               "--model": True}


async def running(project, server: FakeServer, events: list, **config):
    daemon = Daemon(WatchConfig(attach=URL, project=project, probe_batch=2, probe_steps=4, **config), events.append,
                    server.transport())
    task = asyncio.create_task(daemon.run())
    await until(lambda: any(e.kind == "message" and e.text.startswith("watching") for e in events))
    await asyncio.sleep(0.2)
    return daemon, task


def finished(events) -> list[ReloadRecord]:
    return [e.record for e in events if e.kind == "reload_finished"]


async def stop(daemon, task) -> None:
    daemon.stop()
    assert await asyncio.wait_for(task, 10) == 0


def session(project, server: FakeServer, act, done=finished) -> list:
    """Start the daemon, run `act(daemon)` once it watches, wait until `done(events)`, stop; the events."""
    events = []

    async def main():
        daemon, task = await running(project, server, events)
        act(daemon)
        await until(lambda: done(events))
        await stop(daemon, task)

    asyncio.run(main())
    return events


@pytest.mark.slow
def test_saves_during_a_reload_are_coalesced_into_one_next_reload(tmp_path):
    project, server, events = make_project(tmp_path), FakeServer(), []
    server.reload_delay = 0.8

    async def main():
        daemon, task = await running(project, server, events)
        (project / "kernels/tsdev_kernels/ops/act.py").write_text("def act(x):\n    return 2 * x\n")
        await until(lambda: len(server.reloads) == 1)
        (project / "runtime/tsdev_runtime/layers/norm.py").write_text("X = 2\n")  # both while the first reload runs
        await asyncio.sleep(0.3)
        (project / "kernels/tsdev_kernels/ops/act.py").write_text("def act(x):\n    return 3 * x\n")
        await until(lambda: len(finished(events)) == 2)
        await asyncio.sleep(1.0)  # nothing else may follow
        await stop(daemon, task)

    asyncio.run(main())
    assert len(server.reloads) == 2
    assert all(request.modules is None for request in server.reloads)  # the server decides by content
    first, second = finished(events)
    assert (first.files, first.modules) == (["kernels/tsdev_kernels/ops/act.py"], ["tsdev_kernels.ops.act"])
    assert second.files == ["kernels/tsdev_kernels/ops/act.py", "runtime/tsdev_runtime/layers/norm.py"]
    assert second.modules == ["tsdev_kernels.ops.act", "tsdev_runtime.layers.norm"]


def test_each_reload_is_checked_against_the_golden_completion_and_probed(tmp_path, monkeypatch):
    project, server = make_project(tmp_path), FakeServer()
    paced_probe(monkeypatch)
    server.output_changed_at = 5
    events = session(project, server, lambda daemon: (project / "kernels/tsdev_kernels/ops/act.py").write_text(
        "def act(x):\n    return -x\n"))
    record = finished(events)[0]
    assert (record.ok and record.reloaded == ["tsdev_kernels.ops.act"]
            and record.dependents == ["tsdev_runtime.layers.norm"])
    assert record.steps["warm"] == pytest.approx(0.123) and record.steps["recapture"] == pytest.approx(0.456)
    assert record.verdict.position == 5 and "output changed at token 5 of 24" in record.verdict.text()
    assert record.probe is not None and record.probe.previous is not None  # compared with the startup probe
    assert record.probe.delta == pytest.approx(0.0, abs=1e-9)  # both at the paced 4 ms a step


def test_a_failed_reload_keeps_its_error_and_skips_the_checks(tmp_path):
    project, server = make_project(tmp_path), FakeServer()
    error = f"{project}/kernels/ops/act.py:2: SyntaxError: invalid syntax"
    server.answer = lambda request: failed_worker(error)
    events = session(project, server, lambda daemon: (project / "kernels/tsdev_kernels/ops/act.py").write_text(
        "def act(x):\n    return x)\n"))
    record = finished(events)[0]
    assert record.error == error and record.verdict is None and record.probe is None


def test_reload_all_forces_every_module_the_server_has_imported(tmp_path):
    project, server = make_project(tmp_path), FakeServer()
    (project / "kernels/tsdev_kernels/ops/unused.py").write_text("Z = 0\n")
    server.loaded = ["tsdev_kernels.ops", "tsdev_kernels.ops.act", "tsdev_runtime.layers", "tsdev_runtime.layers.norm",
                     "tsdev_runtime.models.x"]
    server.answer = lambda request: ok_worker(reloaded=request.modules)
    events = session(project, server, lambda daemon: daemon.reload_all())
    assert [request.modules for request in server.reloads] == [
        # on disk and imported
        ["tsdev_kernels.ops", "tsdev_kernels.ops.act", "tsdev_runtime.layers", "tsdev_runtime.layers.norm"]]
    assert finished(events)[0].ok


def test_reload_all_without_the_modules_route_forces_what_is_on_disk(tmp_path):
    project, server = make_project(tmp_path), FakeServer()
    server.answer = lambda request: ok_worker(reloaded=request.modules)
    session(project, server, lambda daemon: daemon.reload_all())
    assert server.reloads[0].modules == ["tsdev_kernels.ops", "tsdev_kernels.ops.act", "tsdev_runtime.layers",
                                         "tsdev_runtime.layers.norm"]


def test_reloads_by_other_clients_appear_and_are_checked(tmp_path):
    project, server = make_project(tmp_path), FakeServer()
    hook = [ReloadStarted(id="hook-1", n=1, modules=["tsdev_kernels.ops.act"]),
            ReloadStep(id="hook-1", step="drain", state="started"),
            ReloadStep(id="hook-1", step="drain", state="done", seconds=0.25),
            ReloadFinished(type="reload_finished", id="hook-1", n=1, worker=ok_worker())]
    events = session(project, server, lambda daemon: server.pending_events.extend(hook))
    record = finished(events)[0]
    assert record.trigger == "another client" and record.modules == ["tsdev_kernels.ops.act"]
    assert record.steps["drain"] == pytest.approx(0.011)  # the reply's timings win over the live ones
    assert record.verdict is not None and record.verdict.same and record.probe is not None
    assert server.reloads == []  # the daemon did not reload again


def test_an_edit_outside_the_reloadable_packages_cannot_restart_an_attached_server(tmp_path):
    project, server = make_project(tmp_path), FakeServer()
    events = session(project, server,
                     lambda daemon: (project / "runtime/tsdev_runtime/engine/scheduler.py").write_text("Y = 2\n"),
                     done=lambda events: any(e.level == "warning" for e in events))
    warning = next(e.text for e in events if e.level == "warning")
    assert "tsdev_runtime.engine.scheduler changed outside the reloadable packages" in warning
    assert "restart it yourself" in warning and server.reloads == []


def test_a_reload_that_needs_a_restart_says_so_in_its_line(tmp_path):
    from tsdev.watch.plain import reload_line

    project, server = make_project(tmp_path), FakeServer()
    worker = ok_worker(needs_restart=["tsdev_runtime.engine.scheduler"])  # tsdev_kernels.ops.act reloaded as well
    hook = [ReloadStarted(id="hook-1", n=1), ReloadFinished(type="reload_finished", id="hook-1", n=1, worker=worker)]
    events = session(project, server, lambda daemon: server.pending_events.extend(hook),
                     done=lambda events: finished(events) and any(e.level == "warning" for e in events))
    record = finished(events)[0]
    assert record.restart == ("needs restart: tsdev_runtime.engine.scheduler changed outside the reloadable packages → "
                              "restart it yourself (attached)")  # a server tsdev watch started: "restarting the server"
    line = reload_line(record)
    assert line.startswith("reload #1 [green]ok[/green]") and line.endswith(f"[yellow]{record.restart}[/yellow]")


@pytest.mark.parametrize("each", [False, True], ids=["p-key-profiles-the-next-reload", "profile-each-reload"])
def test_profiling_covers_the_next_reload_or_every_reload(tmp_path, each):
    project, server, events = make_project(tmp_path), FakeServer(), []

    async def main():
        daemon, task = await running(project, server, events)
        if each:
            daemon.config.profile_each_reload = True
        else:
            daemon.arm_profile()
        for n in (1, 2):
            (project / "kernels/tsdev_kernels/ops/act.py").write_text(f"def act(x):\n    return x + {n}\n")
            await until(lambda: len(finished(events)) == n)
        await stop(daemon, task)

    asyncio.run(main())
    names = [p.name for p in server.profiles]
    assert names == (["watch-reload-1", "watch-reload-2"] if each else ["watch-reload-1"])
    assert all(p.activities == ["TORCH"] and p.num_steps == 4 for p in server.profiles)


def test_server_flags_pass_through_and_model_is_found():
    assert split_server_args(["--device", "cpu", "/models/qwen3", "--cudagraph-capture-sizes", "1,16,64",
                              "--enforce-eager", "--port=9000"], SERVE_FLAGS) == (
        "/models/qwen3", ["--device", "cpu", "--cudagraph-capture-sizes", "1,16,64", "--enforce-eager", "--port=9000"])
    with pytest.raises(ValueError, match="--devcie"):
        split_server_args(["--devcie", "cpu"], SERVE_FLAGS)
    with pytest.raises(ValueError, match="at most one MODEL"):
        split_server_args(["a", "b"], SERVE_FLAGS)



def test_a_reload_line_carries_the_replys_warnings_and_stale_definitions():
    from tsdev.watch.plain import reload_line

    record = ReloadRecord(1, "save", files=["kernels/tsdev_kernels/ops/act.py"], done=True)
    record.worker = ok_worker(warnings=["compiling ahead failed, kernels compile during the warm step: boom"],
                              stale=[StaleDefinition(name="tsdev_kernels.ops.act.Table")])
    record.steps.update(record.worker.timings)
    line = reload_line(record)
    assert "jit 0.08 drain 0.01" in line and "recapture 0.46 (decode 0.30, prefill 0.16) pause 0.63" in line
    assert "warning: compiling ahead failed, kernels compile during the warm step: boom" in line
    assert "stale (could not be patched): tsdev_kernels.ops.act.Table" in line


def test_a_reload_on_two_ranks_shows_a_line_per_rank(tmp_path):
    from tsdev.watch.plain import reload_line

    project, server, events = make_project(tmp_path), FakeServer(), []
    server.answer = lambda request: [ok_worker(),
                                     failed_worker("rank 1 refuses this edit").model_copy(update={"rank": 1})]

    async def main():
        daemon, task = await running(project, server, events)
        (project / "kernels/tsdev_kernels/ops/act.py").write_text("def act(x):\n    return x + 1\n")
        await until(lambda: len(finished(events)) == 1)
        await stop(daemon, task)

    asyncio.run(main())
    record = finished(events)[0]
    assert [w.rank for w in record.ranks] == [0, 1] and record.error == "rank 1 refuses this edit"
    lines = reload_line(record).splitlines()
    assert lines[0].startswith("reload #1 [red]FAILED[/red]")
    assert lines[1].startswith("  [dim]rank 0:[/dim] [green]ok[/green] | jit 0.08")
    assert lines[2] == "  [dim]rank 1:[/dim] [red]FAILED[/red]: rank 1 refuses this edit"


@pytest.mark.parametrize("has_route", [True, False], ids=["server-info", "older-server-without-it"])
def test_model_and_device_come_from_server_info_else_from_v1_models(tmp_path, has_route):
    project, server, events = make_project(tmp_path), FakeServer(), []
    if not has_route:
        server.info = None

    async def main():
        daemon, task = await running(project, server, events)
        await stop(daemon, task)
        return daemon.info

    info = asyncio.run(main())
    assert (info["model"], info["device"]) == ("fake-model", "cpu" if has_route else None)


def test_the_daemon_shows_the_phase_the_server_publishes_and_skips_its_checks_unless_serving(tmp_path):
    """The daemon reads the server's published phase (Hello, StateChanged), as the server sends them beside its
    Sleeping / Awake / Paused events, instead of rebuilding it from those: awake without weights is not serving."""
    from tsdev_runtime.control_protocol import Awake, Continued, Paused, Sleeping, StateChanged

    project, server, events = make_project(tmp_path), FakeServer(), []

    async def main():
        daemon, task = await running(project, server, events)
        server.pending_events += [Sleeping(level=2, freed_bytes=10), StateChanged(state="sleeping")]
        await until(lambda: daemon.info["state"] == "sleeping")
        assert any("server sleeping (level 2)" in (e.text or "") for e in events if e.kind == "message")
        server.pending_events += [Awake(weights_loaded=False), StateChanged(state="weights_unloaded")]
        await until(lambda: any("weights not loaded" in (e.text or "") for e in events if e.kind == "message"))
        assert daemon.info["state"] == "sleeping" and daemon.sleeping  # no weights: the checks would fail
        server.pending_events.append(StateChanged(state="serving"))  # a weight load
        await until(lambda: daemon.info["state"] == "serving")
        server.pending_events += [Paused(mode="keep"), StateChanged(state="paused")]
        await until(lambda: daemon.info["state"] == "paused")
        assert daemon.paused and not daemon.sleeping
        server.pending_events += [Continued(), StateChanged(state="serving")]
        await until(lambda: daemon.info["state"] == "serving")
        await stop(daemon, task)

    asyncio.run(main())


def test_save_to_serving_ends_when_serving_resumes_and_its_parts_add_up(tmp_path):
    """A reload whose report-mode checks run 0.8 s after serving resumed: the figure stops at the resume, and the
    settle, jit, check inputs, pause and read+plan add up to it."""
    from tsdev.watch.plain import serving_text

    project, server = make_project(tmp_path), FakeServer()
    timings = {"jit": 0.21, "check_prepare": 0.04, "drain": 0.0, "reload": 0.03, "pause": 0.06, "resumed": 0.35,
               "kernel_check": 0.8, "total": 1.15}
    server.answer = lambda request: [ok_worker().model_copy(update={"timings": timings})]
    events = session(project, server, lambda daemon: (project / "kernels/tsdev_kernels/ops/act.py").write_text(
        "def act(x):\n    return -x\n"))
    record = finished(events)[0]
    split = dict(record.serving_split())
    assert set(split) == {"settle", "jit", "check inputs", "pause", "read+plan"}
    assert abs(sum(split.values()) - record.served_after_save) < 0.010
    assert split["jit"] == 0.21 and split["pause"] == 0.06 and 0 <= split["read+plan"] < 0.5
    assert record.served_after_save < record.settle + timings["total"]  # not the checks that followed
    assert "(then 0.80 s checking, serving)" in serving_text(record)


def test_the_next_standby_starts_after_the_new_servers_checks_not_beside_them():
    """The standby imports torch and initializes CUDA: started while the golden check and the decode probe run, it
    made a restart's figure 44-98 % slower than the edit made it. The probe comes first, then the standby."""
    from types import SimpleNamespace

    from tsdev.watch.records import RestartRecord
    from tsdev.watch.restarts import Restarts

    order = []

    async def describe():
        return SimpleNamespace(vocab=100, model="m", device="cuda", startup={}, moments={})

    async def check(record, golden):
        order.append("probe")

    daemon = SimpleNamespace(
        link=SimpleNamespace(describe=describe), checker=SimpleNamespace(vocab=None), info={}, check=check,
        server=SimpleNamespace(start_standby=lambda: order.append("standby")), set_state=lambda *a, **k: None,
        emit=lambda *a: None)
    asyncio.run(Restarts(daemon)._after_start(RestartRecord(1, "an engine edit"), take_golden=False))
    assert order == ["probe", "standby"]


def test_the_probe_waits_for_pending_graphs_and_a_figure_taken_beside_them_is_marked_not_comparable(tmp_path,
                                                                                                 monkeypatch):
    from tsdev.watch import daemon as daemon_module

    monkeypatch.setattr(daemon_module, "QUIET_S", 0.3)
    project, server = make_project(tmp_path), FakeServer()
    server.info = server.info.model_copy(update={"graphs_pending": 3})  # never done capturing
    events = session(project, server, lambda daemon: (project / "kernels/tsdev_kernels/ops/act.py").write_text(
        "def act(x):\n    return -x\n"))
    record = finished(events)[0]
    assert "decode not comparable: 3 CUDA graph(s) were still being captured" in record.note
    # taken, and compared only with a quiet figure: the startup's was not one either, so none
    assert record.probe is not None and record.probe.previous is None


def test_the_probe_runs_128_steps_on_a_gpu_and_32_on_the_cpu_unless_told():
    from tsdev.watch.checks import Checker

    checker = Checker(link=None, config=WatchConfig(attach=URL), message=print)
    assert checker.probe_steps == 32  # not known yet: as on the CPU
    checker.device = "cuda"
    assert checker.probe_steps == 128
    checker.device = "cpu"
    assert checker.probe_steps == 32
    assert Checker(link=None, config=WatchConfig(attach=URL, probe_steps=7), message=print).probe_steps == 7


def test_the_decode_figure_is_a_fit_over_every_chunk_so_one_late_chunk_hardly_moves_it():
    """The probe's ms/step once was the span from the first decode chunk to the last: a last chunk 20 ms late (the
    daemon's event loop drawing the TUI) moved it by 10-20 % on the H200. A least-squares slope over every chunk."""
    from tsdev.watch.checks import seconds_per_token

    step = 0.0014
    arrivals = [(0.0, 1)] + [(0.05 + i * step, 1 + i) for i in range(1, 128)]  # prefill, then a token per step
    assert seconds_per_token(arrivals) == pytest.approx(step, rel=1e-9)
    late = arrivals[:-1] + [(arrivals[-1][0] + 0.02, arrivals[-1][1])]
    assert seconds_per_token(late) == pytest.approx(step, rel=0.01)
    bursts = [arrivals[0]] + [a for i, a in enumerate(arrivals[1:]) if i % 3 == 2]  # three tokens a chunk
    assert seconds_per_token(bursts) == pytest.approx(step, rel=1e-6)
    assert seconds_per_token(arrivals[:2]) is None  # one decode chunk: no slope


def test_the_probe_takes_rounds_until_two_agree_and_its_figure_is_the_faster_of_them():
    """What slows a round (the host busy: the H200's decode at batch 8 is host-bound) only adds time, and a round
    alone far below the others is the client reading a burst late (0.01 ms/step on a loaded 2-core CI machine):
    the figure is the faster of the fastest two rounds that agree within 3 %; five rounds without two that agree
    give their median, marked and not compared (the last steady figure stays the baseline)."""
    from tsdev.watch.checks import Probe, until_steady

    def taking(figures):
        given = iter(figures)

        async def take_round():
            return next(given)
        return take_round

    assert asyncio.run(until_steady(taking([5.0, 5.1, 9.9]))) == [5.0, 5.1]  # two agree: done
    assert asyncio.run(until_steady(taking([6.0, 4.0, 4.1, 9.9]))) == [6.0, 4.0, 4.1]
    assert asyncio.run(until_steady(taking([0.01, 4.0, 4.1, 9.9]))) == [0.01, 4.0, 4.1]
    unsteady = asyncio.run(until_steady(taking([6.0, 4.0, 5.0, 4.5, 7.0, 9.9])))
    assert unsteady == [6.0, 4.0, 5.0, 4.5, 7.0]  # at most five
    assert Probe([6.0, 4.0, 4.1], 8, previous=4.4).text() == "decode 4.00 ms/step at batch 8 (-0.40 ms, -9.1%)"
    assert Probe([0.01, 4.0, 4.1], 8, previous=4.0).ms == 4.0  # the lone fast round is not the figure
    assert Probe([4.0, 4.1], 8).text() == "decode 4.00 ms/step at batch 8 (not compared: no earlier figure was steady)"
    assert Probe([4.0, 4.1], 8, first=True).text() == "decode 4.00 ms/step at batch 8"  # the startup's: a baseline
    probe = Probe(unsteady, 8, previous=4.4)
    assert probe.delta is None and probe.text() == (
        "decode 5.00 ms/step at batch 8 (unsteady, not compared: no two of 5 rounds within 3 %, 4.00-7.00 ms)")


def test_the_probe_measures_each_round_through_the_completions_route():
    """Each round: the streams' fitted step times, their median; here the server's steps take 12, 4, 8 ms, then 4."""
    import json

    import httpx

    from tsdev.watch.checks import decode_ms

    step_seconds, served = [0.012, 0.004, 0.008, 0.004], []

    async def stream(step: float, tokens: int):
        for i in range(tokens):
            await asyncio.sleep(step)
            yield f"data: {json.dumps({'choices': [{'text': 'x', 'token_ids': [i]}]})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        served.append(body["max_tokens"])
        step = step_seconds[min((len(served) - 1) // 2, 3)]  # two streams a round
        return httpx.Response(200, content=stream(step, body["max_tokens"]))

    async def probe() -> list[float]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await decode_ms(client, URL, vocab=256, batch=2, steps=12)

    rounds = asyncio.run(probe())
    assert len(rounds) >= 3 and len(served) == 2 * len(rounds) and set(served) == {12}
    assert rounds[1] < rounds[2] < rounds[0] and min(rounds) < 0.6 * rounds[0]  # each round its own steps' time


def test_a_saved_kernel_file_is_built_as_soon_as_it_is_seen_before_the_settled_reload(tmp_path):
    """The settle is on the path from save to serving: the new text goes to compile_ahead at its first sight, so
    the reload that follows the settle finds its kernels built or being built. Only reloadable files whose text
    parses; the daemon's own builds are not shown as an editor's buffer."""
    project, server, events = make_project(tmp_path), FakeServer(), []
    act, text = project / "kernels/tsdev_kernels/ops/act.py", "def act(x):\n    return 4 * x\n"

    async def main():
        daemon, task = await running(project, server, events, settle=0.3)  # the build asked for well before it ends
        act.write_text(text)
        await until(lambda: len(finished(events)) == 1)
        (project / "runtime/tsdev_runtime/layers/norm.py").write_text("X = (\n")  # mid-edit: does not parse
        await until(lambda: len(finished(events)) == 2)
        await asyncio.sleep(1.2)  # the events connection comes back (0.5 s) with the builds' events
        await stop(daemon, task)
        return daemon

    daemon = asyncio.run(main())
    assert server.calls == ["build", "reload", "reload"]
    (build,) = server.builds
    assert (build.path, build.text) == (str(act.resolve()), text)
    assert build.id.startswith(daemon.reloads.session)
    assert not [e for e in events if e.kind == "message" and "editor's buffer" in e.text]
    assert finished(events)[0].files == ["kernels/tsdev_kernels/ops/act.py"]


def test_with_build_on_sight_off_only_the_reload_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("TSDEV_WATCH_BUILD_ON_SIGHT", "0")
    project, server = make_project(tmp_path), FakeServer()
    act = project / "kernels/tsdev_kernels/ops/act.py"
    session(project, server, lambda daemon: act.write_text("def act(x):\n    return 5 * x\n"))
    assert server.calls == ["reload"] and server.builds == []


@pytest.mark.parametrize("name, value", [("TSDEV_WATCH_BUILD_ON_SIGHT", "off"), ("TSDEV_RESTART_WEIGHTS", "reread")])
def test_a_switch_with_a_value_it_does_not_know_is_refused_naming_the_values_it_takes(tmp_path, monkeypatch, name,
                                                                                      value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}': .*\\(.*\\) or "):
        Daemon(WatchConfig(project=make_project(tmp_path)), lambda event: None)
