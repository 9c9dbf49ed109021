import pytest
from typer.testing import CliRunner

from tsdev_runtime.control_protocol import WorkerReport
from tsdev_runtime.engine.prefill_graphs import prefill_buckets
from tsdev.cli import app, join_list_flags, parse_sizes, prefill_capture_sizes
from tsdev.outcome import worker_text


def test_serve_help_explains_the_flags():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in ("--device", "--host", "--port", "--max-running", "--kv-pages", "--max-model-len", "--page-size"):
        assert flag in result.output
    assert "127.0.0.1" in result.output
    text = " ".join(result.output.split())  # (rich wraps and frames the help)
    for served in ("Qwen3-MoE", "DeepSeek-V2/V3", "default-fp8", "default-moe-fp8", "default-mla",
                   "weight_block_size [128, 128]", "loads as stored"):
        assert served in text, served


def test_serve_reports_a_bad_model_dir_and_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--device", "cpu", "--port", "0"])
    assert result.exit_code == 2
    assert "no config.json" in result.output


def test_serve_refuses_an_unknown_tsdev_kernels_value(tiny_model_dir, monkeypatch):
    import uvicorn

    monkeypatch.setenv("TSDEV_KERNELS", "ref:gemm")
    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **k: print("served despite the bad value"))
    result = CliRunner().invoke(app, ["serve", str(tiny_model_dir), "--device", "cpu", "--port", "0"])
    assert result.exit_code == 2
    assert "TSDEV_KERNELS='ref:gemm'" in result.output and "linear" in result.output


def test_serve_on_cuda_without_a_gpu_says_so(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["serve", "--device", "cuda"])
    assert result.exit_code == 2 and "sees no CUDA GPU" in result.output


@pytest.mark.slow
def test_serve_banner_names_the_graphs_and_the_startup_phases(make_engine):
    from tsdev.launch.serve import describe_graphs, describe_startup

    engine = make_engine(cudagraph_capture_sizes=[1, 4], max_batched_tokens=64)
    graphs = describe_graphs(engine.describe(), False, engine.startup_timings)
    assert graphs.startswith("2 decode graph(s) prepared") and "4 prefill graph(s) (16..64 tokens)" in graphs
    t = engine.startup_timings
    startup = describe_startup(0.8, 1.5, t, 3, 10.0)
    assert startup.startswith("startup: 10.00 s since the process began = python and the CLI 0.80 s, imports 1.50 s, "
                              "checkpoint ") and "warm-up" in startup and "prefill" in startup and "3 Triton" in startup
    accounted = 0.8 + 1.5 + t["checkpoint"] + t["load"] + t["warm"] + t["capture"] + t["capture_prefill"]
    assert startup.endswith(f"; other {10.0 - accounted:.2f} s")  # every second of the start is somewhere
    assert describe_startup(None, 1.5, t, 0, None).startswith("startup: imports 1.50 s, checkpoint ")
    assert "34 Triton compile(s) in the warm-up and capture (7 built, 27 from Triton's disk cache)" in describe_startup(
        0.8, 1.5, t, 34, 10.0, built=7)
    assert describe_graphs(make_engine(enforce_eager=True).describe(), False, {}) == "CUDA graphs off"


# --- help at 80 columns, vLLM's flag names, list flags -----------------------------------------------------

import re  # noqa: E402

import typer  # noqa: E402

from tsdev_runtime.config import EngineConfig  # noqa: E402
from tsdev.watch.args import serve_flags, split_server_args  # noqa: E402

COMMANDS = typer.main.get_command(app).commands


def option_names(command: str) -> list[str]:
    return [name for param in COMMANDS[command].params for name in (*param.opts, *param.secondary_opts)
            if name.startswith("-")]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_at_80_columns_names_every_option_in_full(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    assert "…" not in result.output
    for name in option_names(command):
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", result.output), (name, result.output)


def test_watch_help_names_every_key_of_the_screen():
    from tsdev.watch.tui import WatchApp

    text = " ".join(CliRunner().invoke(app, ["watch", "--help"], env={"COLUMNS": "80"}).output.split())
    keys = text[text.index("Keys:"):]
    for binding in WatchApp.BINDINGS:
        assert re.search(rf"(?<!\w){re.escape(binding.key)} [a-z]", keys), (binding.key, keys)


def test_help_shows_bracketed_text_as_written():
    def help_of(command):
        return " ".join(CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}).output.split())

    assert "[len*(1-r), len*(1+r)]" in help_of("bench")
    assert "tsdev watch [MODEL] [server flags...]" in help_of("watch")
    assert "tsdev profile [MODEL] [server flags]" in help_of("profile")
    assert "\\[" not in help_of("watch") + help_of("profile")


def engine_config(monkeypatch, *args: str) -> EngineConfig:
    """The EngineConfig `tsdev serve ARGS` hands to serving (nothing is loaded or bound)."""
    import tsdev.launch.serve

    seen = []
    monkeypatch.setattr(tsdev.launch.serve, "run_server", lambda config, server, console, *_: seen.append(config) or 0)
    result = CliRunner().invoke(app, ["serve", "--device", "cpu", *args])
    assert result.exit_code == 0 and len(seen) == 1, result.output
    return seen[0]


SAME_NAMES = ["--max-model-len", "512", "--dtype", "float32", "--gpu-memory-utilization", "0.5", "--seed", "3",
              "--enforce-eager", "--cudagraph-capture-sizes", "1", "2"]
TSDEV_NAMES = ["--max-running", "7", "--max-batched-tokens", "333", "--kv-pages", "99", "--page-size", "8",
               "--no-prefix-caching"]
VLLM_NAMES = ["--max-num-seqs", "7", "--max-num-batched-tokens", "333", "--num-gpu-blocks-override", "99",
              "--block-size", "8", "--no-enable-prefix-caching"]


def test_vllm_flag_names_set_the_same_engine_config_as_tsdevs(monkeypatch):
    tsdev = engine_config(monkeypatch, *TSDEV_NAMES, *SAME_NAMES)
    assert engine_config(monkeypatch, *VLLM_NAMES, *SAME_NAMES) == tsdev
    assert (tsdev.max_running, tsdev.max_batched_tokens, tsdev.kv_pages, tsdev.page_size) == (7, 333, 99, 8)
    assert tsdev.enable_prefix_caching is False and tsdev.enforce_eager and tsdev.cudagraph_capture_sizes == [1, 2]
    assert (tsdev.max_model_len, tsdev.dtype, tsdev.gpu_memory_utilization, tsdev.seed) == (512, "float32", 0.5, 3)
    assert engine_config(monkeypatch, "--enable-prefix-caching").enable_prefix_caching is True
    assert engine_config(monkeypatch).enable_prefix_caching is EngineConfig.enable_prefix_caching


@pytest.mark.parametrize("sizes", [["1", "16", "64"], ["1,16,64"], ["1 16 64"], ["64, 16", "1"]],
                         ids=["separate", "commas", "one-quoted-token", "mixed"])
def test_list_flags_take_their_values_in_every_form(monkeypatch, tiny_model_dir, sizes):
    config = engine_config(monkeypatch, "--cudagraph-capture-sizes", *sizes, "--prefill-graph-capture-sizes", *sizes,
                           str(tiny_model_dir))  # MODEL after the list: not taken for a size
    assert config.cudagraph_capture_sizes == [1, 16, 64] and config.prefill_graph_capture_sizes == [1, 16, 64]
    assert config.model == str(tiny_model_dir)
    assert engine_config(monkeypatch, "--cudagraph-capture-sizes=1 16 64").cudagraph_capture_sizes == [1, 16, 64]


def test_a_list_flag_without_sizes_says_what_to_give(monkeypatch):
    result = CliRunner().invoke(app, ["serve", "--device", "cpu", "--cudagraph-capture-sizes", "many"])
    assert result.exit_code == 2 and "give positive integers" in result.output


def test_watch_passes_vllms_serve_flag_names_through():
    flags = serve_flags(COMMANDS["serve"])
    model, args = split_server_args([*VLLM_NAMES, "--enable-prefix-caching", "/models/q"], flags)
    assert model == "/models/q" and args == [*VLLM_NAMES, "--enable-prefix-caching"]


def test_reload_progress_on_a_terminal_is_one_live_line_that_goes_away():
    import io

    from rich.console import Console

    from tsdev_runtime.control_protocol import ReloadStep
    from tsdev.outcome import ReloadProgress

    out = io.StringIO()
    progress = ReloadProgress(Console(file=out, force_terminal=True, width=100), "wait")
    progress.event(ReloadStep(id="r", step="drain", state="started", running=3))
    progress.tick()
    assert progress.status is None  # a quick step shows nothing
    progress.started -= 1.2
    progress.tick()
    assert str(progress.status.status).startswith("draining 1.2 s: waiting for 3 running request(s) to finish")
    progress.event(ReloadStep(id="r", step="drain", state="done", seconds=1.3))
    assert progress.status is None and "drained" not in out.getvalue()  # plain lines are for non-terminals


def _answering(status: int, body: bytes):
    """A throwaway HTTP server on 127.0.0.1 that answers every request with `status` and `body`."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_reload_exit_status_1_for_a_server_error_and_2_for_a_server_that_is_not_tsdev():
    from typer.testing import CliRunner

    from tsdev.cli import app

    cases = ((500, b'{"error": {"message": "internal error: boom", "type": "server_error", "param": null, '
                   b'"code": 500}}', 1, "boom"),
             (200, b'{"hello": "world"}', 2, "not a ReloadReply"))
    for status, body, code, words in cases:
        server = _answering(status, body)
        try:
            result = CliRunner().invoke(app, ["reload", "--url", f"http://127.0.0.1:{server.server_port}"])
        finally:
            server.shutdown()
        assert result.exit_code == code and words in result.output, (status, result.output)
        assert "Traceback" not in result.output


@pytest.mark.slow
def test_a_slow_start_shows_what_it_is_doing_instead_of_waiting_silently(monkeypatch, tiny_model_dir):
    """Off a terminal, a line every few seconds naming the current step (on a terminal, the spinner's text): the
    engine's phases and each kernel compiled come from the runtime's `tsdev_runtime.startup` log."""
    import io
    import time

    from rich.console import Console

    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine
    from tsdev.launch.serve import StartupProgress

    monkeypatch.setattr(StartupProgress, "PROGRESS_S", 0.05)
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    seen = []
    with StartupProgress(console, status=None) as progress:
        original = progress.emit
        monkeypatch.setattr(progress, "emit", lambda record: seen.append(record.getMessage()) or original(record))
        LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=128, kv_pages=64))
        time.sleep(0.2)
    lines = out.getvalue().splitlines()
    assert any(m.startswith("building Qwen3ForCausalLM") for m in seen) and any("warm-up" in m for m in seen)
    assert any(m.startswith("no CUDA graphs on cpu") for m in seen) and lines  # (a GPU's says "capturing ...")
    assert all(line.startswith("starting (") for line in lines) and lines[-1].endswith(seen[-1])


def test_compile_workers_without_reloads_are_refused():
    result = CliRunner().invoke(app, ["serve", "--device", "cpu", "--port", "0", "--compile-workers", "2"])
    assert result.exit_code == 2 and "--allow-reload-forward" in result.output


def test_a_kernel_check_mode_without_reloads_or_unknown_is_refused(monkeypatch):
    result = CliRunner().invoke(app, ["serve", "--device", "cpu", "--port", "0", "--kernel-check", "strict"])
    assert result.exit_code == 2 and "--allow-reload-forward" in result.output
    monkeypatch.delenv("TRITON_INTERPRET")  # strict where the checks cannot run: refused before the model loads
    result = CliRunner().invoke(app, ["serve", "--device", "cpu", "--port", "0", "--allow-reload-forward",
                                      "--kernel-check", "strict"])
    assert result.exit_code == 2 and "TRITON_INTERPRET=1" in result.output and "strict" in result.output
    result = CliRunner().invoke(app, ["serve", "--device", "cpu", "--port", "0", "--allow-reload-forward",
                                      "--kernel-check", "loud"])
    assert result.exit_code == 2 and "report, strict, off" in result.output
    result = CliRunner().invoke(app, ["reload", "--url", "http://127.0.0.1:9", "--kernel-check", "loud"])
    assert result.exit_code == 2 and "report, strict, off" in result.output  # refused before any request


def test_a_server_that_allows_reloads_gets_few_prefill_buckets_unless_told():
    assert prefill_capture_sizes(None, allow_reload_forward=False) is None  # the ladder
    assert prefill_capture_sizes(None, allow_reload_forward=True) == [256, 1024]
    assert prefill_capture_sizes("64,512", allow_reload_forward=True) == [64, 512]
    assert prefill_buckets(2048, 2048, prefill_capture_sizes(None, True)) == [256, 1024, 2048]


def test_cli_list_flag_and_bad_sizes():
    assert join_list_flags(["--prefill-graph-capture-sizes", "64", "256", "--port", "1"]) == [
        "--prefill-graph-capture-sizes", "64,256", "--port", "1"]
    assert parse_sizes("--prefill-graph-capture-sizes", "256,64,64") == [64, 256]
    for bad in ("0,16", "x", ""):
        with pytest.raises(Exception, match="positive integers"):
            parse_sizes("--prefill-graph-capture-sizes", bad)


def test_reload_line_shows_decode_and_prefill_recapture_apart_or_the_graph_nodes_patched():
    worker = WorkerReport(ok=True, reloaded=["tsdev_kernels.ops.norm"], patched=3,
                          timings={"reload": 0.01, "warm": 0.1, "recapture": 0.5, "recapture_decode": 0.2,
                                   "recapture_prefill": 0.3, "pause": 0.6})
    assert "recaptured in 0.50 s (decode 0.20, prefill 0.30)" in worker_text(worker)
    patched = WorkerReport(ok=True, reloaded=["tsdev_kernels.ops.norm"], patched=3, kernels_only=True,
                           graph_nodes_patched=412,
                           timings={"reload": 0.01, "warm": 0.0, "recapture": 0.004, "pause": 0.1})
    assert "graphs patched in 0.004 s (412 kernel nodes pointed at the new binaries)" in worker_text(patched)


def test_reload_lines_count_the_kernels_replaced_per_dialect():
    from tsdev.outcome import steps_text

    kernels = {"tsdev_kernels.ops.norm._rms_norm_gluon_kernel": "gluon",
               "tsdev_kernels.ops.norm.rms_norm_values_gluon": "gluon",
               "tsdev_kernels.ops.activation._silu_and_mul_kernel": "triton"}
    worker = WorkerReport(ok=True, reloaded=["tsdev_kernels.ops.norm"], patched=3, jit_kernels=2, kernels=kernels,
                          timings={"jit": 0.3, "reload": 0.01, "pause": 0.1})
    assert "JIT-compiled 2 kernel(s) (gluon 2, triton 1) in 0.30 s" in worker_text(worker)
    assert steps_text(worker.timings, jit_kernels=2, kernels=kernels).endswith(
        "(2 kernel(s) (gluon 2, triton 1) compiled)")
    cute = {"tsdev_kernels.ops.activation_cute._silu_and_mul_kernel": "cute"}  # compiled on its next call, not ahead
    assert steps_text(worker.timings, kernels=cute).endswith("(kernels edited (cute 1): none compiled ahead)")
    assert not steps_text(worker.timings).endswith(")")


def test_reload_lines_name_the_kernels_that_compiled_in_the_pause_slowest_first():
    worker = WorkerReport(ok=True, reloaded=["tsdev_kernels.ops.norm"], patched=3,
                          timings={"reload": 2.0, "pause": 2.1},
                          compiled_in_pause={"tsdev_kernels.ops.norm.a": 0.4,
                                             "tsdev_kernels.ops.norm._rms_norm_gluon_kernel": 1.9})
    assert ("compiled in the pause, not ahead: tsdev_kernels.ops.norm._rms_norm_gluon_kernel 1.90 s, "
            "tsdev_kernels.ops.norm.a 0.40 s") in worker_text(worker)
    assert "compiled in the pause" not in worker_text(WorkerReport(ok=True, reloaded=["tsdev_kernels.ops.norm"]))


@pytest.mark.slow
def test_serve_says_what_is_starting_before_it_imports_torch(tiny_model_dir):
    """The first line comes before the seconds of importing torch (and the CUDA start): a user sees at once that the
    command runs and what it serves. Import order, not the wall clock, so a loaded machine cannot fail it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "tsdev", "serve", str(tiny_model_dir), "--device",
                          "cpu", "--port", "1", "--host", "256.0.0.1"], capture_output=True, text=True, timeout=120)
    lines = out.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("starting tsdev serve:"))
    torch = next(i for i, line in enumerate(lines) if re.search(r"\|\s+torch$", line))
    assert first < torch and str(tiny_model_dir) in lines[first] and "on cpu" in lines[first], lines[first]


class _RecordedPool:
    """CompilePool's stand-in: what `tsdev serve` started early and whether it was closed."""
    started: list = []

    def __init__(self, packages, workers, target=None, modules=None):
        self.workers, self.target, self.modules, self.closed = workers, target, modules, False
        _RecordedPool.started.append(self)

    def close(self):
        self.closed = True


def test_the_compile_pool_starts_before_torch_only_where_the_start_will_have_one(monkeypatch):
    """Reloads allowed, workers, a CUDA device (asked for, or an NVIDIA GPU visible with none asked for), one rank:
    its workers import torch side by side with the server's own import; anywhere else none."""
    from tsdev.hotreload import pool
    from tsdev.launch import serve

    monkeypatch.setattr(pool, "CompilePool", _RecordedPool)
    monkeypatch.setattr(serve, "nvidia_gpu_visible", lambda: True)
    early = serve.early_compile_pool
    started = early("cuda:1", True, None, 1)
    assert started.target is None and started.modules == () and started.workers == serve.default_compile_workers()
    assert early(None, True, 3, 1).workers == 3
    assert not any((early("cpu", True, None, 1), early("cuda", False, None, 1), early("cuda", True, 0, 1),
                    early("cuda", True, None, 2)))
    monkeypatch.setattr(serve, "nvidia_gpu_visible", lambda: False)
    assert early(None, True, None, 1) is None and early("cuda", True, None, 1) is None


def test_a_start_that_fails_closes_the_pool_it_started_before_torch(monkeypatch):
    import torch

    from tsdev.hotreload import pool

    from tsdev.launch import serve
    from tsdev_runtime.weights import default_model

    _RecordedPool.started = []
    monkeypatch.setattr(pool, "CompilePool", _RecordedPool)
    monkeypatch.setattr(serve, "nvidia_gpu_visible", lambda: True)  # (a GPU seen by its driver, not by torch)
    monkeypatch.setattr(default_model, "write_ahead", lambda device, name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["serve", "--device", "cuda", "--allow-reload-forward"])
    assert result.exit_code == 2 and "sees no CUDA GPU" in result.output
    [started] = _RecordedPool.started
    assert started.closed


def test_a_cpu_start_closes_a_pool_started_for_a_gpu_it_does_not_use():
    from tsdev.launch.serve import start_compile_pool
    from tsdev_runtime.config import EngineConfig, ServerConfig

    early = _RecordedPool(["p"], 2, modules=())
    assert start_compile_pool(EngineConfig("default", device="cpu"), ServerConfig(allow_reload_forward=True),
                              early) is None
    assert early.closed


def test_a_gpu_start_of_an_embedded_model_writes_its_checkpoint_ahead_and_no_other_does(monkeypatch):
    import torch

    from tsdev.launch import serve
    from tsdev_runtime.weights import default_model

    started = []
    monkeypatch.setattr(default_model, "write_ahead", lambda device, name: started.append((device, name)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (the start then stops: no GPU here)
    monkeypatch.setattr(serve, "nvidia_gpu_visible", lambda: True)
    monkeypatch.setattr(serve, "run_server", lambda *args: 0)  # (what is asked before serving is the point)
    for args in (["serve", "--device", "cuda"], ["serve", "default-mla"], ["serve", "--device", "cpu"],
                 ["serve", "acme/missing-model", "--device", "cuda"]):
        CliRunner().invoke(app, args)
    assert started == [("cuda", None), ("cuda", "default-mla")]
    monkeypatch.setattr(serve, "nvidia_gpu_visible", lambda: False)
    CliRunner().invoke(app, ["serve", "--device", "cuda"])
    assert len(started) == 2
