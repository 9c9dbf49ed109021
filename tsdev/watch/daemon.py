"""The `tsdev watch` daemon: keep a server running the code on disk, whatever the edit.

It starts `tsdev serve --allow-reload-forward` as a child (or attaches to a running server), watches
the packages, and for each settled burst of saves asks the server to reload; the server compares
contents itself, so a save without a change, or one an editor hook already reloaded, costs nothing.
An edit the server cannot take in place (a module outside the reloadable packages, or `needs_restart`
in a reply) and a server that dies are answered with a restart, so the user never runs stale code.
After every reload a golden completion and a decode probe say whether the output and the speed moved.

Everything happens on one asyncio loop: jobs (saves, keys, other clients' reloads, a dead child) go
into one queue, and a single worker takes them in turn, coalescing what piled up while it was busy.
The screen (tui.py) or the plain printer (plain.py) receives `Event`s and never touches the server.
"""
from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path

import httpx

from tsdev.client import RELOAD_ROUTE, reload_body, reply_or_raise
from tsdev.watch import checks
from tsdev.watch.watcher import Changes, Packages, Watcher

STEPS = ("jit", "drain", "flush", "reload", "warm", "recapture", "pause")  # the reply's timings, in server order
FAILING_STEPS = ("drain", "flush", "reload", "warm", "recapture")  # where a reload can fail (jit only warns)
EXIT_RESTARTS = 3  # restarts in a row after the server exited by itself, before waiting for the user


@dataclass
class WatchConfig:
    model: str | None = None
    server_args: list[str] = field(default_factory=list)  # passed through to `tsdev serve`
    attach: str | None = None  # URL of a running server instead of a child
    host: str = "127.0.0.1"
    port: int = 8000
    project: Path = field(default_factory=Path.cwd)
    settle: float = 0.2
    probe_batch: int = 8
    probe_steps: int = 32
    profile_each_reload: bool = False  # every reload's decode probe runs inside a capture range, not just after `p`
    server_log: Path | None = None
    startup_timeout: float = 600.0

    @property
    def url(self) -> str:
        return (self.attach or f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}").rstrip("/")


@dataclass
class ReloadRecord:
    n: int
    trigger: str  # "save", "reload all (r)", "another client"
    files: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)  # what the trigger asked for or saw changed
    started: float = field(default_factory=time.time)
    ids: list[str] = field(default_factory=list)
    steps: dict[str, float] = field(default_factory=dict)  # step -> seconds, filled in live
    current: str | None = None  # the step running now
    step_started: float = 0.0  # perf_counter() when it started
    failed: str | None = None  # the step that failed
    worker: dict | None = None  # the reply's worker entry (the first failing one, else rank 0)
    error: str | None = None
    verdict: checks.Verdict | None = None
    probe: checks.Probe | None = None
    note: str = ""
    done: bool = False

    @property
    def ok(self) -> bool:
        return self.done and self.error is None

    def step_order(self) -> list[str]:
        """The steps seen so far in the order they ran, then the ones still to come."""
        seen = [s for s in self.steps if s in STEPS]
        return seen + [s for s in STEPS if s not in seen]

    @property
    def reloaded(self) -> list[str]:
        return (self.worker or {}).get("reloaded") or []

    @property
    def dependents(self) -> list[str]:
        return (self.worker or {}).get("dependents") or []


@dataclass
class RestartRecord:
    n: int  # 0: the first start
    reason: str
    started: float = field(default_factory=time.time)
    seconds: float = 0.0
    pid: int | None = None
    error: str | None = None
    verdict: checks.Verdict | None = None
    probe: checks.Probe | None = None
    note: str = ""
    done: bool = False


@dataclass
class Event:
    kind: str  # state | message | reload_started | reload_step | reload_finished | restart_started | restart_finished
    record: ReloadRecord | RestartRecord | None = None
    text: str = ""
    level: str = "info"  # info | warning | error


class StartFailed(Exception):
    pass


def split_server_args(tokens: list[str], flags: dict[str, bool]) -> tuple[str | None, list[str]]:
    """MODEL and the `tsdev serve` flags among watch's extra arguments (`flags`: flag -> takes a value)."""
    model, rest, i = None, [], 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("-"):
            name = token.split("=", 1)[0]
            if name not in flags:
                raise ValueError(f"unknown option {name}: `tsdev watch --help` lists watch's own options and "
                                 "`tsdev serve --help` the server flags it passes on")
            rest.append(token)
            if flags[name] and "=" not in token and i + 1 < len(tokens):
                i += 1
                rest.append(tokens[i])
        elif model is None:
            model = token
        else:
            raise ValueError(f"unexpected argument {token!r}: give at most one MODEL")
        i += 1
    return model, rest


def flag_value(args: list[str], flag: str) -> str | None:
    for i, token in enumerate(args):
        if token == flag and i + 1 < len(args):
            return args[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()  # Ctrl-C in the terminal goes to the daemon, which stops the server itself
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no orphaned server holding the GPU or the port


class ServerProcess:
    """The child `tsdev serve`; its output goes to a log file (the screen belongs to the TUI)."""

    def __init__(self, config: WatchConfig):
        self.config = config
        self.log_path = config.server_log or Path(os.environ.get("TMPDIR", "/tmp")) / f"tsdev-watch-{config.port}.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False
        self._offset = 0

    @property
    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "tsdev", "serve", *([self.config.model] if self.config.model else []),
                *self.config.server_args]
        if "--allow-reload-forward" not in args:
            args.append("--allow-reload-forward")
        if flag_value(args, "--port") is None:
            args += ["--port", str(self.config.port)]
        return args

    async def start(self, client: httpx.AsyncClient, reason: str) -> None:
        try:
            await client.get(self.config.url + "/health", timeout=1)
        except httpx.TransportError:
            pass
        else:
            raise StartFailed(f"something already answers on {self.config.url}: stop it, pass --port, or attach "
                              f"to it with `tsdev watch --attach {self.config.url}`")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            log.write(f"\n--- {time.strftime('%H:%M:%S')} tsdev watch: starting the server ({reason}): "
                      f"{' '.join(self.argv[1:])}\n")
            log.flush()
            self._offset = log.tell()
            self.stopping = False
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                cwd=self.config.project, preexec_fn=_die_with_parent)

    async def wait_healthy(self, client: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        while True:
            if self.proc.returncode is not None:
                raise StartFailed(f"the server exited during startup ({describe_exit(self.proc.returncode)}):\n"
                                  f"{self.tail()}")
            try:
                if (await client.get(self.config.url + "/health", timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                await self.stop()
                raise StartFailed(f"the server was not healthy within {self.config.startup_timeout:.0f} s:\n{self.tail()}")
            await asyncio.sleep(0.1)

    def output(self) -> str:
        """What the current run printed so far."""
        try:
            with open(self.log_path, errors="replace") as log:
                log.seek(self._offset)
                return log.read()
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.output().rstrip().splitlines()[-lines:]) or f"(nothing in {self.log_path})"

    async def stop(self) -> None:
        proc, self.stopping = self.proc, True
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


class Daemon:
    def __init__(self, config: WatchConfig, on_event: Callable[[Event], None],
                 transport: httpx.AsyncBaseTransport | None = None):
        from tsdev.hotreload import default_packages

        self.config, self.on_event, self.transport = config, on_event, transport
        self.packages = Packages.locate(default_packages(config.project), config.project)
        self.watcher = Watcher(self.packages, config.settle)
        self.server = None if config.attach else ServerProcess(config)
        self.session = f"watch-{uuid.uuid4().hex[:6]}"  # prefix of this daemon's reload ids
        self.info = {"state": "starting", "url": config.url, "model": None, "device": None, "pid": None,
                     "log": str(self.server.log_path) if self.server else None, "attach": bool(config.attach)}
        self.jobs: asyncio.Queue[tuple] = asyncio.Queue()
        self.numbers = itertools.count(1)
        self.reloads: list[ReloadRecord] = []
        self.current: ReloadRecord | None = None
        self.foreign: dict[str, ReloadRecord] = {}
        self.paused = False
        self.vocab = 256
        self.golden: list | None = None
        self.last_probe: float | None = None
        self.profile_next = False
        self.restarts = 0
        self.exit_restarts = 0
        self.down = False
        self._stop = asyncio.Event()
        self._client: httpx.AsyncClient | None = None
        self._exit_task: asyncio.Task | None = None

    # --- what the screen calls -------------------------------------------------------------------

    def reload_all(self) -> None:
        self.jobs.put_nowait(("reload_all",))

    def restart(self) -> None:
        self.jobs.put_nowait(("restart", "requested (R)", True))

    def bench(self) -> None:
        self.jobs.put_nowait(("bench",))

    def retake_golden(self) -> None:
        self.jobs.put_nowait(("golden",))

    def arm_profile(self) -> None:
        self.profile_next = True
        self.message("the next reload's decode probe will be recorded with the torch profiler (POST /start_profile)")

    def stop(self) -> None:
        self._stop.set()

    # --- events ----------------------------------------------------------------------------------

    def emit(self, kind: str, record=None, text: str = "", level: str = "info") -> None:
        self.on_event(Event(kind, record, text, level))

    def message(self, text: str, level: str = "info") -> None:
        self.emit("message", text=text, level=level)

    def set_state(self, state: str, **info) -> None:
        self.info.update(state="paused" if state == "serving" and self.paused else state, **info)
        self.emit("state")

    # --- the main loop ---------------------------------------------------------------------------

    async def run(self) -> int:
        """Run until stop(); 2 when the first start fails, else 0."""
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(60, read=None), transport=self.transport)
        tasks = [asyncio.create_task(self._watch(), name="watch")]  # saves during startup are not lost
        try:
            first = asyncio.create_task(self._start_first())
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
            roots = ", ".join(f"{self.packages.display(d)}/" for d in self.packages.dirs.values())
            self.message(f"watching {roots} (reloadable: {', '.join(self.packages.reloadable)})")
            await self._stop.wait()
            return 0
        finally:
            self._stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.server:
                await self.server.stop()
            await self._client.aclose()

    async def _start_first(self) -> RestartRecord:
        record = RestartRecord(0, "start")
        if self.server is None:
            self.emit("restart_started", record)
            try:
                await self._client.get(self.config.url + "/health", timeout=5)
            except httpx.TransportError as exc:
                record.error, record.done = f"cannot reach {self.config.url} ({exc}): is the server running?", True
                self.emit("restart_finished", record)
        else:
            await self._start(record)
        if not record.error:
            await self._after_start(record, take_golden=True)
        return record

    async def _watch(self) -> None:
        async for changes in self.watcher.batches(self._stop):
            self.jobs.put_nowait(("changes", changes))

    async def _work(self) -> None:
        while True:
            jobs = [await self.jobs.get()]
            while not self.jobs.empty():
                jobs.append(self.jobs.get_nowait())
            try:
                await self._do(jobs)
            except Exception as exc:  # keep watching: say what broke instead of dying silently
                self.message(f"tsdev watch: {type(exc).__name__}: {exc}", "error")
                self.set_state("down" if self.down else "serving")

    async def _do(self, jobs: list[tuple]) -> None:
        kinds = [job[0] for job in jobs]
        for job in jobs:
            if job[0] == "foreign":
                await self._finish_foreign(job[1])
        changes = reduce(Changes.merge, [job[1] for job in jobs if job[0] == "changes"], Changes())
        restarts = [job for job in jobs if job[0] == "restart"]
        reasons = [job[1] for job in restarts]
        if changes.restart:
            reasons.append(f"{', '.join(changes.restart)} changed outside the reloadable packages")
        elif changes and self.down:
            reasons.append(f"{', '.join(changes.files)} changed after the server failed")
        if reasons and self.server is not None:  # a restart runs every change: no reload first
            by_user = any(job[2] for job in restarts) or bool(changes)
            await self._restart("; ".join(reasons), by_user)
        else:
            if reasons:
                self.message(f"needs a restart ({'; '.join(reasons)}), but tsdev watch did not start this server: "
                             "restart it yourself", "warning")
            if changes.reload:
                await self._reload(ReloadRecord(next(self.numbers), "save", changes.files, changes.reload))
        if "reload_all" in kinds and not self.down:
            modules = await self._loaded(self.packages.reloadable_modules())
            await self._reload(ReloadRecord(next(self.numbers), "reload all (r)", [], modules), forced=True)
        if "golden" in kinds and not self.down:
            try:
                await self._take_golden()
                self.message(f"golden completion taken again ({len(self.golden)} tokens): later reloads compare with it")
            except (httpx.HTTPError, RuntimeError) as exc:
                self.message(f"could not take the golden completion: {exc}", "error")
        if "bench" in kinds and not self.down:
            await self._bench()

    # --- reloads ---------------------------------------------------------------------------------

    async def _reload(self, record: ReloadRecord, forced: bool = False) -> None:
        self.reloads.append(record)
        self.current = record
        self.emit("reload_started", record)
        self.set_state("reloading")
        modules = list(record.modules) if forced else None
        try:
            rid = f"{self.session}-{record.n}-{len(record.ids)}"
            record.ids.append(rid)
            reply = await self._post_reload(rid, modules)
            worker = next((w for w in reply["workers"] if not w.get("ok")), reply["workers"][0])
        except (httpx.HTTPError, RuntimeError) as exc:
            worker = {"ok": False, "error": f"the reload request failed: {exc}"}
        self.current = None
        await self._finish(record, worker)

    async def _loaded(self, on_disk: list[str]) -> list[str]:
        """Of the modules on disk, those the server has imported (a reload can force only those)."""
        try:
            response = await self._client.get(self.config.url + "/v1/rl/engine/modules")
        except httpx.HTTPError:
            return on_disk
        if response.status_code != 200:  # a server without the route: force them all and let it say
            return on_disk
        loaded = set(response.json()["modules"])
        return [m for m in on_disk if m in loaded]

    async def _post_reload(self, rid: str, modules: list[str] | None) -> dict:
        response = await self._client.post(self.config.url + RELOAD_ROUTE, json=reload_body(modules, request_id=rid))
        return reply_or_raise(response)

    async def _finish(self, record: ReloadRecord, worker: dict) -> None:
        record.worker, record.current = worker, None
        record.error = None if worker.get("ok") else (worker.get("error") or "the reload failed")
        for step, seconds in (worker.get("timings") or {}).items():
            record.steps[step] = seconds
        if record.error and record.failed is None:  # the step that was running: the last one timed
            record.failed = next((s for s in reversed(record.steps) if s in FAILING_STEPS), None)
        if record.error is None and record.reloaded:
            self.exit_restarts = 0
            await self._check(record)
        elif record.error is None:
            record.note = "no change to reload"
        record.done = True
        self.emit("reload_finished", record)
        self.set_state("serving")
        if worker.get("needs_restart"):
            self.jobs.put_nowait(("restart", f"{', '.join(worker['needs_restart'])} changed outside the reloadable "
                                             "packages", True))

    async def _finish_foreign(self, item: tuple[ReloadRecord, dict]) -> None:
        record, worker = item
        if record not in self.reloads:
            self.reloads.append(record)
        await self._finish(record, worker)

    async def _check(self, record: ReloadRecord | RestartRecord, golden: bool = True) -> None:
        """Golden completion, then the decode probe (recorded by the profiler when `p` armed it)."""
        if self.paused:
            record.note = "generation is paused: checks skipped"
            return
        start = time.perf_counter()
        if isinstance(record, ReloadRecord):
            record.current, record.step_started = "check", start
            self.emit("reload_step", record)
        self.set_state("checking")
        try:
            if golden and self.golden:
                record.verdict = checks.compare(self.golden, await checks.greedy(self._client, self.config.url, self.vocab))
            if (self.profile_next or self.config.profile_each_reload) and isinstance(record, ReloadRecord):
                self.profile_next = False
                await self._start_profile(record)
            ms = await checks.decode_ms(self._client, self.config.url, self.vocab, self.config.probe_batch,
                                        self.config.probe_steps)
            record.probe = checks.Probe(ms, self.config.probe_batch, self.last_probe)
            self.last_probe = ms
        except (httpx.HTTPError, RuntimeError) as exc:
            record.note = f"checks failed: {exc}"
        if isinstance(record, ReloadRecord):
            record.steps["check"] = time.perf_counter() - start

    async def _start_profile(self, record: ReloadRecord) -> None:
        body = {"activities": ["TORCH"], "num_steps": self.config.probe_steps, "name": f"watch-reload-{record.n}"}
        response = await self._client.post(self.config.url + "/start_profile", json=body)
        if response.status_code == 404:
            self.message("this server has no /start_profile route: nothing profiled", "warning")
        elif response.status_code != 200:
            self.message(f"profiling refused: {response.text[:300]}", "warning")
        else:
            record.note = "profiled: the decode probe is recorded"

    async def _take_golden(self) -> None:
        """The completion later ones are compared with (raises httpx errors)."""
        self.golden = await checks.greedy(self._client, self.config.url, self.vocab)
        if len(set(self.golden)) == 1:
            self.message("the golden completion is one token repeated (random weights?): the output check will "
                         "miss most edits; it is meaningful on a trained checkpoint", "warning")

    async def _bench(self) -> None:
        from tsdev.bench import quick

        self.message("quick bench running...")
        try:
            result = await asyncio.to_thread(quick, self.config.url)
        except Exception as exc:
            self.message(f"quick bench failed: {type(exc).__name__}: {exc}", "error")
            return
        m = result["metrics"]
        parts = [f"{label} {m[key]:.{digits}f}{unit}" for key, label, digits, unit in (
            ("output_throughput", "output", 1, " tok/s"), ("mean_ttft_ms", "TTFT", 1, " ms"),
            ("mean_tpot_ms", "TPOT", 2, " ms"), ("failed_requests", "failed", 0, "")) if isinstance(m.get(key), (int, float))]
        self.message("quick bench: " + (", ".join(parts) or json.dumps(m)[:200]))

    # --- the server's own events (reloads from editor hooks, `tsdev reload`, other tools) --------

    async def _listen(self) -> None:
        while True:
            try:
                async with self._client.stream("GET", self.config.url + "/v1/rl/engine/events") as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            self._on_server_event(json.loads(line[6:]))
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.5)

    def _on_server_event(self, event: dict) -> None:
        kind, rid = event.get("type"), event.get("id") or ""
        if kind in ("hello", "paused", "continued"):
            self.paused = event.get("paused", kind == "paused")
            if self.info["state"] in ("serving", "paused"):
                self.set_state("serving")
            return
        if kind == "profile_finished":
            self.message(f"profile written: {event.get('trace') or event.get('name')}")
            return
        if rid.startswith(self.session):
            record = self.current if self.current and rid in self.current.ids else None
        elif kind == "reload_started":
            record = self.foreign[rid] = ReloadRecord(next(self.numbers), "another client",
                                                      modules=event.get("modules") or [], ids=[rid])
            self.emit("reload_started", record)
            return
        else:
            record = self.foreign.get(rid)
        if kind == "reload_step" and record is not None:
            if event.get("state") == "started":
                record.current, record.step_started = event["step"], time.perf_counter()
                self.set_state("draining" if event["step"] == "drain" else "reloading")
            else:
                record.steps[event["step"]] = event.get("seconds", 0.0)
                if event.get("state") == "failed":
                    record.failed = event["step"]
            self.emit("reload_step", record)
        elif kind in ("reload_finished", "reload_failed") and not rid.startswith(self.session):
            record = self.foreign.pop(rid, None) or ReloadRecord(next(self.numbers), "another client", ids=[rid])
            self.jobs.put_nowait(("foreign", (record, event.get("worker") or {})))

    # --- restarts --------------------------------------------------------------------------------

    async def _restart(self, reason: str, by_user: bool) -> None:
        self.restarts += 1
        record = RestartRecord(self.restarts, reason)
        await self.server.stop()
        self.exit_restarts = 0 if by_user else self.exit_restarts + 1
        await self._start(record)
        if not record.error:
            await self._after_start(record, take_golden=self.golden is None)

    async def _start(self, record: RestartRecord) -> None:
        self.emit("restart_started", record)
        self.set_state("restarting" if record.n else "starting", pid=None)
        start = time.perf_counter()
        self.watcher.rescan()  # before the child imports the sources: later saves count as changes
        try:
            await self.server.start(self._client, record.reason)
            await self.server.wait_healthy(self._client)
        except StartFailed as exc:
            record.error, record.done, record.seconds = str(exc), True, time.perf_counter() - start
            self.down = True
            self.set_state("down")
            self.emit("restart_finished", record)
            return
        record.seconds, record.pid = time.perf_counter() - start, self.server.proc.pid
        self.down = False
        self._exit_task = asyncio.create_task(self._watch_exit(self.server.proc))
        device = re.search(r" on (\S+) in [\d.]+ s", self.server.output())
        self.info.update(pid=record.pid, device=device.group(1) if device else None)

    async def _after_start(self, record: RestartRecord, take_golden: bool) -> None:
        try:
            models = (await self._client.get(self.config.url + "/v1/models")).json()["data"][0]
            self.vocab = int(models.get("vocab_size") or 256)
            self.info["model"] = models.get("id")
            if take_golden:
                await self._take_golden()
        except (httpx.HTTPError, RuntimeError, KeyError, IndexError, ValueError) as exc:
            record.note = f"could not query the server: {exc}"
        else:
            await self._check(record, golden=not take_golden)
        record.done = True
        self.set_state("serving")
        self.emit("restart_finished", record)

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self.server.stopping or proc is not self.server.proc or self._stop.is_set():
            return
        self.down = True
        self.set_state("down", pid=None)
        output = self.server.tail(8)
        why = f"the server exited ({describe_exit(code)})"
        if self.exit_restarts >= EXIT_RESTARTS:
            self.message(f"{why} again: not restarting it ({EXIT_RESTARTS} times in a row). Its last output:\n{output}\n"
                         "Fix the cause, then save a file or press R.", "error")
            return
        if code >= 0:
            self.message(f"{why}; its last output:\n{output}", "warning")
        self.jobs.put_nowait(("restart", why, False))
