"""`tsdev watch --weights DIR` against the in-process fake server: which checkpoints written into DIR lead to an
update_weights call, when, and how the update is shown."""
import pytest
import asyncio
import io
import json
import os
import re

import torch
from rich.console import Console
from safetensors.torch import save_file

from fake_server import URL, FakeServer, make_project, until
from tsdev.watch.args import WatchConfig
from tsdev.watch.daemon import Daemon
from tsdev.watch.plain import PlainPrinter
from tsdev.watch.records import WeightsRecord
from tsdev.watch.weights import checkpoint_files

TENSORS = {"a.weight": torch.ones(64, 64), "b.weight": torch.zeros(32)}


def write_checkpoint(folder, shards: int = 1, skip: tuple = ()) -> None:
    """config.json and `shards` safetensors files (with an index when more than one); `skip`: shards not written."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    if shards == 1:
        save_file(TENSORS, str(folder / "model.safetensors"))
        return
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {f"t{i}": name for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for i, name in enumerate(names):
        if i not in skip:
            save_file({f"t{i}": torch.full((64, 64), float(i))}, str(folder / name))


class Session:
    """The daemon attached to the fake server with --weights DIR, its events and its plain lines."""

    def __init__(self, project, weights, server: FakeServer):
        self.events, self.out = [], io.StringIO()
        self.printer = PlainPrinter(Console(file=self.out, soft_wrap=True, highlight=False, width=400))
        self.daemon = self.printer.daemon = Daemon(
            WatchConfig(attach=URL, project=project, probe_batch=2, probe_steps=4, settle=0.1, weights=weights),
            self.on_event, server.transport())

    def on_event(self, event) -> None:
        self.events.append(event)
        self.printer(event)

    async def __aenter__(self):
        self.task = asyncio.create_task(self.daemon.run())
        await until(lambda: any(e.kind == "message" and "for new checkpoints" in e.text for e in self.events))
        return self

    async def __aexit__(self, *exc):
        self.daemon.stop()
        assert await asyncio.wait_for(self.task, 10) == 0

    def finished(self) -> list[WeightsRecord]:
        return [e.record for e in self.events if e.kind == "reload_finished" and isinstance(e.record, WeightsRecord)]

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()


@pytest.mark.slow
def test_a_published_checkpoint_is_loaded_once_checked_and_shown(tmp_path):
    project, weights, server = make_project(tmp_path / "p"), tmp_path / "ckpts", FakeServer()
    write_checkpoint(weights / "step-1")  # there before the watch: the baseline, not loaded

    async def main():
        async with Session(project, weights, server) as s:
            write_checkpoint(weights / "step-2.tmp")  # a trainer's atomic publish: written aside, then renamed
            os.rename(weights / "step-2.tmp", weights / "step-2")
            await until(lambda: s.finished())
            await asyncio.sleep(0.6)  # nothing else follows
            return s

    s = asyncio.run(main())
    assert [(u.path, u.mode) for u in server.weight_updates] == [(str(weights.resolve() / "step-2"), "direct")]
    record = s.finished()[0]
    assert record.ok and record.verdict.position == 3 and record.retaken and record.probe is not None
    line = next(x for x in s.lines() if "weights #1 ok" in x)
    assert f"(weights {weights.resolve()}/step-2): update_weights direct" in line
    assert re.search(r"load 0\.05 update 0\.06 check [\d.]+ s", line)
    assert "golden: output changed at token 3 of 24 (new weights) | decode" in line
    assert "golden retaken on the new weights" in line
    assert "(now: " in next(x for x in s.lines() if "for new checkpoints" in x)


@pytest.mark.slow
def test_an_incomplete_set_of_shards_waits_until_complete(tmp_path):
    project, weights, server = make_project(tmp_path / "p"), tmp_path / "ckpts", FakeServer()
    weights.mkdir()

    async def main():
        async with Session(project, weights, server) as s:
            write_checkpoint(weights / "step-5", shards=3, skip=(1,))  # shard 2 of 3 missing
            await asyncio.sleep(0.8)
            assert server.weight_updates == []
            shard = weights / "step-5" / "model-00002-of-00003.safetensors"
            save_file({"t1": torch.ones(64, 64)}, str(shard))
            data = shard.read_bytes()
            shard.write_bytes(data[:-100])  # written halfway: shorter than its header says
            await asyncio.sleep(0.8)
            assert server.weight_updates == [] and checkpoint_files(weights / "step-5") is None
            shard.write_bytes(data)
            await until(lambda: s.finished())
            await asyncio.sleep(0.5)

    asyncio.run(main())
    assert [u.path for u in server.weight_updates] == [str(weights.resolve() / "step-5")]


@pytest.mark.slow
def test_dir_as_the_checkpoint_and_a_refusal_when_attached(tmp_path):
    project, weights, server = make_project(tmp_path / "p"), tmp_path / "ckpt", FakeServer()
    write_checkpoint(weights)
    server.weights_refusal = f"{weights} resolves to {weights}, outside /fake: pass a path under the served model's " \
                             "directory, or start the server with --allowed-weight-dir DIR (repeatable)"

    async def main():
        async with Session(project, weights, server) as s:
            await asyncio.sleep(0.4)
            assert server.weight_updates == []  # the contents at start are the baseline
            save_file({"a.weight": torch.full((64, 64), 2.0)}, str(weights / "model.safetensors"))  # rewritten
            await until(lambda: s.finished())
            return s

    s = asyncio.run(main())
    assert [u.path for u in server.weight_updates] == [str(weights.resolve())]
    record = s.finished()[0]
    assert record.error and record.verdict is None
    line = next(x for x in s.lines() if "weights #1 FAILED" in x)
    assert f"the old weights keep serving; attached: start the server with --allowed-weight-dir {weights.resolve()}" \
        in line


def test_the_started_server_is_allowed_to_load_from_dir(tmp_path):
    project, weights = make_project(tmp_path / "p"), tmp_path / "new" / "ckpts"
    daemon = Daemon(WatchConfig(project=project, weights=weights, port=18999), lambda event: None)
    argv = daemon.server.argv
    assert argv[argv.index("--allowed-weight-dir") + 1] == str(weights.resolve()) and weights.is_dir()


def test_the_history_row_shows_a_weights_update_like_a_reload():
    from tsdev.watch.checks import Probe, Verdict
    from tsdev.watch.tui import WatchApp

    record = WeightsRecord(1, "weights /c/step-1", modules=["/c/step-1"], path="/c/step-1", done=True,
                           verdict=Verdict(24, 3), probe=Probe([4.0, 4.1], 2, 5.0), steps={"update": 0.1})
    cells = WatchApp.cells(record)
    assert ((cells["#"], cells["total"], str(cells["golden"]), str(cells["outcome"]))
            == ("W1", "0.10", "new @3", "weights"))
