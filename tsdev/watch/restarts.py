"""The watched server's life: the first start (or attaching), restarts, and what happens when it dies."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import httpx

from tsdev.launch.child import PortInUse, StartFailed, describe_exit
from tsdev.watch.jobs import Restart
from tsdev.watch.records import RestartRecord

if TYPE_CHECKING:
    from tsdev.watch.host import Host

EXIT_RESTARTS = 3  # restarts in a row after the server exited by itself, before waiting for the user


class Restarts:
    def __init__(self, daemon: Host):
        self.daemon = daemon
        self.count = 0
        self.after_exit = 0  # restarts in a row because the server exited by itself (a save or R resets it)
        self._exit_task: asyncio.Task | None = None

    async def first(self) -> RestartRecord:
        """Start the server (or reach the one to attach to) and take the golden completion."""
        daemon, record = self.daemon, RestartRecord(0, "start")
        if daemon.server is None:
            daemon.emit("restart_started", record)
            try:
                await daemon.link.reachable()
            except httpx.TransportError as exc:
                record.error, record.done = f"cannot reach {daemon.config.url} ({exc}): is the server running?", True
                daemon.emit("restart_finished", record)
        else:
            daemon.watcher.rescan()  # before the child imports the sources: later saves count as changes
            await self._start(record)
        if not record.error:
            await self._after_start(record, take_golden=True)
        return record

    async def restart(self, reason: str, by_user: bool, saved_at: float | None = None) -> None:
        self.count += 1
        record = RestartRecord(self.count, reason)
        first = [] if self.daemon.down else await self.daemon.link.capture_first()  # graphs it used: before serving
        self.daemon.watcher.rescan()  # before the standby imports the sources: later saves count as changes
        self.daemon.server.prepare_standby()  # it imports the project while the old server stops
        stopping = time.perf_counter()
        await self.daemon.server.stop_async(15)
        record.stopped = time.perf_counter() - stopping
        self.after_exit = 0 if by_user else self.after_exit + 1
        await self._start(record, first)
        if saved_at and not record.error:
            record.served_after_save = time.time() - saved_at
        if not record.error:
            await self._after_start(record, take_golden=self.daemon.checker.golden is None)

    async def _start(self, record: RestartRecord, extra_args: list[str] = ()) -> None:
        daemon, server, url = self.daemon, self.daemon.server, self.daemon.config.url
        daemon.emit("restart_started", record)
        daemon.set_state("restarting" if record.n else "starting", pid=None)
        start, began = time.perf_counter(), time.time()
        try:
            try:
                server.start(f"tsdev watch: starting the server ({record.reason})", extra_args)
            except PortInUse:
                raise StartFailed(f"something already answers on {url}: stop it, pass --port, or attach to it "
                                  f"with `tsdev watch --attach {url}`") from None
            await server.wait_healthy_async(daemon.config.startup_timeout, standby=False)  # after the checks
        except StartFailed as exc:
            record.error, record.done, record.seconds = str(exc), True, time.perf_counter() - start
            daemon.down = True
            daemon.set_state("down")
            daemon.emit("restart_finished", record)
            return
        record.seconds, record.pid = time.perf_counter() - start, server.proc.pid
        record.moments = {"restart began": began, "arguments sent": server.arguments_sent,
                          "health asked": server.healthy_asked_at, "healthy": server.healthy_at}
        record.standby = server.handed_over
        daemon.down = False
        daemon.info.update(pid=record.pid)
        self._exit_task = asyncio.create_task(self._watch_exit(), name="exit")

    async def _after_start(self, record: RestartRecord, take_golden: bool) -> None:
        daemon = self.daemon
        try:
            described = await daemon.link.describe()
            daemon.checker.vocab, daemon.checker.device = described.vocab, described.device
            record.startup = described.startup
            record.moments = {**record.moments, **described.moments}
            daemon.info.update(model=described.model, device=described.device)
            if take_golden:
                await daemon.checker.take_golden()
        except (httpx.HTTPError, RuntimeError, KeyError, IndexError, ValueError) as exc:
            record.note = f"could not query the server: {exc}"
        else:
            await daemon.check(record, golden=not take_golden)
        if daemon.server is not None:  # the next standby imports torch and takes the GPU: not while the probe runs
            daemon.server.start_standby()
        record.done = True
        daemon.set_state("serving")
        daemon.emit("restart_finished", record)

    async def _watch_exit(self) -> None:
        daemon = self.daemon
        code = await daemon.server.exited()
        if code is None or daemon.stopping:  # stopped on purpose
            return
        daemon.down = True
        daemon.set_state("down", pid=None)
        output = daemon.server.tail(8)
        why = f"the server exited ({describe_exit(code)})"
        if self.after_exit >= EXIT_RESTARTS:
            daemon.message(f"{why} again: not restarting it ({EXIT_RESTARTS} times in a row). Its last output:\n"
                           f"{output}\nFix the cause, then save a file or press R.", "error")
            return
        if code >= 0:
            daemon.message(f"{why}; its last output:\n{output}", "warning")
        daemon.jobs.put(Restart(why, by_user=False))
