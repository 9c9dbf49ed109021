"""What `tsdev serve` says while it starts: the spinner's seconds count through a long phase, the `loaded` line counts
the load alone (the warm-up and the captures have the `startup:` line), and on a CPU nothing claims a CUDA graph
capture (the graph bookkeeping runs there, nothing is captured)."""
import io
import logging
import threading
from types import SimpleNamespace

from rich.console import Console

from tsdev.launch.serve import StartupProgress, describe_loaded


class Status:
    """rich's Status, as StartupProgress uses it: each text it was given."""

    def __init__(self):
        self.texts, self.updated = [], threading.Event()

    def update(self, text: str) -> None:
        self.texts.append(text)
        self.updated.set()


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("tsdev_runtime.startup", logging.INFO, __file__, 0, message, (), None)


def test_the_spinners_seconds_count_while_a_phase_logs_nothing(monkeypatch):
    now = [100.0]
    status = Status()
    progress = StartupProgress(Console(file=io.StringIO(), force_terminal=True), status, clock=lambda: now[0])
    progress.emit(record("warm-up: running every kernel serving reaches"))
    now[0] += 10  # ten seconds of warm-up, and no log record meanwhile
    progress.show()
    assert status.texts == ["warm-up: running every kernel serving reaches (0 s)",
                            "warm-up: running every kernel serving reaches (10 s)"]
    # and on a terminal something calls show() while nothing is logged: the spinner's own ticker
    monkeypatch.setattr(StartupProgress, "SPINNER_S", 0.01)
    status = Status()
    with StartupProgress(Console(file=io.StringIO(), force_terminal=True), status, clock=lambda: now[0]):
        assert status.updated.wait(30)
    assert status.texts[0] == "starting (0 s)"


def test_off_a_terminal_each_phase_says_its_line_as_it_begins_and_silence_is_broken_after_progress_s():
    now = [100.0]
    out = io.StringIO()
    progress = StartupProgress(Console(file=out, force_terminal=False), None, clock=lambda: now[0])
    progress.emit(record("importing torch, Triton and the engine"))
    assert out.getvalue() == "starting (0 s): importing torch, Triton and the engine\n"  # at once, not at a tick
    now[0] += 3
    progress.emit(record("warm-up: running every kernel serving reaches"))
    assert out.getvalue().splitlines()[-1] == "starting (3 s): warm-up: running every kernel serving reaches"
    assert progress.said == now[0] and StartupProgress.PROGRESS_S < 2  # the ticker speaks after 1.5 s of silence


def test_the_loaded_line_counts_the_load_not_the_warm_up_or_the_captures():
    info = SimpleNamespace(architecture="Qwen3ForCausalLM", parameters=0.6e9, dtype="bfloat16", model_dir="/m",
                           device="cuda:0")
    timings = {"checkpoint": 0.4, "load": 1.1, "warm": 10.0, "capture": 2.0, "capture_prefill": 3.0}
    assert describe_loaded("qwen", info, timings) == ("loaded [bold]qwen[/bold] (Qwen3ForCausalLM, 600.0 M parameters, "
                                                      "bfloat16) from /m on cuda:0 in 1.5 s")


class Lines(logging.Handler):
    def __init__(self, name: str):
        super().__init__(logging.INFO)
        self.logger, self.lines = logging.getLogger(name), []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "Lines":
        self.level = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def test_on_a_cpu_neither_the_start_nor_a_reload_claims_to_capture_graphs(make_engine):
    from tsdev_runtime.engine.async_engine import AsyncEngine

    with Lines("tsdev_runtime.startup") as startup:
        engine = make_engine(cudagraph_capture_sizes=[1, 2, 4], prefill_graph_capture_sizes=[16, 32])
    assert startup.lines and not [line for line in startup.lines if "captur" in line], startup.lines
    assert "no CUDA graphs on cpu: decode and prefill run eagerly" in startup.lines
    engine.control.capture_graphs(deferring=True)  # as a reload leaves them: the sizes not used yet are pending
    assert engine.runner.graphs_pending
    AsyncEngine(engine)
    with Lines("tsdev_runtime.server") as server:
        while engine.runner.graphs_pending:
            engine.control.capture_next()  # what the loop runs between steps
    assert not [line for line in server.lines if "captured" in line], server.lines
