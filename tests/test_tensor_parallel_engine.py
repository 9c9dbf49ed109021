"""An engine over two gloo ranks (separate processes, the CPU stand-in for two GPUs): rank 0 schedules and drives,
rank 1 follows every call; greedy output equals one rank's, and a reload reaches both ranks or neither."""
import asyncio

import pytest

from ranks import run_ranks
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)

PACKAGES = ["tsdev_kernels.ops", "tsdev_runtime.layers", "tsdev_runtime.models", "tsdev_runtime.sampling"]
PROMPTS = [[5, 17, 300, 42, 9, 77], list(range(3, 40)), [7, 8, 9]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SILU_LINE = "    return F.silu(gate) * up\n"
NEGATED = "    return -F.silu(gate) * up\n"
RANK_1_REFUSES = ("import torch.distributed\nif torch.distributed.get_rank() == 1:\n"
                  "    raise RuntimeError('rank 1 refuses this edit')\n")


def config(model_dir: str, world_size: int) -> EngineConfig:
    return EngineConfig(model=model_dir, device="cpu", dtype="float32", world_size=world_size, max_running=8,
                        kv_pages=256, page_size=4, max_batched_tokens=128, cudagraph_capture_sizes=[1, 4])


class EditedSources:
    """Rank 0's reloader, its sources carrying an edit of `module` (as if saved); the other ranks get these bytes."""

    def __init__(self, module: str, old: str, new: str):
        from tsdev.hotreload import Reloader

        self.reloader, self.module, self.old, self.new, self.active = Reloader(PACKAGES), module, old, new, True

    def read_sources(self):
        sources = self.reloader.read_sources()
        if self.active:
            sources[self.module] = sources[self.module].decode().replace(self.old, self.new, 1).encode()
        return sources

    def __getattr__(self, name):
        return getattr(self.reloader, name)


def generate(engine: LLMEngine) -> list[list[int]]:
    return [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)]


def on_rank(model_dir: str, world_size: int, scenario, *args):
    """Rank 0 runs `scenario(engine, *args)` (a module-level function); the others follow (with their own reloader)
    until the engine closes."""
    from tsdev_runtime import distributed
    from tsdev_runtime.engine.llm_engine import serve_rank
    from tsdev.hotreload import Reloader

    if distributed.rank() != 0:
        serve_rank(config(model_dir, world_size), lambda: Reloader(PACKAGES))
        return None
    engine = LLMEngine(config(model_dir, world_size))
    try:
        return scenario(engine, *args)
    finally:
        engine.control.close()


def greedy_scenario(engine):
    return generate(engine), engine.describe().parameters


def test_two_ranks_generate_what_one_rank_generates(tiny_model_dir):
    one = LLMEngine(config(str(tiny_model_dir), 1))
    (tokens, parameters), follower = run_ranks(on_rank, 2, str(tiny_model_dir), 2, greedy_scenario)
    assert tokens == generate(one) and follower is None
    assert parameters == one.describe().parameters  # the model's, not rank 0's part


def test_one_rank_in_a_process_group_runs_every_collective_and_generates_what_a_plain_engine_does(tiny_model_dir):
    one = LLMEngine(config(str(tiny_model_dir), 1))
    (tokens, collectives, reply_ranks), = run_ranks(on_rank, 1, str(tiny_model_dir), 1, counted_scenario)
    assert tokens == generate(one)
    # one all-reduce per row-parallel projection (o_proj, down_proj) and the embedding per forward, the logits'
    # all-gather; the reload's agreement and its per-rank reports
    assert collectives["all_reduce"] > 0 and collectives["all_gather"] > 0 and collectives["broadcast_object_list"] > 0
    assert reply_ranks == [0]


def counted_scenario(engine):
    import torch.distributed as dist

    from tsdev_runtime.control_protocol import ReloadRequest
    from tsdev_runtime.engine.async_engine import AsyncEngine
    from tsdev.hotreload import Reloader

    counts = {}
    for name in ("all_reduce", "all_gather", "broadcast_object_list"):
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    tokens = generate(engine)

    async def reload():
        ae = AsyncEngine(engine)
        engine.control.allow_reloads(Reloader(PACKAGES))
        await ae.start()
        try:
            return await engine.control.reload_forward(
                ReloadRequest(id="one-rank", modules=["tsdev_runtime.layers.activation"]))
        finally:
            await ae.stop()

    reply = asyncio.run(reload())
    assert reply.ok, reply
    return tokens, counts, [w.rank for w in reply.workers]


def reload_scenario(engine, edit_args):
    from tsdev_runtime.control_protocol import ReloadRequest
    from tsdev_runtime.engine.async_engine import AsyncEngine

    async def run():
        ae = AsyncEngine(engine)
        await ae.start()
        edit = EditedSources(*edit_args)
        engine.control.allow_reloads(edit)
        reload = engine.control.reload_forward
        before = await tokens(ae, "a")
        reply = await reload(ReloadRequest(id="r1"))
        after = await tokens(ae, "b")
        edit.active = False
        back = await reload(ReloadRequest(id="r2"))
        restored = await tokens(ae, "c")
        await ae.stop()
        return before, reply.model_dump(), after, back.model_dump(), restored

    return asyncio.run(run())


async def tokens(ae, rid: str) -> list[int]:
    out = []
    async for o in ae.generate(rid, PROMPTS[0], GREEDY):
        out += o.new_token_ids
    return out


def test_a_reload_changes_the_output_on_both_ranks_and_the_reply_has_both(tiny_model_dir):
    edit = ("tsdev_kernels.ops.activation", SILU_LINE, NEGATED)
    (before, reply, after, back, restored), _ = run_ranks(on_rank, 2, str(tiny_model_dir), 2, reload_scenario, edit)
    assert reply["ok"], reply
    assert [w["rank"] for w in reply["workers"]] == [0, 1]
    assert (reply["workers"][1]["reloaded"] == ["tsdev_kernels.ops.activation"]
            and "warm" in reply["workers"][1]["timings"])
    assert after != before  # both ranks run the edit (a rank without it would disagree in the all-reduce)
    assert back["ok"] and restored == before


def test_an_edit_that_fails_on_rank_1_only_rolls_rank_0_back_too(tiny_model_dir):
    edit = ("tsdev_kernels.ops.activation", SILU_LINE, SILU_LINE + RANK_1_REFUSES)
    (before, reply, after, _, _), _ = run_ranks(on_rank, 2, str(tiny_model_dir), 2, reload_scenario, edit)
    assert not reply["ok"]
    rank0, rank1 = reply["workers"]
    assert not rank1["ok"] and "rank 1 refuses this edit" in rank1["error"]
    assert not rank0["ok"] and "rank 1" in rank0["error"]
    assert after == before  # the old code keeps serving on both ranks


def weights_scenario(engine, other_dir: str):
    from pathlib import Path

    before = generate(engine)
    engine.control.free_memory(2)
    engine.control.restore_memory()
    engine.control.load_weights()
    after_sleep = generate(engine)
    engine.control.load_weights(Path(other_dir), "direct")
    on_other = generate(engine)
    engine.control.load_weights(None, "full")
    with pytest.raises(NotImplementedError, match="--tp 1"):
        engine.control.checksum()
    return before, after_sleep, on_other, generate(engine)


def test_sleep_wake_and_weight_updates_reach_every_rank(tiny_model_dir, tmp_path):
    from tsdev_runtime.weights.default_model import SHAPES, write_checkpoint

    other = tmp_path / "other"
    other.mkdir()
    write_checkpoint(other, {**SHAPES["tiny"], "max_position_embeddings": 1024}, seed=2, std=0.2)
    expected, expected_other = (generate(LLMEngine(config(str(tiny_model_dir), 1))),
                                generate(LLMEngine(config(str(other), 1))))
    (before, after_sleep, on_other, back), _ = run_ranks(on_rank, 2, str(tiny_model_dir), 2, weights_scenario,
                                                         str(other))
    assert before == after_sleep == back == expected  # level 2 discarded every rank's weights; the reload refilled all
    assert on_other == expected_other != expected


def test_tsdev_serve_tp_2_serves_what_tp_1_serves_and_a_reload_reaches_both_ranks(tiny_model_dir, tmp_path):
    import httpx

    from serve_process import copy_project, serve
    from test_reload_forward import ACTIVATION, complete, edited, new_id, reload

    project = copy_project(tmp_path / "project")
    args = [str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--max-model-len", "1024",
            "--cudagraph-capture-sizes", "1", "4"]
    with serve(args, tmp_path / "tp1.log", cwd=project) as one:
        expected = complete(one)["text"]
    with serve([*args, "--tp", "2", "--allow-reload-forward"], tmp_path / "tp2.log", cwd=project) as two:
        assert complete(two)["text"] == expected
        assert httpx.get(two + "/server_info").json()["world_size"] == 2
        refused = httpx.get(two + "/v1/rl/engine/weights_checksum", timeout=30)
        assert refused.status_code == 501 and "--tp 1" in refused.json()["error"]["message"], refused.text
        with edited(project, ACTIVATION, SILU_LINE, NEGATED):
            reply = reload(two, new_id())
            assert reply.ok and [w.rank for w in reply.workers] == [0, 1], reply
            assert complete(two)["text"] != expected
        assert reload(two, new_id()).ok
        assert complete(two)["text"] == expected


RANK_1_HANGS = "import time\nimport torch.distributed\nif torch.distributed.get_rank() == 1:\n    time.sleep(120)\n"


def test_a_rank_that_hangs_in_a_reload_stops_the_server_within_the_timeout_naming_the_step(tiny_model_dir, tmp_path):
    import time

    import httpx

    from serve_process import copy_project
    from test_reload_forward import ACTIVATION, edited, new_id
    from tsdev.launch.child import ServerProcess

    project = copy_project(tmp_path / "project")
    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024", "--cudagraph-capture-sizes", "1",
            "--tp", "2", "--rank-timeout", "3", "--allow-reload-forward"]
    server = ServerProcess(args, cwd=project, pythonpath=project, log_path=tmp_path / "serve.log")
    server.start()
    try:
        server.wait_healthy(90)
        with edited(project, ACTIVATION, SILU_LINE, SILU_LINE + RANK_1_HANGS):
            start = time.monotonic()
            with pytest.raises(httpx.HTTPError):  # the server exits while the reload waits for rank 1
                httpx.post(server.url + "/v1/rl/engine/reload_forward", json={"id": new_id()}, timeout=60)
            assert server.proc.wait(30) == 70 and time.monotonic() - start < 30
        log = server.output()
        assert "FATAL: reload" in log and "step 'reload'" in log and "did not answer within 3 s" in log, log
    finally:
        server.stop()


def test_a_step_sends_the_other_ranks_only_the_tokens_not_computed_yet():
    import pickle

    from tsdev_runtime.engine.sequence import Sequence

    seq = Sequence("r", list(range(2000)), GREEDY)
    seq.token_ids += [5, 6]
    seq.num_computed_tokens, seq.pages = 2001, list(range(126))
    view = pickle.loads(pickle.dumps(seq))
    assert view.step_tokens(1) == seq.step_tokens(1) == [6]
    assert (view.num_output_tokens, view.pages, view.params) == (2, seq.pages, seq.params)
    assert len(pickle.dumps(seq)) < 1000  # not the 2000-token history


def test_a_rank_that_dies_stops_the_server_at_the_next_step(tiny_model_dir, tmp_path):
    import os
    import signal
    from pathlib import Path

    import httpx

    from test_api_process import alive, children, until
    from tsdev.launch.child import ServerProcess

    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024", "--cudagraph-capture-sizes", "1",
            "--tp", "2", "--rank-timeout", "5"]
    server = ServerProcess(args, log_path=tmp_path / "serve.log")
    server.start()
    try:
        server.wait_healthy(90)
        kids = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2].decode()  # python -m MODULE
                for pid in children(server.proc.pid)}
        # the HTTP front in its own process
        assert sorted(kids.values()) == ["tsdev.launch.api", "tsdev.launch.tensor_ranks"]
        follower = next(pid for pid, module in kids.items() if module == "tsdev.launch.tensor_ranks")
        os.kill(follower, signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert server.proc.wait(30) == 70
        assert "FATAL: cannot send 'launch' to the other ranks" in server.output(), server.output()
        assert "a rank is gone" in server.output()
        assert until(lambda: not any(map(alive, kids)), 10)  # no process left behind
    finally:
        server.stop()


def test_the_tensor_parallel_benchmark_runs_and_compares_tp_1_with_tp_2():
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "tensor_parallel.py"
    run = subprocess.run([sys.executable, str(script), "--device", "cpu", "--batch-sizes", "1", "2", "--steps", "2",
                          "--reloads", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])["summary"]
    assert set(summary["decode_ms"]) == {"1", "2"} and all(v["tp1"] > 0 and v["tp1-group"] > 0 and v["tp2"] > 0
                                                          for v in summary["decode_ms"].values())
    assert len(summary["reload_rank_seconds"]) == 2 and summary["build_s"]["tp2"] > 0
    assert set(summary["reload_pause_s"]) == {"tp1", "tp1-group", "tp2"}


FORWARD_RAISES_ON = ("    if {condition}:\n        raise RuntimeError('this edit fails in the forward')\n" + SILU_LINE)


def tp_server(tiny_model_dir, tmp_path, *extra):
    from serve_process import copy_project
    from tsdev.launch.child import ServerProcess

    project = copy_project(tmp_path / "project")
    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024", "--cudagraph-capture-sizes", "1",
            "--tp", "2", "--allow-reload-forward", *extra]
    return project, ServerProcess(args, cwd=project, pythonpath=project, log_path=tmp_path / "serve.log")


def test_an_edit_that_fails_in_the_forward_on_every_rank_rolls_every_rank_back(tiny_model_dir, tmp_path):
    from test_reload_forward import ACTIVATION, complete, edited, new_id, reload

    project, server = tp_server(tiny_model_dir, tmp_path)
    with server.running(90):
        before = complete(server.url)["text"]
        with edited(project, ACTIVATION, SILU_LINE, FORWARD_RAISES_ON.format(condition="True")):
            reply = reload(server.url, new_id())
            assert not reply.ok and reply.workers[0].failed_step == "warm", reply
            assert "this edit fails in the forward" in reply.workers[0].error
            assert complete(server.url)["text"] == before  # both ranks back on the old code, in step
        assert reload(server.url, new_id()).ok and complete(server.url)["text"] == before


def test_an_edit_that_fails_in_the_forward_on_one_rank_stops_the_server_naming_the_step(tiny_model_dir, tmp_path):
    import httpx

    from test_reload_forward import ACTIVATION, edited, new_id

    project, server = tp_server(tiny_model_dir, tmp_path, "--rank-timeout", "3")
    server.start()
    try:
        server.wait_healthy(90)
        edit = FORWARD_RAISES_ON.format(condition="__import__('torch').distributed.get_rank() == 1")
        with edited(project, ACTIVATION, SILU_LINE, edit):
            with pytest.raises(httpx.HTTPError):
                httpx.post(server.url + "/v1/rl/engine/reload_forward", json={"id": new_id()}, timeout=60)
            assert server.proc.wait(30) == 70
        log = server.output()
        # rank 0 waited for rank 1 inside a collective until the timeout: the ranks are out of step
        assert "FATAL: reload" in log and "step 'warm'" in log and "rank 1 stops" in log, log
    finally:
        server.stop()


def test_a_tp_that_does_not_divide_the_heads_fails_with_one_line_per_rank_and_status_2(tiny_model_dir):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "tsdev", "serve", str(tiny_model_dir), "--device", "cpu", "--tp", "3",
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "error: the attention heads (4) does not divide by the tensor-parallel size 3" in run.stderr
    assert "Traceback" not in run.stderr and run.stderr.count("rank 1 stops") == 1, run.stderr


def test_the_rank_wide_calls_are_declared_once_and_a_follower_refuses_any_other(monkeypatch):
    from tsdev_runtime.engine import ranks

    driven = {name for name in vars(ranks.DrivenRunner) if not name.startswith("_")}
    assert driven == {*ranks.RANK_CALLS, "launch", "restore_model", "stop"}  # nothing proxied to rank 0 alone
    assert not hasattr(ranks.DrivenRunner, "__getattr__")
    script = iter([("warmup", ()), ("load_dangerous", ("x",)), (ranks.STOP, ())])
    settled, made = [], []

    class Runner:
        def warmup(self):
            made.append("warmup")

        def load_dangerous(self, *args):
            made.append("load_dangerous")

    monkeypatch.setattr(ranks.distributed, "broadcast", lambda *args: next(script))
    monkeypatch.setattr(ranks, "_settle", lambda call, error, *rest: settled.append((call, error)))
    ranks.follow(Runner())
    assert made == ["warmup"] and settled[0] == ("warmup", None)
    assert settled[1][0] == "load_dangerous" and "not a rank-wide call" in settled[1][1]
