"""The daemon's reloads: the ones it asks for, and the ones other clients ask for (`tsdev reload`, editor
hooks, other tools), which it sees on the server's event stream and checks like its own."""
from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx

from tsdev_runtime.control_protocol import Event, ReloadFinished, ReloadStarted, ReloadStep, WorkerReport
from tsdev.notebook import read_texts
from tsdev.outcome import outside
from tsdev.watch.jobs import ForeignFinished, Restart
from tsdev.watch.records import ReloadRecord

if TYPE_CHECKING:
    from tsdev.watch.host import Host


class Reloads:
    def __init__(self, daemon: Host):
        self.daemon = daemon
        self.session = f"watch-{uuid.uuid4().hex[:6]}"  # prefix of this daemon's reload ids
        self.numbers = itertools.count(1)
        self.records: list[ReloadRecord] = []
        self.current: ReloadRecord | None = None  # this daemon's reload in flight
        self.foreign: dict[str, ReloadRecord] = {}  # other clients' reloads in flight, by id

    def new(self, trigger: str, files: Sequence[str] = (), modules: Sequence[str] = (),
            ids: Sequence[str] = (), saved_at: float | None = None) -> ReloadRecord:
        return ReloadRecord(next(self.numbers), trigger, list(files), list(modules), ids=list(ids), saved_at=saved_at)

    async def run(self, record: ReloadRecord, forced: bool = False) -> None:
        """Ask the server to reload (`forced`: the record's modules, changed or not) and check the result."""
        daemon = self.daemon
        self.records.append(record)
        self.current = record
        daemon.emit("reload_started", record)
        daemon.set_state("reloading")
        try:
            rid = f"{self.session}-{record.n}-{len(record.ids)}"
            record.ids.append(rid)
            if daemon.notebook is not None and record.files:  # the text the server is about to read (~0.1 ms)
                record.texts = read_texts(daemon.config.project, record.files)
            sent = time.time()
            reply = await daemon.link.reload(rid, list(record.modules) if forced else None)
            worker, record.ranks = reply.first_failure, list(reply.workers)
            if record.saved_at and reply.ok:
                resumed = worker.timings.get("resumed")  # serving resumed then, before any report-mode check
                record.settle = sent - record.saved_at
                record.served_after_save = (time.time() if resumed is None else sent + resumed) - record.saved_at
        except (httpx.HTTPError, RuntimeError) as exc:
            worker = WorkerReport(ok=False, error=f"the reload request failed: {exc}")
        self.current = None
        await self._finish(record, worker)

    async def finish_foreign(self, record: ReloadRecord, worker: WorkerReport) -> None:
        if record not in self.records:
            self.records.append(record)
        await self._finish(record, worker)

    async def _finish(self, record: ReloadRecord, worker: WorkerReport) -> None:
        daemon = self.daemon
        record.finish(worker)
        if record.error is None and record.reloaded:
            daemon.new_code_served()
            await daemon.check(record)
        elif record.error is None and not worker.needs_restart:
            record.note = "no change to reload"
        if worker.needs_restart:  # the restart job that follows says the same when it runs
            record.restart = (f"needs restart: {outside(worker.needs_restart)} → "
                              + ("restarting the server" if daemon.server else "restart it yourself (attached)"))
        record.done = True
        daemon.emit("reload_finished", record)
        daemon.set_state("serving")
        if worker.needs_restart:
            daemon.jobs.put(Restart(outside(worker.needs_restart), by_user=True))

    def on_server_event(self, event: Event) -> None:
        """A reload event: live steps of this daemon's reload; other clients' reloads start and finish."""
        if not isinstance(event, (ReloadStarted, ReloadStep, ReloadFinished)):
            return
        ours = event.id.startswith(self.session)
        if isinstance(event, ReloadStarted) and not ours:
            record = self.foreign[event.id] = self.new("another client", modules=event.modules, ids=[event.id])
            self.daemon.emit("reload_started", record)
        elif isinstance(event, ReloadStep) and (record := self._live(event.id, ours)) is not None:
            self._step(record, event)
        elif isinstance(event, ReloadFinished) and not ours:
            record = self.foreign.pop(event.id, None) or self.new("another client", ids=[event.id])
            self.daemon.jobs.put(ForeignFinished(record, event.worker))

    def _live(self, rid: str, ours: bool) -> ReloadRecord | None:
        if ours:
            return self.current if self.current and rid in self.current.ids else None
        return self.foreign.get(rid)

    def _step(self, record: ReloadRecord, event: ReloadStep) -> None:
        if event.state == "started":
            record.current, record.step_started = event.step, time.perf_counter()
            self.daemon.set_state("draining" if event.step == "drain" else "reloading")
        else:
            record.steps[event.step] = event.seconds or 0.0
            if event.state == "failed":
                record.failed = event.step
        self.daemon.emit("reload_step", record)
