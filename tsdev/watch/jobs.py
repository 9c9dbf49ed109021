"""The daemon's work queue: saves, keys, other clients' reloads and a dead server become jobs, and the one
worker takes everything that piled up while it was busy as one batch (many saves make one reload)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path

from tsdev_runtime.control_protocol import WorkerReport
from tsdev.watch.records import ReloadRecord
from tsdev.watch.watcher import Changes


@dataclass
class Saved:
    changes: Changes


@dataclass
class Restart:
    reason: str
    by_user: bool  # a save or R: resets the count of restarts after the server exited by itself


@dataclass
class ReloadAll:
    pass


@dataclass
class RetakeGolden:
    pass


@dataclass
class Bench:
    pass


@dataclass
class ForeignFinished:
    """Another client's reload finished: the daemon checks it like its own."""
    record: ReloadRecord
    worker: WorkerReport


@dataclass
class NewWeights:
    """A complete checkpoint appeared in --weights DIR: update the served weights from it (direct)."""
    path: Path


Job = Saved | Restart | ReloadAll | RetakeGolden | Bench | ForeignFinished | NewWeights


@dataclass
class Batch:
    """The jobs that piled up, merged."""
    changes: Changes = field(default_factory=Changes)
    restarts: list[Restart] = field(default_factory=list)
    foreign: list[ForeignFinished] = field(default_factory=list)
    keys: set[type] = field(default_factory=set)  # ReloadAll, RetakeGolden, Bench: each runs once
    weights: Path | None = None  # the newest checkpoint that piled up (older ones are skipped)

    @classmethod
    def of(cls, jobs: list[Job]) -> Batch:
        return cls(reduce(Changes.merge, [j.changes for j in jobs if isinstance(j, Saved)], Changes()),
                   [j for j in jobs if isinstance(j, Restart)], [j for j in jobs if isinstance(j, ForeignFinished)],
                   {type(j) for j in jobs if isinstance(j, (ReloadAll, RetakeGolden, Bench))},
                   ([None] + [j.path for j in jobs if isinstance(j, NewWeights)])[-1])


class Jobs:
    def __init__(self):
        self._queue: asyncio.Queue[Job] = asyncio.Queue()

    def put(self, job: Job) -> None:
        self._queue.put_nowait(job)

    async def take(self) -> Batch:
        """Wait for a job, then take it with every other one waiting."""
        jobs = [await self._queue.get()]
        while not self._queue.empty():
            jobs.append(self._queue.get_nowait())
        return Batch.of(jobs)
