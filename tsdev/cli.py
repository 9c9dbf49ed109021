"""The `tsdev` command line."""
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from runtime.config import EngineConfig  # no torch: the serve flags' defaults are the engine config's

LIST_FLAGS = ("--cudagraph-capture-sizes", "--prefill-graph-capture-sizes")
# Every reload recaptures every prefill bucket: the ladder (40 buckets up to 2048 tokens) takes 1.2-1.7 s of
# it on the H200, three buckets ~0.1 s. A server that allows reloads is for development: it pads prompts more
# and reloads faster.
RELOAD_PREFILL_BUCKETS = [256, 1024]


def join_list_flags(argv: list[str]) -> list[str]:
    """Let list flags take space-separated values, as vLLM's do: `--cudagraph-capture-sizes 1 16 64`."""
    out, i = [], 0
    while i < len(argv):
        out.append(argv[i])
        if argv[i] in LIST_FLAGS:
            values = []
            while i + 1 < len(argv) and argv[i + 1].replace(",", "").isdigit():
                i += 1
                values.append(argv[i])
            out.append(",".join(values))
        i += 1
    return out


class _Typer(typer.Typer):
    def __call__(self, *args, **kwargs):
        if kwargs.get("args") is None and not args:
            sys.argv[1:] = join_list_flags(sys.argv[1:])
        elif kwargs.get("args") is not None:
            kwargs["args"] = join_list_flags(list(kwargs["args"]))
        return super().__call__(*args, **kwargs)


app = _Typer(
    help="Edit a Triton kernel or a layer, save, and see the effect on a running LLM server in about a second.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)


def parse_sizes(flag: str, value: str) -> list[int]:
    """A list flag's joined value ("1,16,64") as sorted distinct positive integers."""
    try:
        sizes = sorted({int(v) for v in value.split(",") if v})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise typer.BadParameter(f"give positive integers, e.g. {flag} 1 16 64", param_hint=flag)
    return sizes


def prefill_capture_sizes(flag: str | None, allow_reload_forward: bool) -> list[int] | None:
    """Explicit buckets from the flag; else a few when reloads are allowed; else None (the ladder)."""
    if flag:
        return parse_sizes("--prefill-graph-capture-sizes", flag)
    return list(RELOAD_PREFILL_BUCKETS) if allow_reload_forward else None


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _describe_startup(imports: float, t: dict) -> str:
    return (f"startup: imports {imports:.2f} s, load {t['load']:.2f} s, warm-up {t['warm']:.2f} s, capture "
            f"{t['capture'] + t['capture_prefill']:.2f} s (decode {t['capture']:.2f}, prefill {t['capture_prefill']:.2f})")


def _describe_graphs(info, cuda: bool, timings: dict) -> str:
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


@app.command()
def serve(
    model: Annotated[Optional[str], typer.Argument(help="Hugging Face checkpoint directory (Qwen3). "
                                                        "Omit it to serve the embedded default model.")] = None,
    model_opt: Annotated[Optional[str], typer.Option("--model", help="Same as the MODEL argument.")] = None,
    device: Annotated[Optional[str], typer.Option(help="cuda or cpu; default: cuda when a GPU is visible.")] = None,
    host: Annotated[str, typer.Option(help="Address to bind. The default keeps the server private to this machine.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port for the HTTP API.")] = 8000,
    max_running: Annotated[int, typer.Option(help="Most requests computed at once (the batch size). Decode graphs are "
                                                 "captured up to it: a larger value serves bigger batches from graphs "
                                                 "but makes startup and every reload's recapture longer.")] = EngineConfig.max_running,
    max_batched_tokens: Annotated[int, typer.Option(help="Token budget per engine step; longer prompts are prefilled in chunks of this size.")] = EngineConfig.max_batched_tokens,
    kv_pages: Annotated[Optional[int], typer.Option(help="Pages in the KV pool; default: fit the free GPU memory "
                                                         "(or max-running full contexts on CPU).")] = EngineConfig.kv_pages,
    page_size: Annotated[int, typer.Option(help="Tokens per KV page.")] = EngineConfig.page_size,
    max_model_len: Annotated[Optional[int], typer.Option(help="Longest prompt + completion, in tokens; default: "
                                                              "the model's, capped at 8192.")] = EngineConfig.max_model_len,
    dtype: Annotated[str, typer.Option(help="auto (checkpoint dtype on CUDA, float32 on CPU), bfloat16, float16, float32.")] = EngineConfig.dtype,
    gpu_memory_utilization: Annotated[float, typer.Option(help="Fraction of GPU memory the server may use in all.")] = EngineConfig.gpu_memory_utilization,
    no_prefix_caching: Annotated[bool, typer.Option("--no-prefix-caching", help="Do not share KV pages between requests with a common prefix.")] = not EngineConfig.enable_prefix_caching,
    served_model_name: Annotated[Optional[str], typer.Option(help="Model name in the API; default: the checkpoint directory's name.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the noise for requests that give no seed of their own.")] = EngineConfig.seed,
    cudagraph_capture_sizes: Annotated[Optional[str], typer.Option(
        help="Decode batch sizes to capture as CUDA graphs, e.g. `--cudagraph-capture-sizes 1 16 64`; larger "
             "batches run eagerly. Default: 1 2 4 8 16 24 ... 256 (up to --max-running). Fewer sizes capture "
             "faster (and reload faster).")] = None,
    enforce_eager: Annotated[bool, typer.Option("--enforce-eager", help="No CUDA graphs: every step runs eagerly.")] = EngineConfig.enforce_eager,
    prefill_graph_max_tokens: Annotated[int, typer.Option(
        help="Largest token count of a prefill (or mixed prefill + decode) step replayed from a breakable CUDA "
             "graph (attention runs eagerly between graph pieces); clamped to --max-batched-tokens. Buckets "
             "step from 16 by about 1/8 of their size. 0 turns prefill graphs off.", min=0)] = EngineConfig.prefill_graph_max_tokens,
    disable_prefill_graph: Annotated[bool, typer.Option(
        "--disable-prefill-graph", help="Run prefill and mixed steps eagerly (decode graphs stay on).")] = False,
    prefill_graph_capture_sizes: Annotated[Optional[str], typer.Option(
        help="Explicit prefill token buckets instead of the ladder, e.g. `--prefill-graph-capture-sizes 64 256 "
             "1024`; clamped to the largest, which is always captured. Default: the ladder; with "
             "--allow-reload-forward, 256 1024 (every reload recaptures every bucket).")] = None,
    allow_reload_forward: Annotated[bool, typer.Option(
        "--allow-reload-forward",
        help="Enable POST /v1/rl/engine/reload_forward, which re-executes edited model/kernel code from disk "
             "in this process. For development only (`tsdev watch` turns it on); without it the route answers 403.")] = False,
    log_level: Annotated[str, typer.Option(help="uvicorn log level (warning shows errors only).")] = "warning",
):
    """Serve a Qwen3 model over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    import time

    imports_start = time.perf_counter()
    import uvicorn
    from rich.console import Console

    from runtime.engine.llm_engine import LLMEngine
    from runtime.server.app import build_app

    imports = time.perf_counter() - imports_start
    console = Console(stderr=True, soft_wrap=True)
    if model and model_opt and model != model_opt:
        raise typer.BadParameter(f"MODEL {model!r} and --model {model_opt!r} disagree: give one")
    if device and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            console.print(f"[red]error:[/red] --device {device}, but this torch ({torch.__version__}) sees no CUDA GPU: "
                          "use --device cpu, or install a CUDA build of torch on a machine with a GPU")
            raise typer.Exit(2)
    config = EngineConfig(
        model=model or model_opt, device=device or _default_device(), dtype=dtype, max_running=max_running,
        max_batched_tokens=max_batched_tokens, max_model_len=max_model_len, page_size=page_size, kv_pages=kv_pages,
        gpu_memory_utilization=gpu_memory_utilization, seed=seed, enable_prefix_caching=not no_prefix_caching,
        enforce_eager=enforce_eager, prefill_graph_max_tokens=0 if disable_prefill_graph else prefill_graph_max_tokens,
    )
    if cudagraph_capture_sizes:
        config.cudagraph_capture_sizes = parse_sizes("--cudagraph-capture-sizes", cudagraph_capture_sizes)
    config.prefill_graph_capture_sizes = prefill_capture_sizes(prefill_graph_capture_sizes, allow_reload_forward)
    start = time.perf_counter()
    with console.status("loading the model (the first run creates the default checkpoint)..."):
        try:
            engine = LLMEngine(config)
        except (FileNotFoundError, ValueError) as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None
    name = served_model_name or ("tsdev-default" if config.model is None else Path(config.model).name)
    info = engine.describe()
    graphs = _describe_graphs(info, config.device.startswith("cuda"), engine.startup_timings)
    console.print(
        f"loaded [bold]{name}[/bold] ({info.architecture}, {info.parameters / 1e6:.1f} M parameters, "
        f"{info.dtype}) from {info.model_dir} on {info.device} in {time.perf_counter() - start:.1f} s\n"
        f"KV pool: {info.kv_pages} pages x {info.page_size} tokens; context length {info.max_model_len}; "
        f"up to {info.max_running} requests at once\n"
        f"warmed in {engine.startup_timings['warm']:.2f} s; {graphs}\n"
        f"{_describe_startup(imports, engine.startup_timings)}\n"
        f"listening on [bold]http://{host}:{port}[/bold] (OpenAI API under /v1)"
    )
    reloader = None
    if allow_reload_forward:
        from tsdev.hotreload import Reloader, default_packages

        reloader = Reloader(default_packages())  # snapshots the sources the server is running now
        console.print(f"reload_forward enabled for {', '.join(reloader.packages)}")
    # Event streams never end by themselves: give open connections 3 s on shutdown, then close them.
    uvicorn.run(build_app(engine, name, reloader), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=3)


@app.command()
def reload(
    url: Annotated[str, typer.Option(help="The server (started with --allow-reload-forward, or by `tsdev watch`).")] = "http://127.0.0.1:8000",
    modules: Annotated[Optional[list[str]], typer.Option("--modules", "-m", help="Force these modules (and their dependents) to re-execute, changed or not. Repeat the flag for several.")] = None,
    mode: Annotated[str, typer.Option(help="wait: running requests finish first; abort: they are aborted.")] = "wait",
    timeout_s: Annotated[Optional[float], typer.Option(help="Give up (changing nothing) if drain + reload take longer.")] = None,
    files: Annotated[Optional[list[str]], typer.Option("--file", "-f", help="Force the modules these files hold (for editor save hooks); "
                                                       "files outside the reloadable packages' projects are ignored. Repeatable.")] = None,
):
    """Reload the server's forward pass now: edited modules and their dependents re-execute in place.

    Prints one line per worker; exits 0 only when every worker reloaded (for editor save hooks and scripts).
    """
    from rich.console import Console

    from tsdev.client import reload_forward
    from tsdev.outcome import worker_text

    console = Console(soft_wrap=True, highlight=False)
    if mode not in ("wait", "abort"):
        raise typer.BadParameter("--mode is wait or abort")
    import httpx

    if files:
        from tsdev.watch.watcher import classify_files

        forced, others, ignored = classify_files(files)
        if not forced and not others:
            console.print(f"nothing to reload: {', '.join(ignored)} not in a reloadable package's project")
            raise typer.Exit(0)
        modules = [*(modules or []), *forced] or None  # others: the server reports them as needing a restart

    try:
        reply = reload_forward(url, modules, mode, timeout_s)
    except httpx.TransportError as exc:
        console.print(f"[red]error:[/red] cannot reach {url} ({exc}): is a server running there? Start one with "
                      "`tsdev watch` or `tsdev serve --allow-reload-forward`, or pass --url")
        raise typer.Exit(2) from None
    except RuntimeError as exc:  # 403 and other refusals
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    for worker in reply.workers:
        console.print(worker_text(worker))
    raise typer.Exit(0 if reply.ok else 1)


@app.command()
def bench(
    url: Annotated[str, typer.Option(help="Any OpenAI-compatible server.")] = "http://127.0.0.1:8000",
    endpoint: Annotated[str, typer.Option(help="completions (token-id prompts) or chat (text prompts).")] = "completions",
    model: Annotated[Optional[str], typer.Option(help="Model name to send; default: the server's first model.")] = None,
    num_prompts: Annotated[int, typer.Option(help="Requests to measure.")] = 100,
    input_len: Annotated[int, typer.Option(help="Prompt tokens per request (random workload).")] = 256,
    output_len: Annotated[int, typer.Option(help="Output tokens per request (max_tokens).")] = 128,
    range_ratio: Annotated[float, typer.Option(help="Lengths uniform in [len*(1-r), len*(1+r)], as in `vllm bench serve`.")] = 0.0,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="JSONL workload instead of random prompts: "
                                                    '{"prompt": ..., "max_tokens": ...} or {"messages": [...]} per line.')] = None,
    request_rate: Annotated[float, typer.Option(help="Requests per second (Poisson arrivals); inf sends all at once.")] = float("inf"),
    max_concurrency: Annotated[Optional[int], typer.Option(help="Most requests in flight at once.")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Generate exactly max_tokens (the server must support ignore_eos).")] = True,
    seed: Annotated[int, typer.Option(help="Seed of the workload (lengths, token ids, arrivals).")] = 0,
    warmup: Annotated[int, typer.Option(help="Requests sent (one at a time) before measuring.")] = 0,
    save_result: Annotated[Optional[Path], typer.Option(help="Write metrics, config and per-request records as JSON.")] = None,
    baseline: Annotated[Optional[Path], typer.Option(help="A JSON from --save-result: print the change per metric.")] = None,
):
    """Load-test a server and report throughput, TTFT, TPOT, ITL and latency (mean, median, p90, p99)."""
    import asyncio
    import json

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from tsdev.bench import BenchConfig, run_bench
    from tsdev.bench_report import render

    console = Console(soft_wrap=True)
    config = BenchConfig(url=url, endpoint=endpoint, model=model, num_prompts=num_prompts, input_len=input_len,
                         output_len=output_len, range_ratio=range_ratio, prompts_file=str(prompts) if prompts else None,
                         request_rate=request_rate, max_concurrency=max_concurrency, ignore_eos=ignore_eos, seed=seed,
                         warmup=warmup)
    try:
        config.check()
        before = json.loads(baseline.read_text()) if baseline else None
    except (ValueError, OSError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("requests", total=num_prompts)
        try:
            result = asyncio.run(run_bench(config, lambda done, total: bar.update(task, completed=done)))
        except (ConnectionError, ValueError) as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None
    console.print(render(result, before))
    if save_result:
        save_result.write_text(json.dumps(result, indent=1))
        console.print(f"saved to {save_result}")
    raise typer.Exit(1 if result["metrics"]["failed_requests"] else 0)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def profile(
    ctx: typer.Context,
    out: Annotated[Optional[Path], typer.Option(help="Report folder; default profiles/<date-time>.")] = None,
    num_steps: Annotated[int, typer.Option(help="Engine steps per capture range.")] = 20,
    ranges: Annotated[Optional[int], typer.Option(help="Stop after this many ranges (default: until Ctrl-C).")] = None,
    port: Annotated[int, typer.Option(help="Port of the profiled server.")] = 8000,
):
    """Serve under Nsight Systems and take one report per reload: `tsdev profile \\[MODEL] \\[server flags]`.

    A range is taken at start (reload-0) and after every successful reload (`tsdev reload`, an editor hook,
    `tsdev watch --attach`), each while a small fixed workload runs; every report is summarised (top
    kernels by GPU time, NVTX step ranges, change against the previous range). nsys writes its reports
    when the server stops (Ctrl-C, or --ranges reached); they are then named reload-N and summarised.
    Without nsys it takes torch profiler traces instead, summarised as each range closes.
    """
    import time as _time

    from rich.console import Console

    from tsdev.profile import run_profile

    folder = out or Path("profiles") / _time.strftime("%Y%m%d-%H%M%S")
    raise typer.Exit(run_profile(list(ctx.args), folder, num_steps, ranges, port, Console(soft_wrap=True)))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             options_metavar="[MODEL] [SERVER FLAGS] [OPTIONS]")
def watch(
    ctx: typer.Context,
    attach: Annotated[Optional[str], typer.Option(help="Watch for a server that is already running at this URL instead of starting one "
                                                       "(it cannot be restarted for you then).")] = None,
    no_tui: Annotated[bool, typer.Option("--no-tui", help="One plain line per event instead of the screen (CI, editors, logs).")] = False,
    settle_ms: Annotated[int, typer.Option(help="Quiet time after the last file event before reloading (editors write in bursts).")] = 200,
    probe_batch: Annotated[int, typer.Option(help="Batch size of the decode probe run after every reload.")] = 8,
    probe_steps: Annotated[int, typer.Option(help="Tokens per request of the decode probe.")] = 32,
    server_log: Annotated[Optional[Path], typer.Option(help="Where the child server's output goes; default $TMPDIR/tsdev-watch-PORT.log.")] = None,
    profile_each_reload: Annotated[bool, typer.Option("--profile-each-reload", help="Record every reload's decode probe in a profiler capture range (POST /start_profile), as `p` does for the next one.")] = False,
):
    """Serve MODEL and reload it on every save: `tsdev watch \\[MODEL] \\[server flags...]`.

    Starts `tsdev serve --allow-reload-forward` with the server flags given (`tsdev serve --help` lists them).
    Reloads what changed on every save; restarts the server when an edit cannot be reloaded or when it dies.
    After every reload: a golden completion (did the output change?) and a decode probe (ms/step).

    Keys: r reload all, R restart, b quick bench, p profile next reload, g new golden, c clear, q quit.
    See docs/watch.md.
    """
    from tsdev.server_process import flag_value
    from tsdev.watch import WatchConfig, run, serve_flags, split_server_args

    try:
        model, server_args = split_server_args(list(ctx.args), serve_flags(typer.main.get_command(app).get_command(ctx, "serve")))
        if attach and (model or server_args):
            raise ValueError("--attach watches a running server: MODEL and server flags are for the server tsdev watch starts")
        config = WatchConfig(model=model, server_args=server_args, attach=attach, settle=settle_ms / 1000,
                             probe_batch=probe_batch, probe_steps=probe_steps, server_log=server_log,
                             profile_each_reload=profile_each_reload,
                             host=flag_value(server_args, "--host") or "127.0.0.1",
                             port=int(flag_value(server_args, "--port") or 8000))
        code = run(config, tui=not no_tui)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def hook(
    editor: Annotated[str, typer.Argument(help="vscode, neovim, emacs or jetbrains.")],
    install: Annotated[bool, typer.Option("--install", help="Write it where the editor reads it (and say where) instead of printing it.")] = False,
    url: Annotated[Optional[str], typer.Option(help="The server to reload, if not http://127.0.0.1:8000.")] = None,
):
    """Print (or --install) an editor hook that runs `tsdev reload --file PATH` on every save. See docs/editor-hooks.md."""
    from tsdev.hooks import EDITORS, install as install_hook, snippet

    if editor not in EDITORS:
        raise typer.BadParameter(f"one of {', '.join(EDITORS)}", param_hint="EDITOR")
    if not install:
        hook_ = snippet(editor, url)
        typer.echo(hook_.text.rstrip("\n"))
        typer.echo(f"\n# goes in: {hook_.where}" + (f"\n# {hook_.note}" if hook_.note else ""), err=True)
        return
    try:
        for line in install_hook(editor, Path.cwd(), url):
            typer.echo(line)
    except (ValueError, FileExistsError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.callback()
def main() -> None:
    """tsdev: serve an LLM and hot-reload its forward pass while you edit its kernels."""
