"""What `tsdev serve` does once its flags are parsed: bind the port, load the model, serve, stop.

* The port is bound before the model loads, so a port in use is reported at once (exit status 2), not after
  the load; the socket only listens once the server is ready (until then connections are refused).
* `listening on http://HOST:PORT` is the banner's last line, printed once uvicorn accepts connections: a
  request sent the moment it appears is served.
* SIGINT and SIGTERM (Ctrl-C, `tsdev watch` restarting, `tsdev profile` stopping, ServerProcess.stop) stop
  it in under a second (0.2 s on the dev box, whatever stdout is), quietly, with status 0: requests in flight end
  with finish reason "abort" and open streams (completions and the control events stream) end, so uvicorn's
  graceful shutdown finds no connection to wait for; then the process leaves without the interpreter's teardown
  (`leave`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from tsdev_runtime.config import EngineConfig, ServerConfig

# uvicorn cancels what is still open this long after a stop; streams end by themselves well before.
GRACEFUL_SHUTDOWN_S = 3
BACKLOG = 2048  # uvicorn's default
API_PROCESS_STOP_S = 2  # how long a stopping engine process waits for its API process before killing it


class ApiProcess:
    """The API process (`python -m tsdev.launch.api`: the HTTP front) beside this engine process, started before
    the model loads so that its imports overlap the load; it listens on the public socket once the engine says hello
    over `channel` (runtime/tsdev_runtime/engine/wire.py). Either stops when the other dies: the channel closes. It
    runs in a session of its own: Ctrl-C (or SIGTERM) reaches this process, which signals it at once (`stop_soon`:
    their shutdowns, each ending its requests with finish reason "abort", overlap) and waits for it (`stop`)."""

    def __init__(self, public: socket.socket):
        self.channel, theirs = socket.socketpair()
        self.port = public.getsockname()[1]
        fds = (public.fileno(), theirs.fileno())
        self.proc = subprocess.Popen([sys.executable, "-m", "tsdev.launch.api", *map(str, fds)], pass_fds=fds,
                                     start_new_session=True)
        theirs.close()
        self.dir = Path(tempfile.mkdtemp(prefix="tsdev-engine-"))  # only this user may reach the socket in it
        self.socket_path = self.dir / "app.sock"
        from tsdev_runtime.engine.errors import AT_FATAL_EXIT

        AT_FATAL_EXIT.append(self.remove_socket)  # (the API process removes it too when this one dies)

    def hello(self, config: EngineConfig, server: ServerConfig, name: str):
        """Tell the API process what it serves -- the checkpoint's facts, the server's settings -- so that it builds
        its app while the model loads; returns the checkpoint, for the engine to load, and the seconds it took to open
        (the default model's is written on first use)."""
        from tsdev_runtime.engine.llm_engine import LLMEngine
        from tsdev_runtime.engine.wire import frame
        from tsdev_runtime.server.control import disabled_routes

        start = time.perf_counter()
        checkpoint = LLMEngine.open_checkpoint(config)
        opened = time.perf_counter() - start
        self.channel.sendall(frame(("hello", {
            "server": dataclasses.asdict(server), "served_model_name": name, "port": self.port,
            "engine_socket": str(self.socket_path), "tokenizer_dir": str(config.tokenizer_dir(checkpoint.dir)),
            "max_model_len": checkpoint.max_model_len, "vocab_size": checkpoint.config.vocab_size,
            "disabled_routes": disabled_routes(server.allow_reload_forward)})))
        return checkpoint, opened

    def listen(self) -> socket.socket:
        """The Unix socket the engine process's app answers the API process on."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.socket_path))
        sock.listen(BACKLOG)
        return sock

    def stop_soon(self) -> None:
        """SIGTERM: its server stops taking requests and ends those in flight; `stop` waits for it (and signals it
        again, which only repeats what the first did)."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.stop_soon()
            from tsdev.launch.child import reap

            reap(self.proc, API_PROCESS_STOP_S)
        self.channel.close()
        self.remove_socket()

    def remove_socket(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: any free one), not listening yet."""
    # IPPROTO_TCP named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets that say they are TCP;
    # with it on, a streamed response's small writes waited for the client's delayed ACK (~40 ms, bunched chunks)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        # A restarted server binds while its last run's connections may still be in TIME_WAIT. (Linux still
        # refuses a port that another socket listens on.)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def bind_error(exc: OSError, host: str, port: int) -> str:
    """What went wrong binding host:port, and what to do about it."""
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} is in use on {host} (another server holds it): stop the other server, "
                "or pass --port")
    if exc.errno == errno.EACCES:
        return f"cannot listen on {host}:{port}: permission denied (ports below 1024 need privileges): pass --port"
    if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
        return f"cannot listen on {host}: not an address of this machine: pass --host (e.g. 127.0.0.1 or 0.0.0.0)"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


def process_age() -> float | None:
    """Seconds since this process began (Linux: /proc), None elsewhere; for a standby that took a start
    (tsdev/launch/standby.py), since it took it."""
    from tsdev.launch.child import HANDED_OVER_ENV

    if handed_over := os.environ.get(HANDED_OVER_ENV):
        return time.time() - float(handed_over)
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, clock ticks
        return float(Path("/proc/uptime").read_text().split()[0]) - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def startup_parts(before: float | None, imports: float, t: dict, total: float | None) -> dict[str, float]:
    """Where every second of the start went, in order: `before` (the interpreter, the CLI's imports, its checks: the
    process's age when serving began), the runtime's imports, then the engine's phases; `other` is what none of
    them holds, so the parts add up to `total`, the process's age now (both None where it cannot be read: no
    `other` then). GET /server_info's `startup`, which `tsdev watch`'s restart line shows."""
    parts = {"imports": imports, "checkpoint": t.get("checkpoint", 0.0), "load": t["load"], "warm-up": t["warm"],
             "capture": t["capture"] + t["capture_prefill"]}
    if before is not None:
        parts = {"python and the CLI": before, **parts}
        if total is not None:
            parts["other"] = max(total - sum(parts.values()), 0.0)
    return parts


def describe_startup(before: float | None, imports: float, t: dict, compiles: int, total: float | None,
                     built: int | None = None) -> str:
    """The startup line: `startup_parts`, the captures split, the compiles counted (`built`: how many of them
    Triton's disk cache did not answer)."""
    parts = startup_parts(before, imports, t, total)
    other = parts.pop("other", None)
    cached = "" if built is None else f" ({built} built, {compiles - built} from Triton's disk cache)"
    text = (", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items())
            + f" (decode {t['capture']:.2f}, prefill {t['capture_prefill']:.2f}); {compiles} Triton compile(s) in the "
              f"warm-up and capture{cached}")
    if other is None:
        return f"startup: {text}"
    from tsdev.launch.child import HANDED_OVER_ENV

    since = "a standby took the start" if os.environ.get(HANDED_OVER_ENV) else "the process began"
    return f"startup: {total:.2f} s since {since} = {text}; other {other:.2f} s"


class StartupProgress(logging.Handler):
    """What `tsdev serve` is doing while it starts (the imports, then the runtime's `tsdev_runtime.startup` log: the
    default checkpoint written, the model built, the weights loaded, warm-up, each kernel compiled, the captures), and
    for how long: the spinner's text on a terminal, its seconds counting; else each phase's line as it begins and,
    while one logs nothing, a line every PROGRESS_S seconds, so a first start on a fresh machine (tens of seconds of
    imports and compiles) never waits two seconds silently."""

    PROGRESS_S = 1.5  # off a terminal: the longest silence
    SPINNER_S = 1.0  # on a terminal: the spinner's seconds move on this often, a phase logging nothing meanwhile

    def __init__(self, console: Console, status, clock: Callable[[], float] = time.perf_counter):
        super().__init__(logging.INFO)
        self.console, self.status, self.message, self.clock = console, status, "starting", clock
        self.start = self.said = clock()
        self._done = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True)

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()
        self.show()

    def show(self) -> None:
        """The current phase and the seconds since the start: the spinner's text, or (off a terminal) a line."""
        seconds = f"{self.clock() - self.start:.0f} s"
        if self.console.is_terminal:
            self.status.update(f"{escape(self.message)} ({seconds})")
        else:
            self.console.print(f"starting ({seconds}): {self.message}", markup=False, highlight=False, soft_wrap=True)
        self.said = self.clock()

    def _tick(self) -> None:
        while not self._done.wait(self.SPINNER_S if self.console.is_terminal else self.PROGRESS_S / 4):
            if self.console.is_terminal or self.clock() - self.said >= self.PROGRESS_S:
                self.show()

    def __enter__(self) -> "StartupProgress":
        logger = logging.getLogger("tsdev_runtime.startup")
        self._saved = logger.level, logger.propagate
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._ticker.join()  # no line after the phase ended
        logger = logging.getLogger("tsdev_runtime.startup")
        logger.removeHandler(self)
        logger.level, logger.propagate = self._saved


KV_BYTES = {"float8_e4m3fn": 1, "bfloat16": 2, "float16": 2, "float32": 4}


def kv_pool_note(info) -> str:
    """' in e4m3 (fp8): 2x the tokens bfloat16 would hold in the same memory' for an fp8 pool, else ''."""
    if info.kv_cache_dtype != "float8_e4m3fn":
        return ""
    return f" in e4m3 (fp8): {KV_BYTES.get(info.dtype, 2)}x the tokens {info.dtype} would hold in the same memory"


def describe_loaded(name: str, info, timings: dict) -> str:
    """'loaded NAME (architecture, parameters, dtype) from DIR on DEVICE in 1.2 s': the seconds are the checkpoint's
    opening and the weights' load only; the warm-up and the captures have their own line (`describe_startup`).
    `info` is the engine's `describe()`."""
    return (f"loaded [bold]{escape(name)}[/bold] ({info.architecture}, {info.parameters / 1e6:.1f} M parameters, "
            f"{info.dtype}) from {escape(str(info.model_dir))} on {info.device} in "
            f"{timings.get('checkpoint', 0.0) + timings['load']:.1f} s")


def weights_source(report) -> str:
    """Where a restart's weights came from, for the loaded line: handed over by the server it replaced, or read
    and why they were not handed over (runtime/tsdev_runtime/weights/handover.py); nothing for a plain read."""
    if report.format == "handed over":
        return "; the weights handed over by the server it replaces"
    return f"; the weights read ({report.detail})" if report.detail.startswith("not handed over") else ""


def describe_graphs(info, cuda: bool, timings: dict) -> str:
    """'35 decode graphs captured in 0.30 s; 40 prefill graphs (16..2048 tokens) captured in 0.80 s'.
    `info` is the engine's `describe()`."""
    done = "captured" if cuda else "prepared (CPU: no capture)"
    parts = []
    if info.decode_graph_sizes:
        parts.append(f"{len(info.decode_graph_sizes)} decode graph(s) {done} in {timings['capture']:.2f} s")
    buckets = info.prefill_graph_buckets
    if info.prefill_graphs_failed:
        parts.append(f"prefill graphs failed to capture ({info.prefill_graphs_failed}): prefill runs eagerly")
    elif buckets:
        parts.append(f"{len(buckets)} prefill graph(s) ({buckets[0]}..{buckets[-1]} tokens) "
                     f"{done} in {timings['capture_prefill']:.2f} s")
    return "; ".join(parts) or "CUDA graphs off"


def claim_address(server: ServerConfig, console: Console) -> socket.socket | None:
    """The server's bound socket, or None (the reason printed) when its security flags do not go together or the
    address cannot be bound: `tsdev serve` (and the --dp front) then exit with status 2."""
    from tsdev_runtime.server.security import startup_refusal

    if refusal := startup_refusal(server):
        console.print(f"[red]error:[/red] {escape(refusal)}")
        return None
    try:
        return bind(server.host, server.port)
    except OSError as exc:
        console.print(f"[red]error:[/red] {bind_error(exc, server.host, server.port)}")
        return None


def run_server(config: EngineConfig, server: ServerConfig, console: Console | None = None, early_pool=None) -> int:
    """Bind, load the model, serve until SIGINT/SIGTERM. Returns the exit status: 0 once stopped, 2 when the
    security flags do not go together or the port or the model cannot be used, 130 for Ctrl-C during the load.
    `early_pool`: `early_compile_pool`'s, this start's compile pool (closed when it ends)."""
    from tsdev.launch.tensor_ranks import fail_fast, follow, launched_rank, start_ranks, stop_ranks

    console = console or Console(stderr=True, soft_wrap=True)
    rank = launched_rank()
    if config.world_size > 1 and rank:  # torchrun started this process as a rank other than 0: it follows
        return follow(config, server.allow_reload_forward, rank)
    sock = claim_address(server, console)
    if sock is None:
        return 2
    children = []
    if config.world_size > 1:
        from tsdev_runtime import distributed

        if rank is None:  # not launched by torchrun: this command starts the other ranks
            children = start_ranks(config, server.allow_reload_forward)
        with fail_fast(children):
            distributed.init(0, config.world_size, config.device, config.rank_timeout_s)
    with sock:
        try:
            status = _load_and_serve(config, server, sock, console, early_pool)
        except KeyboardInterrupt:  # Ctrl-C while loading, before the server handles signals itself
            console.print("stopped before the server started")
            return 130
        finally:
            stop_ranks(children)
    return leave(status) if status == 0 else status


def leave(status: int) -> int:
    """End the process at once, the server stopped and every output flushed. The interpreter's own teardown (torch's,
    Triton's and the model's objects freed one by one, the collector's last pass, their libraries unloaded) took
    0.74 of the 0.93 s from SIGINT to exit on the 2-core dev box, and longer with stdout in a file elsewhere: it
    alone kept Ctrl-C over a second. Not under a CUDA tool (nsys or ncu, which inject themselves with
    CUDA_INJECTION64_PATH / NSYS_* variables and write their reports at a normal exit): returns `status` then."""
    if os.environ.get("CUDA_INJECTION64_PATH") or any(name.startswith("NSYS_") for name in os.environ):
        return status
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


IMPORTING = "importing torch, Triton and the engine"


def _load_and_serve(config: EngineConfig, server: ServerConfig, sock: socket.socket, console: Console,
                    early_pool=None) -> int:
    before = process_age()
    api = pool = None
    try:
        with console.status(f"{IMPORTING}...") as status, StartupProgress(console, status):
            logging.getLogger("tsdev_runtime.startup").info(IMPORTING)  # said first: torch's import takes seconds
            imports_start = time.perf_counter()
            import jinja2  # noqa: F401  the startup's imports, timed here (_serve names what it uses)
            import uvicorn  # noqa: F401

            import tsdev_runtime.engine.llm_engine  # noqa: F401
            import tsdev_runtime.server.app  # noqa: F401

            imports = time.perf_counter() - imports_start
            if config.device.startswith("cuda"):  # the first kernel's key, beside the model's load
                from tsdev.launch.child import warm_triton_key

                threading.Thread(target=warm_triton_key, name="triton-key", daemon=True).start()
            api = ApiProcess(sock) if server.api_process else None  # it imports while the model loads
            pool = start_compile_pool(config, server, early_pool)  # its workers warm up while the model loads
            prewarming = prewarm(pool, config)  # and compile what the last such start compiled, side by side
            name = server.served_model_name or ("tsdev-default" if config.model is None else Path(config.model).name)
            engine = _load(config, server, console, api, name, prewarming)
        if engine is None:
            return 2
        if prewarming is not None:  # what this start compiled, for the next one (not the graphs captured later)
            from tsdev.hotreload import default_packages, manifest
            from tsdev.hotreload.pool import imported

            with contextlib.suppress(OSError):  # (a read-only cache: the next start compiles as this one did)
                manifest.write(prewarming.manifest, manifest.entries(imported(default_packages())))
        return _serve(config, server, sock, console, pool, before, imports, api, engine, name)
    finally:
        if pool is not None:
            pool.close()
        if api is not None:
            api.stop()


def _load(config: EngineConfig, server: ServerConfig, console: Console, api: ApiProcess | None, name: str,
          prewarming: Prewarm | None):
    """The engine, loaded and warmed; None (the reason printed) when the checkpoint or a flag cannot be used. The
    checkpoint is opened first (the default model's written on its first use), then a fresh machine waits for the
    pool's compiles of the shipped warm-up (`Prewarm.wait`: counted in the warm-up), then the engine loads and warms."""
    from tsdev_runtime.engine.llm_engine import LLMEngine

    show_tuned_files()
    logging.getLogger("tsdev_runtime.startup").info("loading the model (the first run creates the default checkpoint)")
    try:
        start = time.perf_counter()
        checkpoint, opened = api.hello(config, server, name) if api is not None else (LLMEngine.open_checkpoint(config),
                                                                                       None)
        opened = time.perf_counter() - start if opened is None else opened
        waited = time.perf_counter()
        if prewarming is not None:
            prewarming.wait()
        waited = time.perf_counter() - waited
        engine = LLMEngine(config, checkpoint)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return None
    engine.startup_timings["checkpoint"] += opened  # (opened before the engine, and given to it)
    engine.startup_timings["warm"] += waited
    return engine


def _serve(config: EngineConfig, server: ServerConfig, sock: socket.socket, console: Console, pool,
           before: float | None, imports: float, api: ApiProcess | None, engine, name: str) -> int:
    import uvicorn
    from jinja2 import TemplateError

    from tsdev_runtime.engine.compiles import jit_built, jit_compiles
    from tsdev_runtime.server.app import build_app
    from tsdev_runtime.server.chat import ChatTemplate
    from tsdev_runtime.server.security import SecurityPolicy, describe

    info = engine.describe()
    graphs = describe_graphs(info, config.device.startswith("cuda"), engine.startup_timings)
    age = process_age()
    moments = {"startup line": time.time()}  # (GET /server_info's: tsdev watch splits its restarts' time by them)
    if age is not None:
        moments = {"began": moments["startup line"] - age, **moments}
    console.print(
        f"{describe_loaded(name, info, engine.startup_timings)}{weights_source(engine.control.load_report)}\n"
        f"KV pool: {info.kv_pages} pages x {info.page_size} tokens{kv_pool_note(info)}; "
        f"context length {info.max_model_len}; "
        f"up to {info.max_running} requests at once\n"
        f"warmed in {engine.startup_timings['warm']:.2f} s; {graphs}\n"
        f"{describe_startup(before, imports, engine.startup_timings, sum(jit_compiles().values()), age, jit_built())}"
    )
    reloader = None
    if server.allow_reload_forward:
        from tsdev.hotreload import Reloader, default_packages

        workers = ""
        if pool is not None:
            workers = f"; {pool.workers} compile worker(s)"
        elif server.compile_workers:
            workers = "; no compile workers on the CPU (Triton's interpreter compiles no binaries)"
        # snapshots the sources the server runs now; compiles them once it listens (started)
        reloader = Reloader(default_packages(), pool=pool, compile_later=True)
        console.print(f"reload_forward enabled for {', '.join(reloader.packages)}{workers}")
    if access := describe(server):
        console.print(access)
    log_to_stderr(server.log_level)
    port = sock.getsockname()[1]
    try:
        if api is not None:  # refused here, before either process serves (one process: build_app loads it)
            ChatTemplate(engine.tokenizer_dir, server.chat_template)
        app = build_app(engine, name, reloader, max_request_body_bytes=server.max_request_body_bytes,
                        security=SecurityPolicy.of(server), chat_template=server.chat_template,
                        api_channel=api and api.channel,
                        startup=startup_parts(before, imports, engine.startup_timings, age), moments=moments)
    except (FileNotFoundError, ValueError, TemplateError) as exc:  # --chat-template, or the checkpoint's template
        console.print(f"[red]error:[/red] the chat template: {exc}")
        return 2
    if api is not None:
        listening = api.listen()
    else:
        try:
            sock.listen(BACKLOG)  # another server may have bound the port meanwhile (SO_REUSEADDR): one listens
        except OSError as exc:
            console.print(f"[red]error:[/red] {bind_error(exc, server.host, server.port)}")
            return 2
        listening = sock

    def started() -> None:  # (the API process says it once it listens)
        if api is None:
            console.print(f"listening on [bold]http://{server.host}:{port}[/bold] (OpenAI API under /v1)")
        if reloader is not None:
            reloader.compile_in_background()

    uvicorn_config = uvicorn.Config(app, log_level=server.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    async_engine = app.state.async_engine

    async def stop() -> None:  # SIGINT/SIGTERM: the API process's shutdown beside this one's (each ~0.1 s of uvicorn's)
        if api is not None:
            api.stop_soon()
        await async_engine.shutdown()

    from tsdev_runtime.weights.handover import Listener

    listener = Listener.open(config.world_size)  # a restart's standby may take the weights from this process
    quiet_server_class(uvicorn.Server)(uvicorn_config, started, stop, lambda: async_engine.left_behind).run(
        sockets=[listening])
    engine.control.close()  # the other ranks, if any, stop
    if listener is not None:
        outcome = engine.control.offer_weights(listener)
        console.print(f"weights for the restart: {outcome}")
    return 0


def start_compile_pool(config: EngineConfig, server: ServerConfig, early=None):
    """The compile workers of --compile-workers (reloads on CUDA only), for the serving device's target: `early`'s
    (`early_compile_pool`, aimed at it now), else started now; None (`early` closed) when this start has none."""
    workers = default_compile_workers() if server.compile_workers is None else server.compile_workers
    if not (workers and server.allow_reload_forward and config.device.startswith("cuda")):
        if early is not None:
            early.close()
        return None
    import torch
    from triton.backends.compiler import GPUTarget

    from tsdev.hotreload import default_packages
    from tsdev.hotreload.pool import CompilePool, imported

    major, minor = torch.cuda.get_device_capability(torch.device(config.device))
    target, packages = GPUTarget("cuda", major * 10 + minor, 32), default_packages()
    if early is not None:
        early.aim(target, imported(packages))
        return early
    return CompilePool(packages, workers, target, imported(packages))


def early_compile_pool(device: str | None, allow_reload_forward: bool, workers: int | None, ranks: int):
    """The compile pool started as `tsdev serve` begins, before this process imports torch (seconds on a fresh
    machine): its workers import torch and Triton side by side with it, so that the warm-up manifest's compiles
    (`prewarm`) start as soon as the GPU's target is known. None where the start will have no pool (no reloads, no
    workers, a CPU device, no NVIDIA GPU seen here) or several ranks or servers (each starts its own); then, or
    where the GPU is not seen this way, the start makes its pool as before (`start_compile_pool`)."""
    from tsdev.hotreload import default_packages
    from tsdev.hotreload.pool import CompilePool

    workers = default_compile_workers() if workers is None else workers
    gpu = (device or "cuda").startswith("cuda") and nvidia_gpu_visible()
    if not (workers and allow_reload_forward and gpu and ranks == 1):
        return None
    return CompilePool(default_packages(), workers, modules=())  # aimed at the GPU by `start_compile_pool`


def nvidia_gpu_visible() -> bool:
    """An NVIDIA GPU this process may use, by the driver's files and CUDA_VISIBLE_DEVICES (without importing torch;
    `tsdev serve`'s default device is decided by torch later)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


# What a start's configuration changes in the kernels it compiles (not: which graphs come first after a restart, the
# seed, timeouts, the checks, how the weights are read, the memory kept back, the device's index)
NOT_IN_MANIFEST_KEY = {"cudagraph_capture_first", "prefill_graph_capture_first", "seed", "rank_timeout_s",
                       "kernel_check", "load_format", "load_memory_limit", "gpu_memory_utilization", "kv_pages",
                       "device"}


def manifest_path(config: EngineConfig, target, triton_version: str) -> Path:
    """<cache>/warmup/sm90-triton3.6.0-<digest of the configuration>.json: the binaries a start of this configuration
    on this GPU architecture with this Triton compiled (tsdev/hotreload/manifest.py)."""
    import hashlib

    from tsdev_kernels.cache import cache_dir

    kept = {k: v for k, v in sorted(dataclasses.asdict(config).items()) if k not in NOT_IN_MANIFEST_KEY}
    digest = hashlib.sha256(repr(kept).encode()).hexdigest()[:16]
    return cache_dir() / "warmup" / f"sm{target.arch}-triton{triton_version}-{digest}.json"


SHIPPED_WARMUP = Path(__file__).resolve().parent.parent / "warmup"  # manifests made on a GPU for a fresh machine
PREWARM_WAIT_S = 60.0  # the longest a fresh machine's warm-up waits for the pool's compiles of the shipped manifest


@dataclasses.dataclass
class Prewarm:
    manifest: Path  # this machine's manifest for the configuration, to write once this start has warmed up
    # the compiles of the manifest tsdev ships (a fresh machine's first start: Triton's cache is empty), which the
    # warm-up waits for rather than compiling the same kernels again, one at a time, beside the pool (`wait`)
    shipped: threading.Thread | None = None

    def wait(self, timeout: float = PREWARM_WAIT_S) -> None:
        if self.shipped is not None and self.shipped.is_alive():
            logging.getLogger("tsdev_runtime.startup").info(
                "waiting for the compile workers to finish the shipped warm-up kernels (a fresh machine)")
            self.shipped.join(timeout)


def prewarm(pool, config: EngineConfig) -> Prewarm | None:
    """Hand the pool (a thread waits on it) what the last start of this configuration compiled -- this machine's
    manifest, else one shipped for it (tsdev/warmup/: a fresh machine's first start) -- so that the warm-up finds it
    in Triton's disk cache. None without a pool."""
    if pool is None:
        return None
    import triton

    from tsdev.hotreload import manifest

    path = manifest_path(config, pool.target, triton.__version__)
    local = manifest.read(path)
    started = Prewarm(path)
    if jobs := manifest.jobs(local or manifest.read(SHIPPED_WARMUP / path.name), pool.target):
        logging.getLogger("tsdev_runtime.startup").info(
            f"compiling {len(jobs)} kernel {'binary' if len(jobs) == 1 else 'binaries'} the last start of this "
            f"configuration built, in {pool.workers} worker(s), while the model loads")
        thread = threading.Thread(target=_compile_quietly, args=(pool, jobs), name="prewarm", daemon=True)
        thread.start()
        started.shipped = None if local else thread
    return started


def _compile_quietly(pool, jobs) -> None:
    """The manifest's jobs: what fails (a kernel changed since, the pool closed at exit) the warm-up compiles."""
    try:
        pool.compile({}, jobs)
    except Exception:  # noqa: BLE001
        pass


def default_compile_workers() -> int:
    """Half the cores, at most 8: an edit compiles a handful of kernels; the rest of the host serves."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class StderrHandler(logging.StreamHandler):
    """Plain lines on sys.stderr as it is when each line is written (a redirection or a test's capture made after the
    handler), never a stream since closed."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def show_tuned_files() -> None:
    """The kernels' one line per shape saying which tuned file serves it -- the user's (`tsdev tune`), the one shipped
    for this GPU or its sibling's -- or that defaults do (tsdev_kernels.tuned), on stderr as the warm-up finds them."""
    logger = logging.getLogger("tsdev_kernels.tuned")
    if not logger.handlers:
        logger.addHandler(StderrHandler())
        logger.setLevel(logging.INFO)


def log_to_stderr(log_level: str = "warning") -> None:
    """The runtime's log lines (one per reload, unhandled errors) as plain lines on stderr; with `--log-level info`
    (or debug, trace) also a line per completion request (who sent it, what it asks: tsdev_runtime.requests)."""
    for name, level in (("tsdev_runtime.server", logging.INFO),
                        ("tsdev_runtime.requests", logging.INFO if log_level in ("info", "debug", "trace")
                         else logging.WARNING)):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(StderrHandler())
            logger.setLevel(level)
            logger.propagate = False


def quiet_server_class(base: type) -> type:
    """uvicorn's Server (imported late: it is part of the startup's imports), told when it accepts
    connections, stopping the app's streams on SIGINT/SIGTERM, and exiting quietly after such a stop
    (uvicorn re-raises the signal, which Ctrl-C turns into a KeyboardInterrupt traceback). Its main loop wakes on the
    signal instead of at its next 0.1 s tick: a restart waits for the old server (and its API process) to exit."""

    class Server(base):
        def __init__(self, config, on_started, stop_streams, left_behind=lambda: False):
            super().__init__(config)
            self._on_started, self._stop_streams, self._stopping = on_started, stop_streams, None
            self._left_behind = left_behind
            self._exiting: asyncio.Event | None = None  # made in the loop's thread by main_loop

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                self._on_started()

        async def main_loop(self) -> None:
            """uvicorn's (a tick every 0.1 s: the date header, the exit flag), woken at once by `handle_exit`."""
            self._exiting, counter = asyncio.Event(), 0
            while not await self.on_tick(counter):
                counter = (counter + 1) % 864000
                try:
                    await asyncio.wait_for(self._exiting.wait(), 0.1)
                except asyncio.TimeoutError:
                    pass

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                self._stopping = asyncio.ensure_future(self._stop_streams())
                sys.setswitchinterval(0.0005)  # this thread gets the GIL back sooner from a busy engine thread
            super().handle_exit(sig, frame)
            if self._exiting is not None:
                self._exiting.set()

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets=sockets)
            if self._left_behind():  # a control call still runs on the engine thread: asyncio's teardown would
                leave(0)             # wait on it; nothing else is left to do

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            loop = asyncio.get_running_loop()
            signals = (signal.SIGINT, signal.SIGTERM)
            for sig in signals:
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in signals:
                    loop.remove_signal_handler(sig)

    return Server
