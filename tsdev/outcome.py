"""How a reload's outcome is worded. `tsdev reload`'s lines, `tsdev watch --no-tui`'s lines and the watch
screen take their words from here, so the three say the same thing the same way. Texts are rich markup:
what comes from the server is escaped."""
from collections.abc import Iterable, Mapping

from rich.markup import escape

from runtime.control_protocol import GRAPH_KINDS, STEPS, WorkerReport

SHOWN_STEPS = (*STEPS, "pause")  # the timings shown as steps, in server order; pause: what serving saw
KEEPS_SERVING = "the old code keeps serving"


def graph_split(timings: Mapping[str, float], step: str = "recapture") -> str:
    """' (decode 0.25, prefill 0.20)' after the recapture step when the server reports the two graph kinds
    apart; '' for any other step."""
    kinds = [(k, timings[f"{step}_{k}"]) for k in GRAPH_KINDS if f"{step}_{k}" in timings]
    return f" ({', '.join(f'{k} {s:.2f}' for k, s in kinds)})" if kinds else ""


def steps_text(timings: Mapping[str, float], order: Iterable[str] = SHOWN_STEPS, jit_kernels: int = 0) -> str:
    """'jit 0.08 drain 0.01 ... recapture 0.46 (decode 0.30, prefill 0.16) pause 0.63 total 0.64 s'."""
    parts = [f"{name} {timings[name]:.2f}{graph_split(timings, name)}" for name in (*order, "total")
             if name in timings]
    text = " ".join(parts) + " s" if parts else ""
    return text + (f" ({jit_kernels} kernel(s) compiled)" if jit_kernels else "")


def outside(modules: Iterable[str]) -> str:
    """Why a restart is needed."""
    return f"{', '.join(modules)} changed outside the reloadable packages"


def reloaded_text(worker: WorkerReport) -> str:
    return f"{', '.join(worker.reloaded)} + {len(worker.dependents)} dependent(s)"


def summary(worker: WorkerReport) -> str:
    """'kernels.ops.act + 3 dependent(s), 22 object(s) patched' (plain text)."""
    return f"{reloaded_text(worker)}, {worker.patched} object(s) patched"


def notes(worker: WorkerReport) -> list[str]:
    """What a successful reload still wants the user to know: warnings, and definitions left stale (plain text)."""
    found = [f"warning: {w}" for w in worker.warnings]
    if worker.stale:
        found.append(f"stale (could not be patched): {', '.join(s.name for s in worker.stale)}")
    return found


def worker_text(worker: WorkerReport) -> str:
    """`tsdev reload`'s lines for one worker, as the README shows them."""
    t = worker.timings
    rank = f"[dim]rank {worker.rank}:[/dim] " if worker.rank else ""
    if not worker.ok:
        return f"{rank}[red]reload failed[/red]: {escape(str(worker.error))}"
    reloaded = ", ".join(worker.reloaded) or "nothing (no source changed)"
    line = (f"{rank}reloaded [bold]{reloaded}[/bold] and {len(worker.dependents)} dependent module(s), "
            f"{worker.patched} object(s) patched in {t.get('reload', 0):.2f} s;\n"
            f"warmed in {t.get('warm', 0):.2f} s; recaptured in {t.get('recapture', 0):.2f} s{graph_split(t)}; "
            f"JIT-compiled {worker.jit_kernels} kernel(s) in {t.get('jit', 0):.2f} s; "
            f"serving paused {t.get('pause', 0):.2f} s")
    for note in notes(worker):
        line += f"\n[yellow]{escape(note)}[/yellow]"
    if worker.needs_restart:
        line += f"\n[yellow]needs restart: {outside(worker.needs_restart)}[/yellow]"
    return line
