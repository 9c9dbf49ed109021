"""`tsdev serve` as a child process: the one way the toolkit, the tests and the benchmarks start, wait for
and stop a server (`tsdev watch` from asyncio, `tsdev profile` under nsys, the rest synchronously).

The child runs in its own session (Ctrl-C reaches the parent, which stops the server itself) and, on
Linux, gets SIGTERM when its parent dies, so that a killed parent leaves no server holding the GPU or the
port. Its output goes to a log file (or the parent's terminal when there is none); a failed start shows
the log's last lines. With `standby=True` (tsdev watch) a standby process (tsdev/launch/standby.py: the interpreter up,
torch, Triton and the HTTP stack imported) waits beside the running server and takes the next start.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from tsdev_runtime.control_protocol import WEIGHTS_HANDOVER_ENV, restart_marker

RESTART_WEIGHTS_ENV = "TSDEV_RESTART_WEIGHTS"  # "read": a restart's standby reads the checkpoint (no hand-over)

POLL_S = 0.01  # how often a start polls GET /health (a restart's hand-over waits on it: keep it short)
# what a server process and its standby (tsdev/launch/standby.py) say to each other:
HANDED_OVER_ENV = "TSDEV_HANDED_OVER_AT"  # when the standby took the start (the startup line counts from it)
DEVICE_ENV = "TSDEV_STANDBY_DEVICE"  # the device the next start serves on ("": the default); unset: do not touch CUDA
PREPARE = "prepare"  # a line before the arguments: import the project now (the old server is stopping meanwhile)
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None


def reap(proc: subprocess.Popen, timeout: float) -> None:
    """Wait for `proc` to exit, SIGKILL after `timeout` s: a blocking waitpid, which returns the moment the process
    exits (Popen.wait with a timeout polls, up to 50 ms late: a restart waits for the old server so)."""
    killer = threading.Timer(timeout, proc.kill)
    killer.daemon = True
    killer.start()
    try:
        proc.wait()
    finally:
        killer.cancel()


class StartFailed(RuntimeError):
    pass


class PortInUse(StartFailed):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_project(dest: Path) -> Path:
    """This checkout's packages and pyproject.toml, copied into `dest` (caches left out): a project whose sources a
    test or a benchmark edits, run with `cwd=dest, pythonpath=dest`, leaving the checkout untouched."""
    root = Path(__file__).resolve().parents[2]  # tsdev/launch/child.py
    for name in ("runtime", "kernels", "tsdev"):
        shutil.copytree(root / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", dest / "pyproject.toml")
    return dest


def project_pythonpath(project: Path, rest: str | None = None) -> str:
    """PYTHONPATH for a process that imports `project`'s packages (its import roots: tsdev/hotreload/snapshot.py)
    before any installed copy, followed by `rest` (default: this process's PYTHONPATH)."""
    from tsdev.hotreload.snapshot import import_roots

    rest = os.environ.get("PYTHONPATH", "") if rest is None else rest
    return os.pathsep.join([*map(str, import_roots(project)), *([rest] if rest else [])])


def local_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a server listening on host:port (an IPv6 address in brackets)."""
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in an argv (`--port 8000` or `--port=8000`), or None."""
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


def die_with_parent() -> None:
    """`preexec_fn` of a child that must not outlive this process (runs between fork and exec): a session of its
    own (Ctrl-C in a terminal reaches the parent alone), and SIGTERM when the parent dies, even by SIGKILL."""
    os.setsid()
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (sent when the forking thread ends: fork from the main one)


class ServerProcess:
    """`python -m tsdev serve ARGS`, started, waited for and stopped; restartable (start() again after stop())."""

    def __init__(self, args: Sequence[str] = (), port: int | None = None, *, allow_reload_forward: bool = False,
                 prefix: Sequence[str] = (), cwd: Path | None = None, pythonpath: Path | None = None,
                 log_path: Path | None = None, api_key: str | None = None, env: dict[str, str] | None = None,
                 standby: bool = False):
        """`port` (default: a free one) is added unless ARGS carry --port; `prefix` wraps the command (nsys);
        `pythonpath` is searched first for imports (a copy of the project); `log_path` None: the terminal;
        `api_key` reaches the server in its environment (TSDEV_API_KEY), never its argv, which `ps` shows; `env`:
        more variables for it (e.g. CUDA_VISIBLE_DEVICES); `standby`: keep a started process for the next start
        (started once the server is healthy, so that it never slows a start down; not with a `prefix`)."""
        args = list(args)
        if allow_reload_forward and "--allow-reload-forward" not in args:
            args.append("--allow-reload-forward")
        if flag_value(args, "--port") is None:
            args += ["--port", str(port or free_port())]
        self.serve_args = ["serve", *args]
        self.argv = [*prefix, sys.executable, "-m", "tsdev", *self.serve_args]
        self.url = local_url(flag_value(args, "--host") or "127.0.0.1", int(flag_value(args, "--port")))
        self.cwd, self.log_path = cwd, log_path
        extra = dict(env or {})
        if pythonpath is not None:
            extra["PYTHONPATH"] = project_pythonpath(pythonpath)
        if api_key:
            extra["TSDEV_API_KEY"] = api_key
        self.keep_standby = standby and not prefix
        if (weights := os.environ.get(RESTART_WEIGHTS_ENV, "handover")) not in ("handover", "read"):
            raise ValueError(f"{RESTART_WEIGHTS_ENV}={weights!r}: handover (a restart's standby takes the stopping "
                             "server's weights, the default) or read (it reads the checkpoint)")
        if self.keep_standby and weights == "handover":
            # the server it replaces hands a restart's standby its weights through this socket
            extra[WEIGHTS_HANDOVER_ENV] = str(Path(tempfile.gettempdir()) / f"tsdev-{os.getpid()}-{id(self):x}.sock")
        environment = {k: v for k, v in os.environ.items() if k != WEIGHTS_HANDOVER_ENV}  # not a replica's
        self.env = {**environment, **extra} if extra or len(environment) != len(os.environ) else None
        self.proc: subprocess.Popen | None = None  # None once stop() was called
        self._offset = 0  # where the current run's output starts in the log
        self.standby: subprocess.Popen | None = None  # the process the next start() hands its arguments to
        self.handed_over = False  # the current run is a standby that took over
        # when (time.time()) the current run's arguments went to its standby, and when it answered /health first
        # (and when that request was sent: polled every POLL_S, the first one the API process took)
        self.arguments_sent: float | None = None
        self.healthy_at: float | None = None
        self.healthy_asked_at: float | None = None

    @property
    def command_line(self) -> str:
        return " ".join(["tsdev", *self.serve_args])

    def start(self, header: str = "starting the server", extra_args: Sequence[str] = ()) -> None:
        """Start the child (returns at once), with `extra_args` for this run only; PortInUse when something
        already answers on the port."""
        try:
            httpx.get(self.url + "/health", timeout=1)
        except httpx.TransportError:
            pass
        else:
            raise PortInUse(f"something already answers on {self.url}: stop it or use another --port")
        log = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "a")
            log.write(f"\n--- {time.strftime('%H:%M:%S')} {header}: {' '.join([self.command_line, *extra_args])}\n")
            log.flush()
            self._offset = log.tell()
        try:
            standby, self.standby = self.standby, None
            self.handed_over = standby is not None and standby.poll() is None
            self.arguments_sent = self.healthy_at = self.healthy_asked_at = None
            if self.handed_over:
                standby.stdin.write((json.dumps([*self.serve_args, *extra_args]) + "\n").encode())
                standby.stdin.flush()
                self.proc, self.arguments_sent = standby, time.time()
            else:  # none yet, or it died: an ordinary start (the next standby replaces it)
                self.proc = self._spawn([*self.argv, *extra_args], log, subprocess.DEVNULL)
        finally:
            if log is not None:
                log.close()

    def _spawn(self, argv: list[str], log, stdin, env: dict[str, str] | None = None) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=stdin, stdout=log, stderr=None if log is None else subprocess.STDOUT,
                                cwd=self.cwd, env=env or self.env, preexec_fn=die_with_parent)

    def start_standby(self) -> None:
        """Start the process the next start() takes over, unless one waits already (its output: the log's)."""
        if not self.keep_standby or (self.standby is not None and self.standby.poll() is None):
            return
        log = open(self.log_path, "a") if self.log_path is not None else None
        try:

            env = {**(self.env or os.environ), DEVICE_ENV: flag_value(self.serve_args, "--device") or ""}
            self.standby = self._spawn([sys.executable, "-m", "tsdev.launch.standby"], log, subprocess.PIPE, env)
        finally:
            if log is not None:
                log.close()

    def prepare_standby(self) -> None:
        """Let the standby import the project now, while the current run stops (tsdev/launch/standby.py)."""

        if self.standby is not None and self.standby.poll() is None:
            if path := (self.env or {}).get(WEIGHTS_HANDOVER_ENV):  # the old server waits for it with its weights
                with contextlib.suppress(OSError):
                    Path(restart_marker(path)).touch()
            try:
                self.standby.stdin.write(f"{PREPARE}\n".encode())
                self.standby.stdin.flush()
            except OSError:  # it just died: start() makes an ordinary start
                pass

    def dismiss_standby(self) -> None:
        standby, self.standby = self.standby, None
        if standby is not None and standby.poll() is None:
            standby.stdin.close()  # it exits on an empty stdin
            try:
                standby.wait(5)
            except subprocess.TimeoutExpired:
                standby.kill()
                standby.wait()

    async def wait_healthy_async(self, timeout: float = 600, standby: bool = True) -> None:
        """Until GET /health answers 200; StartFailed (with the log's last lines) when the child exits first
        or is not healthy in time (then it is stopped). `standby` False: the caller starts the next standby
        (start_standby) once it has measured the new server on a quiet host."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while True:
                if (code := self.proc.poll()) is not None:
                    raise StartFailed(f"the server exited during startup ({describe_exit(code)}):\n{self.tail()}")
                try:
                    asked = time.time()
                    if (await client.get(self.url + "/health", timeout=2)).status_code == 200:
                        self.healthy_at, self.healthy_asked_at = time.time(), asked
                        if standby:
                            self.start_standby()
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    await self.stop_async()
                    raise StartFailed(f"the server was not healthy within {timeout:.0f} s:\n{self.tail()}")
                await asyncio.sleep(POLL_S)

    def wait_healthy(self, timeout: float = 600) -> None:
        asyncio.run(self.wait_healthy_async(timeout))

    async def exited(self) -> int | None:
        """When the current run ends: its exit status, or None when stop() ended it."""
        proc = self.proc
        while proc.poll() is None:
            await asyncio.sleep(0.1)
        return proc.returncode if proc is self.proc else None

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM, `timeout` s to exit, then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        reap(proc, timeout)

    async def stop_async(self, timeout: float = 20) -> None:
        await asyncio.to_thread(self.stop, timeout)

    @contextmanager
    def running(self, timeout: float = 600, stop_timeout: float = 20) -> Iterator["ServerProcess"]:
        """Started and healthy inside the block, stopped after it."""
        self.start()
        try:
            self.wait_healthy(timeout)
            yield self
        finally:
            self.stop(stop_timeout)
            self.dismiss_standby()

    def output(self) -> str:
        """What the current run printed so far (into the log)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, errors="replace") as log:
                log.seek(self._offset)
                return log.read()
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        if self.log_path is None:
            return "(its output is above)"
        return "\n".join(self.output().rstrip().splitlines()[-lines:]) or f"(nothing in {self.log_path})"


def warm_triton_key() -> None:
    """Triton's own cache key -- a hash of its install, libtriton's hundreds of MB included: 0.33 s on the 2-core dev
    box, paid once per process by the first kernel compiled or loaded from Triton's disk cache -- computed now, off
    the start's path: by a standby while it waits, by a first start beside its model's load (the hashing and the
    reads let go of the GIL). Nothing where this Triton keeps no such key."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:
            return
    triton_key()
