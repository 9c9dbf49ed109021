"""The `tsdev watch` daemon: keep a server running the code on disk, whatever the edit.

It starts `tsdev serve --allow-reload-forward` as a child (or attaches to a running server), watches
the packages, and for each settled burst of saves asks the server to reload (reloads.py); the server
compares contents itself, so a save without a change, or one an editor hook already reloaded, costs
nothing. An edit the server cannot take in place (a module outside the reloadable packages, or
`needs_restart` in a reply) and a server that dies are answered with a restart (restarts.py), so the
user never runs stale code. After every reload a golden completion and a decode probe (checks.py) say whether the output
and the speed moved.

Everything happens on one asyncio loop: jobs (jobs.py) go into one queue, and a single worker takes them
in turn, coalescing what piled up while it was busy. The screen (tui.py) or the plain printer (plain.py)
receives `Event`s (records.py) and never touches the server; link.py does.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tsdev_runtime.control_protocol import (Awake, CompiledAhead, Hello, ProfileFinished, Sleeping, StateChanged,
                                            WeightsReloaded)
from tsdev.notebook import Writer, notebook_path, prune_settings
from tsdev.outcome import ahead_text, outside
from tsdev.launch.child import ServerProcess
from tsdev.watch.args import WatchConfig
from tsdev.watch.checks import Checker
from tsdev.watch.jobs import Batch, Bench, Jobs, NewWeights, ReloadAll, Restart, RetakeGolden, Saved
from tsdev.watch.link import ServerLink
from tsdev.watch.records import Event, ReloadRecord, RestartRecord, entry_of
from tsdev.watch.reloads import Reloads
from tsdev.watch.restarts import Restarts
from tsdev.watch.watcher import Packages, Watcher
from tsdev.watch.weights import CheckpointWatcher, WeightUpdates

WEIGHTS_SETTLE = 0.2  # seconds: the least quiet time before a checkpoint directory is looked at
BUILD_ON_SIGHT_ENV = "TSDEV_WATCH_BUILD_ON_SIGHT"  # "0": a save's kernels are built by its reload only (an A/B)
QUIET_S = 10.0  # how long the checks wait for the server to capture its pending graphs


class Daemon:
    """The daemon; its parts (reloads, restarts, weight updates) see it as a `Host` (host.py)."""

    def __init__(self, config: WatchConfig, on_event: Callable[[Event], None],
                 transport: httpx.AsyncBaseTransport | None = None):
        from tsdev.hotreload import default_packages

        self.config, self.on_event = config, on_event
        if (sight := os.environ.get(BUILD_ON_SIGHT_ENV, "1")) not in ("0", "1"):
            raise ValueError(f"{BUILD_ON_SIGHT_ENV}={sight!r}: 0 (a save's kernels built by its reload only) or 1 "
                             "(built at the save's first sight, the default)")
        self.build_on_sight = sight == "1"
        self.packages = Packages.locate(default_packages(config.project), config.project)
        self.watcher = Watcher(self.packages, config.settle)
        server_args = list(config.server_args)
        self.weights: CheckpointWatcher | None = None
        if config.weights is not None:
            config.weights.mkdir(parents=True, exist_ok=True)
            # checkpoint writers pause longer between writes than editors: a window of 200 ms at least
            self.weights = CheckpointWatcher(config.weights, max(config.settle, WEIGHTS_SETTLE))
            server_args += ["--allowed-weight-dir", str(self.weights.root)]  # the server loads only from allowed dirs
        # the server imports the copy of the packages that is watched (not another one its path may find first)
        imports = os.pathsep.join([*dict.fromkeys(str(d.parent) for d in self.packages.dirs.values()),
                                   *filter(None, [os.environ.get("PYTHONPATH")])])
        self.server = None if config.attach else ServerProcess(
            [*([config.model] if config.model else []), *server_args], config.port, allow_reload_forward=True,
            cwd=config.project, log_path=config.log_path, api_key=config.api_key, standby=True,
            env={"PYTHONPATH": imports})
        self.info = {"state": "starting", "url": config.url, "model": None, "device": None, "pid": None,
                     "log": str(config.log_path) if self.server else None, "attach": bool(config.attach)}
        self.link = ServerLink(config.url, transport, config.api_key)
        self.notebook = (Writer(notebook_path(config.project), config.project.resolve(),
                                prune_settings(config.project)) if config.notebook else None)
        self.checker = Checker(self.link, config, self.message)
        self.jobs = Jobs()
        self.reloads = Reloads(self)
        self.restarts = Restarts(self)
        self.weight_updates = WeightUpdates(self, self.weights) if self.weights else None
        # the server's phase as it publishes it (Hello, then StateChanged: runtime/tsdev_runtime/engine/control.py)
        self.server_phase = "serving"
        self.down = False  # the server failed to start or exited, and no restart has brought it back yet
        self._stop = asyncio.Event()
        self._early: set[asyncio.Task] = set()  # early builds in flight (`_build_early`)
        self._early_ids = itertools.count(1)

    # --- what the screen calls -------------------------------------------------------------------

    def reload_all(self) -> None:
        self.jobs.put(ReloadAll())

    def restart(self) -> None:
        self.jobs.put(Restart("requested (R)", by_user=True))

    def bench(self) -> None:
        self.jobs.put(Bench())

    def retake_golden(self) -> None:
        self.jobs.put(RetakeGolden())

    def arm_profile(self) -> None:
        self.checker.profile_next = True
        self.message("the next reload's decode probe will be recorded with the torch profiler (POST /start_profile)")

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # --- events ----------------------------------------------------------------------------------

    def emit(self, kind: str, record=None, text: str = "", level: str = "info") -> None:
        if kind in ("reload_finished", "restart_finished") and self.notebook is not None:
            self.notebook.put(entry_of(record, self.reloads.session))  # before the screen: its sparklines see it
        self.on_event(Event(kind, record, text, level))

    def message(self, text: str, level: str = "info") -> None:
        self.emit("message", text=text, level=level)

    def new_code_served(self) -> None:
        self.restarts.after_exit = 0

    @property
    def paused(self) -> bool:
        """Generation paused by a client (pause_generation): the checks would wait forever."""
        return self.server_phase == "paused"

    @property
    def sleeping(self) -> bool:
        """Asleep, or awake without weights (POST /sleep, a level-2 wake): requests get 503 until a load."""
        return self.server_phase in ("sleeping", "weights_unloaded")

    def set_state(self, state: str, **info) -> None:
        if state == "serving" and (self.sleeping or self.paused):
            state = "sleeping" if self.sleeping else "paused"
        self.info.update(state=state, **info)
        self.emit("state")

    # --- the main loop ---------------------------------------------------------------------------

    async def run(self) -> int:
        """Run until stop(); 2 when the first start fails, else 0."""
        tasks = [asyncio.create_task(self._watch(), name="watch")]  # saves during startup are not lost
        if self.weights:
            tasks.append(asyncio.create_task(self._watch_weights(), name="watch-weights"))
        try:
            first = asyncio.create_task(self.restarts.first())
            stopped = asyncio.create_task(self._stop.wait())
            tasks += [first, stopped]
            await asyncio.wait({first, stopped}, return_when=asyncio.FIRST_COMPLETED)  # Ctrl-C during a long start
            if not first.done():
                return 0
            if first.result().error:
                return 2
            tasks += [asyncio.create_task(self._listen(), name="events"),
                      asyncio.create_task(self._work(), name="work")]
            await self.watcher.ready.wait()
            roots = ", ".join(f"{d}/" for d in self.packages.dirs.values())  # absolute: which copy is watched
            self.message(f"watching {roots} (reloadable: {', '.join(self.packages.reloadable)})")
            if self.weights:
                await self.weights.ready.wait()
                now = self.weights.display(self.weights.baseline) if self.weights.baseline else "no complete checkpoint"
                self.message(f"watching {self.weights.root} for new checkpoints (now: {now}, not loaded): each one "
                             "is loaded with update_weights (direct), checked, and becomes the golden reference")
            await self._stop.wait()
            return 0
        finally:
            self._stop.set()
            tasks += self._early  # early builds still asked for
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.server:
                await self.server.stop_async(15)
                await asyncio.to_thread(self.server.dismiss_standby)
            await self.link.aclose()
            if self.notebook is not None:
                await asyncio.to_thread(self.notebook.close)

    async def _watch(self) -> None:
        async for changes in self.watcher.batches(self._stop, self._build_early if self.build_on_sight else None):
            self.jobs.put(Saved(changes))

    def _build_early(self, path: Path, text: str) -> None:
        """A reloadable file's new text, seen before the save has settled: the server builds its kernels now (as an
        editor's unsaved buffer), and the settled reload of that text waits for the build instead of compiling."""
        if self.down or self.info["state"] in ("starting", "restarting") or self.sleeping:
            return
        request_id = f"{self.reloads.session}-early-{next(self._early_ids)}"
        task = asyncio.create_task(self.link.compile_ahead(str(path), text, request_id), name=request_id)
        self._early.add(task)
        task.add_done_callback(self._early_done)

    def _early_done(self, task: asyncio.Task) -> None:
        self._early.discard(task)
        if not task.cancelled():
            task.exception()  # a refused or failed early build costs nothing: the reload compiles, and says why

    async def _watch_weights(self) -> None:
        async for path in self.weights.checkpoints(self._stop):
            self.jobs.put(NewWeights(path))

    async def _listen(self) -> None:
        async for event in self.link.events():
            if isinstance(event, (Hello, StateChanged)):  # what the server says it is doing: read, not rebuilt
                self.server_phase = event.state
                if self.info["state"] in ("serving", "paused", "sleeping"):
                    self.set_state("serving")
            elif isinstance(event, Sleeping):
                self.message(f"server sleeping (level {event.level}): POST /wake_up (tsdev wake) to serve again")
            elif isinstance(event, Awake):
                self.message("server awake" + ("" if event.weights_loaded else
                                               ": weights not loaded (tsdev weights reload)"))
            elif isinstance(event, WeightsReloaded):
                if not (self.weight_updates and self.weight_updates.ours(event.id)):  # our own: its record says it
                    self.message(f"weights updated by another client ({event.mode}, {event.path}): the golden "
                                 "completion is taken again on them")
                    self.jobs.put(RetakeGolden())
            elif isinstance(event, CompiledAhead) and (event.reply.id or "").startswith(self.reloads.session):
                pass  # this daemon's own early build: the reload that follows says what it found
            elif isinstance(event, CompiledAhead):  # an editor's buffer (tsdev reload --ahead)
                self.message(f"editor's buffer of {self.packages.display(event.reply.path)}: {ahead_text(event.reply)}",
                             "info" if event.reply.ok else "warning")
            elif isinstance(event, ProfileFinished) and event.error:
                self.message(f"profile {event.name} not written: {event.error}", "error")
            elif isinstance(event, ProfileFinished):
                self.message(f"profile written: {event.trace or event.name}")
            else:
                self.reloads.on_server_event(event)

    async def _work(self) -> None:
        while True:
            batch = await self.jobs.take()
            try:
                await self._do(batch)
            except Exception as exc:  # keep watching: say what broke instead of dying silently
                self.message(f"tsdev watch: {type(exc).__name__}: {exc}", "error")
                self.set_state("down" if self.down else "serving")

    async def _do(self, batch: Batch) -> None:
        for job in batch.foreign:
            await self.reloads.finish_foreign(job.record, job.worker)
        changes, reasons = batch.changes, [job.reason for job in batch.restarts]
        if changes.restart:
            reasons.append(outside(changes.restart))
        elif changes and self.down:
            reasons.append(f"{', '.join(changes.files)} changed after the server failed")
        if reasons and self.server is not None:  # a restart runs every change: no reload first
            by_user = any(job.by_user for job in batch.restarts) or bool(changes)
            await self.restarts.restart("; ".join(reasons), by_user, saved_at=changes.saved_at if changes else None)
        else:
            if reasons:
                self.message(f"needs a restart ({'; '.join(reasons)}), but tsdev watch did not start this server: "
                             "restart it yourself", "warning")
            if changes.reload:
                await self.reloads.run(self.reloads.new("save", changes.files, changes.reload,
                                                        saved_at=changes.saved_at))
        if batch.weights is not None:
            if self.down:
                self.message(f"new checkpoint {batch.weights} not loaded: the server is down", "warning")
            else:
                await self.weight_updates.run(batch.weights)
        if ReloadAll in batch.keys and not self.down:
            modules = await self.link.loaded(self.packages.reloadable_modules())
            await self.reloads.run(self.reloads.new("reload all (r)", [], modules), forced=True)
        if RetakeGolden in batch.keys and not self.down:
            try:
                await self.checker.take_golden()
                self.message(f"golden completion taken again ({len(self.checker.golden)} tokens): later reloads "
                             "compare with it")
            except (httpx.HTTPError, RuntimeError) as exc:
                self.message(f"could not take the golden completion: {exc}", "error")
        if Bench in batch.keys and not self.down:
            await self._bench()

    async def check(self, record: ReloadRecord | RestartRecord, golden: bool = True) -> None:
        """The checks after a reload or a restart (skipped while generation is paused)."""
        if self.paused or self.sleeping:
            record.note = f"the server is {'asleep' if self.sleeping else 'paused'}: checks skipped"
            return
        start = time.perf_counter()
        if isinstance(record, ReloadRecord):
            record.current, record.step_started = "check", start
            self.emit("reload_step", record)
        self.set_state("checking")
        baseline = self.checker.last_probe
        if pending := await self.quiet():
            record.note = (f"decode not comparable: {pending} CUDA graph(s) were still being captured (eager steps "
                           "and captures beside the probe)")
        await self.checker.run(record, golden, can_profile=isinstance(record, ReloadRecord))
        if pending:  # the next figure is compared with the last quiet one
            self.checker.last_probe = baseline
        if isinstance(record, ReloadRecord):
            record.steps["check"] = time.perf_counter() - start

    async def quiet(self) -> int:
        """Wait (up to QUIET_S) for the server to capture the graphs it left for after serving resumed: they are
        captured while it is idle, and a probe beside them measured eager steps and captures (+44 % to +98 % decode
        after restarts that changed nothing). The graphs still pending then (0: quiet)."""
        deadline = time.monotonic() + QUIET_S
        while (pending := await self.link.graphs_pending()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return pending

    async def _bench(self) -> None:
        from tsdev.bench import quick, quick_line

        self.message("quick bench running...")
        try:
            result = await asyncio.to_thread(quick, self.config.url, self.config.api_key)
        except Exception as exc:
            self.message(f"quick bench failed: {type(exc).__name__}: {exc}", "error")
            return
        self.message("quick bench: " + quick_line(result["metrics"]))
