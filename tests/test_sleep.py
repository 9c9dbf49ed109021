"""Sleep / wake_up / is_sleeping and reload_weights (docs/runtime.md, "Sleep, wake and weight reloads"), on CPU: the
same steps as on CUDA, without the memory accounting (tests/test_sleep_gpu.py has that) and with graphs a no-op."""
import dataclasses
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.control_protocol import (CONTINUE_ROUTE, PAUSE_ROUTE, ErrorBody, Hello, ReloadWeightsReply,
                                      SleepReply, SleepStatus, WakeUpReply, parse_event)
from tsdev_runtime.weights.loader import LoadedWeights
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.weights.layout import named_tensors
from tsdev_runtime.engine.weights_drill import DrillFailed, drill, greedy
from tsdev_runtime.server.app import build_app
from tsdev_runtime.server.security import SecurityPolicy
from tsdev_runtime.weights.processing import DEBUG_DERIVED_ENV

COMPLETION = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}


def config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(**{**dict(model=str(model_dir), device="cpu", max_model_len=128, kv_pages=64,
                                  max_batched_tokens=128, max_running=8), **overrides})


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    engine = LLMEngine(config(tiny_model_dir))
    with TestClient(build_app(engine, "tiny", security=SecurityPolicy(allowed_weight_dirs=(allowed,)))) as client:
        yield client, engine, allowed


def greedy_ids(client) -> list[int]:
    response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def refused(response, status: int, needle: str):
    assert response.status_code == status, response.text
    error = ErrorBody.model_validate_json(response.content).error
    assert error.code == status and needle in error.message, error.message
    return error


def status(client) -> SleepStatus:
    return SleepStatus.model_validate(client.get("/is_sleeping").json())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_reload_gives_the_same_greedy_output_and_sleeping_servers_answer_503(served, level):
    client, engine, _ = served
    before = greedy_ids(client)
    reply = SleepReply.model_validate(client.post("/sleep", json={"level": level}).json())
    assert reply.is_sleeping and reply.level == level and reply.freed_bytes > 0
    assert status(client).is_sleeping and client.get("/is_sleeping").json()["is_sleeping"] is True  # vLLM's key
    error = refused(client.post("/v1/completions", json=COMPLETION), 503, "POST /wake_up")
    assert error.type == "server_error"
    refused(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}), 503, "wake_up")
    again = SleepReply.model_validate(client.post("/sleep", json={"level": level}).json())  # asleep already: no-op
    assert again.is_sleeping and again.freed_bytes == 0
    if level == 2:  # the weights are gone: a reload must wait for them to be back
        refused(client.post("/v1/rl/engine/reload_weights", json={}), 409, "wake_up")
    woke = WakeUpReply.model_validate(client.post("/wake_up", json={}).json())
    assert not woke.is_sleeping and set(woke.woken) == {"weights", "kv_cache"}
    if level == 2:
        assert not woke.weights_loaded and not status(client).weights_loaded
        refused(client.post("/v1/completions", json=COMPLETION), 503, "reload_weights")
        reloaded = ReloadWeightsReply.model_validate(client.post("/v1/rl/engine/reload_weights").json())
        assert reloaded.success and reloaded.path == str(engine.model_dir)
    assert status(client) == SleepStatus(is_sleeping=False)
    assert greedy_ids(client) == before


def test_wake_up_by_tags_then_reload_as_rl_trainers_do(served):
    """vLLM's RL sequence: sleep(2), wake the weights, load them, then wake the KV pool."""
    client, _, _ = served
    before = greedy_ids(client)
    client.post("/sleep", json={"level": 2})
    woke = WakeUpReply.model_validate(client.post("/wake_up", json={"tags": ["weights"]}).json())
    assert woke.is_sleeping and woke.asleep == ["kv_cache"] and woke.woken == ["weights"]
    assert client.post("/v1/rl/engine/reload_weights", json={}).status_code == 200  # KV still asleep: fine
    refused(client.post("/v1/completions", json=COMPLETION), 503, "wake_up")
    WakeUpReply.model_validate(client.post("/wake_up", json={"tags": ["kv_cache"]}).json())
    assert status(client) == SleepStatus(is_sleeping=False)
    assert greedy_ids(client) == before
    refused(client.post("/wake_up", json={"tags": ["optimizer"]}), 400, "tags")


def test_reload_weights_paths_are_confined_and_bad_checkpoints_change_nothing(served, tmp_path):
    client, engine, allowed = served
    before = greedy_ids(client)
    outside = tmp_path / "ckpt"
    shutil.copytree(engine.model_dir, outside)
    error = refused(client.post("/v1/rl/engine/reload_weights", json={"path": str(outside)}), 400,
                    "--allowed-weight-dir")
    assert error.param == "path"
    refused(client.post("/update_weights_from_disk", json={"model_path": str(outside)}), 400, "--allowed-weight-dir")
    refused(client.post("/v1/rl/engine/reload_weights", json={"path": str(allowed / "missing")}), 400, "missing")
    copy = allowed / "copy"
    shutil.copytree(engine.model_dir, copy)
    reply = client.post("/update_weights_from_disk", json={"model_path": str(copy)})  # SGLang's alias and key
    assert reply.status_code == 200 and reply.json()["success"] is True and reply.json()["path"] == str(copy)
    assert greedy_ids(client) == before and status(client).weights_loaded


def test_reload_weights_when_awake_writes_in_place(served):
    """Graphs captured these addresses: a reload must not move any parameter, buffer or derived tensor."""
    client, engine, _ = served
    model = engine.runner.model
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert any("cos_sin_cache" in name for name in tensors)  # a derived tensor is among them
    before = {name: t.data_ptr() for name, t in tensors.items()}
    checksum = engine.control.checksum()
    assert client.post("/v1/rl/engine/reload_weights").status_code == 200
    assert {name: t.data_ptr() for name, t in tensors.items()} == before
    assert engine.control.checksum() == checksum


def test_a_reload_that_fails_midway_ends_queued_requests_with_503_instead_of_leaving_them_hung(served, monkeypatch):
    client, engine, _ = served

    def broken(*args, **kwargs):
        raise OSError("disk went away")

    assert client.post("/v1/rl/engine/pause_generation", json={"mode": "keep"}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(client.post, "/v1/completions", json=COMPLETION)
        while not engine.scheduler.waiting:  # queued behind the pause
            pass
        monkeypatch.setattr(LoadedWeights, "load", broken)  # every load after the first goes through it
        refused(client.post("/v1/rl/engine/reload_weights"), 500, "disk went away")
        assert client.post("/v1/rl/engine/continue_generation").status_code == 200
        refused(queued.result(timeout=30), 503, "reload_weights")
    monkeypatch.undo()
    assert client.post("/v1/rl/engine/reload_weights").status_code == 200
    assert status(client).weights_loaded and greedy_ids(client)


def test_a_sleep_that_fails_takes_its_steps_back_and_the_server_serves_on(served, monkeypatch):
    """Sleep's steps (EngineControl.sleep, runtime/tsdev_runtime/engine/control.py): refuse new requests, drain, fail
    the queued, free; an engine that fails to free is undone -- new requests accepted again, the server awake, serving
    as before."""
    client, engine, _ = served
    before = greedy_ids(client)

    def broken(level):
        raise RuntimeError("the allocator refused")

    monkeypatch.setattr(engine.control, "free_memory", broken)
    with pytest.raises(RuntimeError, match="the allocator refused"):  # the test client re-raises the server's error
        client.post("/sleep", json={"level": 1})
    monkeypatch.undo()
    assert not status(client).is_sleeping and greedy_ids(client) == before


def test_tsdev_sleep_says_how_much_device_memory_came_free_not_how_much_is_free(monkeypatch):
    from typer.testing import CliRunner

    import tsdev.client
    from tsdev.cli import app

    reply = SleepReply(is_sleeping=True, level=1, asleep=["kv_cache", "weights"], freed_bytes=3 * 10**9,
                       device_freed_bytes=4 * 10**9, seconds=0.5)
    monkeypatch.setattr(tsdev.client, "control_call", lambda *args, **kwargs: reply)
    result = CliRunner().invoke(app, ["sleep"])
    assert result.exit_code == 0, result.output
    assert "freed 3.00 GB (4.00 GB came free on the device)" in result.output


def test_hello_says_whether_the_server_sleeps_and_sleep_events_parse():
    assert Hello(paused=False).sleeping is False
    assert parse_event({"type": "sleeping", "level": 2, "freed_bytes": 5}).level == 2
    assert parse_event({"type": "awake", "weights_loaded": False}).weights_loaded is False
    assert parse_event({"type": "weights_reloaded", "path": "/m", "seconds": 0.1}).path == "/m"


# --- the drill ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drill_engine(tiny_model_dir):
    return LLMEngine(config(tiny_model_dir))


@pytest.mark.slow
@pytest.mark.parametrize("eager", [True, False])
def test_the_drill_passes_three_rounds(tiny_model_dir, eager, drill_engine):
    engine = drill_engine if not eager else LLMEngine(config(tiny_model_dir, enforce_eager=True))
    report = drill(engine, rounds=3)
    assert report.rounds == 3 and len(report.seconds["reload"]) == 3


@pytest.mark.parametrize("mode, needle", [("skip", "cos_sin_cache"), ("rebind", "rebound cos_sin_cache")])
def test_the_drill_fails_when_derived_tensors_are_not_refreshed_in_place(drill_engine, monkeypatch, mode, needle):
    """The negative control: a reload that leaves derived tensors stale, or derives them into new memory (which
    graphs would never read), must fail the drill."""
    monkeypatch.setenv(DEBUG_DERIVED_ENV, mode)
    with pytest.raises(DrillFailed, match=needle):
        drill(drill_engine, rounds=1)
    monkeypatch.delenv(DEBUG_DERIVED_ENV)
    # repair: a level-1 sleep keeps nothing stale; a reload refills the table (a rebound one stays rebound)
    drill_engine.control.set(weights_loaded=True)
    if mode == "skip":
        drill_engine.control.load_weights()
        assert greedy(drill_engine) == greedy(LLMEngine(dataclasses.replace(drill_engine.config)))


# --- the command line, against a `tsdev serve --allow-reload-forward --api-key` subprocess --------------------


@pytest.mark.slow
def test_cli_sleep_wake_and_reload_on_a_keyed_reload_forward_server(tiny_model_dir, tmp_path):
    import httpx
    from typer.testing import CliRunner

    from serve_process import serve
    from tsdev.cli import app

    key = "k3y"
    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "256", "--served-model-name", "tiny",
            "--allow-reload-forward", "--api-key", key]
    with serve(args, tmp_path / "serve.log") as url:
        headers = {"Authorization": f"Bearer {key}"}

        def ids():
            response = httpx.post(url + "/v1/completions", json=COMPLETION, headers=headers, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        def run(*argv, env=None):
            return CliRunner().invoke(app, [*argv, "--url", url], env={"TSDEV_API_KEY": key, **(env or {})})

        before = ids()
        result = CliRunner().invoke(app, ["sleep", "--url", url], env={"TSDEV_API_KEY": "", "VLLM_API_KEY": ""})
        assert result.exit_code == 1 and "401" in result.output, result.output  # no key
        result = run("sleep", "--level", "2")
        assert result.exit_code == 0 and "sleeping (level 2" in result.output, result.output
        assert httpx.post(url + "/v1/completions", json=COMPLETION, headers=headers).status_code == 503
        reload_forward = httpx.post(url + "/v1/rl/engine/reload_forward", json={"id": "r1"}, headers=headers,
                                    timeout=60)
        assert reload_forward.status_code == 200 and not reload_forward.json()["ok"]  # asleep: refused, nothing done
        assert "sleeping" in reload_forward.json()["workers"][0]["error"]
        result = run("wake")
        assert result.exit_code == 0 and "weights not loaded" in result.output, result.output
        result = run("weights", "reload")
        assert result.exit_code == 0 and "reloaded" in result.output, result.output
        result = run("weights", "reload", str(tmp_path))
        assert result.exit_code == 1 and "--allowed-weight-dir" in result.output
        assert ids() == before


@pytest.mark.slow
def test_cli_drill_passes_and_its_negative_control_fails(tiny_model_dir):
    from typer.testing import CliRunner

    from tsdev.cli import app

    argv = ["weights", "drill", str(tiny_model_dir), "--rounds", "2", "--device", "cpu"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0 and result.output.count("ok ") == 2, result.output
    result = CliRunner().invoke(app, argv, env={DEBUG_DERIVED_ENV: "skip"})
    assert result.exit_code == 1 and "differ from the fresh load" in result.output, result.output


@pytest.mark.slow
def test_sleeping_one_engine_leaves_another_in_the_process_whole(make_engine):
    """Two engines in one process (tests, benchmarks, a rebuilt model) share no tensor: sleeping one at level 2
    (which frees its storages) leaves the other's rotary table, weights and output as they were."""
    first, second = make_engine(), make_engine()
    expected = greedy(second)
    assert all(a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
               for a in named_tensors(first.runner.model, derived=True).values()
               for b in named_tensors(second.runner.model, derived=True).values())
    first.control.free_memory(2)
    assert greedy(second) == expected


def test_one_engine_state_moves_through_pause_sleep_and_a_weight_load_and_each_move_is_an_event(served):
    client, engine, _ = served
    moves = []
    engine.control.listeners.append(moves.append)  # what the events stream publishes (StateChanged), in order
    info = lambda: client.get("/server_info").json()["state"]  # noqa: E731
    try:
        assert info() == "serving"
        client.post(PAUSE_ROUTE, json={"mode": "abort"})
        assert info() == "paused"
        client.post(CONTINUE_ROUTE)
        assert info() == "serving"
        client.post("/sleep", json={"level": 2})
        assert info() == "sleeping" and status(client).is_sleeping
        client.post("/wake_up")
        assert info() == "weights_unloaded"  # awake, the weights discarded
        refused(client.post("/v1/completions", json=COMPLETION), 503, "reload_weights")
        assert client.post("/v1/rl/engine/reload_weights").status_code == 200
        assert info() == "serving" and greedy_ids(client)
    finally:
        engine.control.listeners.remove(moves.append)
    # a sleep drains first (holding: new requests refused); the weight load's drain hides under weights_unloaded
    assert moves == ["paused", "serving", "holding", "sleeping", "weights_unloaded", "serving"], moves
    assert parse_event({"type": "state", "state": "paused"}).state == "paused"
    with pytest.raises(AttributeError, match="not an engine state flag"):
        engine.control.set(asleep=True)
