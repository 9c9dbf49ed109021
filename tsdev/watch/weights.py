"""`tsdev watch --weights DIR`: new checkpoints written into DIR, settled and complete, as update jobs.

DIR is the checkpoint itself when it holds a `config.json`; otherwise it holds checkpoint subdirectories
(`DIR/step-123/`, a trainer's publish) and the newest complete one counts (hidden names and names ending in
`.tmp`, `.partial` or `.incomplete` are skipped: a trainer writes there, then renames). A checkpoint is
complete when `config.json` exists and every shard does: those listed in `model.safetensors.index.json`, else
`model.safetensors`; each shard's size must be the one its safetensors header declares (a shard still being
written is shorter), and the sizes must stay the same over one more settle window. What DIR holds when the
watch starts is the baseline, not loaded; each later complete checkpoint (a new directory, or new contents)
is yielded once.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tsdev.client import ErrorReply
from tsdev.watch.records import WeightsRecord
from tsdev.watch.watcher import settled

if TYPE_CHECKING:
    from tsdev.watch.host import Host

SKIPPED_SUFFIXES = (".tmp", ".partial", ".incomplete")


def _shard_complete(path: Path) -> bool:
    """The file is as long as its safetensors header says (8-byte length, JSON header, then the data)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size:
                return False
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        return size == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return False


def checkpoint_files(folder: Path) -> list[Path] | None:
    """config.json and the shards of a complete checkpoint in `folder`, else None."""
    config, index = folder / "config.json", folder / "model.safetensors.index.json"
    if not config.is_file():
        return None
    try:
        shards = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()}) \
            if index.is_file() else [folder / "model.safetensors"]
    except (OSError, ValueError, KeyError, AttributeError):
        return None  # the index is being written
    if not all(_shard_complete(shard) for shard in shards):
        return None
    return [config, *([index] if index.is_file() else []), *shards]


def signature(files: list[Path]) -> tuple | None:
    try:
        return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    except OSError:
        return None


def newest_checkpoint(root: Path) -> tuple[Path, tuple] | None:
    """The checkpoint DIR stands for (itself, or its newest complete subdirectory) and its signature."""
    if (root / "config.json").exists():
        candidates = [root]
    else:
        try:
            candidates = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
                          and not d.name.endswith(SKIPPED_SUFFIXES)]
        except OSError:
            return None
    found = []
    for folder in candidates:
        if (files := checkpoint_files(folder)) and (sig := signature(files)):
            found.append((max(mtime for _, _, mtime in sig), folder.name, folder, sig))
    if not found:
        return None
    _, _, folder, sig = max(found)
    return folder, sig


class CheckpointWatcher:
    def __init__(self, root: Path, settle: float = 0.2):
        self.root, self.settle = Path(root).resolve(), settle
        self.ready = asyncio.Event()
        current = newest_checkpoint(self.root)
        self.baseline: Path | None = current[0] if current else None
        self.seen: tuple | None = current[1] if current else None

    def display(self, path: Path) -> str:
        return str(path) if path == self.root else f"{self.root}/{path.relative_to(self.root)}"

    async def checkpoints(self, stop: asyncio.Event) -> AsyncIterator[Path]:
        """Yield each new complete checkpoint until `stop` is set."""
        async for _ in settled([self.root], self.settle, stop, self.ready):
            while (first := newest_checkpoint(self.root)) is not None and first[1] != self.seen:
                await asyncio.sleep(self.settle)  # complete: its files must stay the same over one window
                if newest_checkpoint(self.root) == first:
                    self.seen = first[1]
                    yield first[0]
                    break

class WeightUpdates:
    """The daemon's weight updates: each new checkpoint is loaded in place (update_weights, direct: the CUDA graphs
    kept), then checked like a reload. The golden completion is compared first (a change is expected: new weights
    answer differently, and the line says so as information), then taken again on the new weights, so that the
    reloads that follow compare code against the weights being served."""

    def __init__(self, daemon: Host, watcher: CheckpointWatcher):
        self.daemon, self.watcher = daemon, watcher
        self.session = f"watch-weights-{uuid.uuid4().hex[:6]}"  # prefix of this daemon's update ids
        self.numbers = itertools.count(1)
        self.applied: Path | None = None  # the last checkpoint loaded

    def ours(self, update_id: str | None) -> bool:
        return bool(update_id) and update_id.startswith(self.session)

    async def run(self, path: Path) -> None:
        daemon = self.daemon
        shown = self.watcher.display(path)
        record = WeightsRecord(next(self.numbers), f"weights {shown}", modules=[shown], path=str(path))
        record.ids.append(f"{self.session}-{record.n}")
        daemon.emit("reload_started", record)
        daemon.set_state("reloading")
        record.current, record.step_started = "update", time.perf_counter()
        try:
            reply = await daemon.link.update_weights(str(path), record.ids[0])
        except ErrorReply as exc:
            record.error = f"update_weights refused ({exc})"
            if exc.status in (400, 409):
                record.note = "the old weights keep serving"
            if exc.status == 400 and "allowed-weight-dir" in str(exc) and daemon.server is None:
                record.note += f"; attached: start the server with --allowed-weight-dir {self.watcher.root}"
        except (httpx.HTTPError, RuntimeError) as exc:
            record.error = f"the update_weights request failed: {type(exc).__name__}: {exc}"
        else:
            record.message = reply.message
            record.steps.update(update=reply.seconds, load=reply.load_seconds)
        record.current = None
        if record.error is None:
            self.applied = path
            await daemon.check(record)
            if not daemon.paused and not daemon.sleeping:
                try:
                    await daemon.checker.take_golden()
                    record.retaken = True
                except (httpx.HTTPError, RuntimeError) as exc:
                    record.note = f"could not take the golden completion again: {exc}"
        else:
            record.failed = "update"
        record.done = True
        daemon.emit("reload_finished", record)
        daemon.set_state("serving")
