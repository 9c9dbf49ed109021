"""How a reload's outcome is worded. `tsdev reload`'s lines, `tsdev watch --no-tui`'s lines and the watch
screen take their words from here, so the three say the same thing the same way. Texts are rich markup:
what comes from the server is escaped. Also `tsdev reload`'s exit status and what it shows while it waits."""
import collections
import statistics
import time
from collections.abc import Iterable, Mapping

from rich.console import Console
from rich.markup import escape

from tsdev_runtime.control_protocol import (GRAPH_KINDS, STEPS, CompileAheadReply, Event, KernelCheckResult,
                                            ReloadReply, ReloadStep, WorkerReport)

SHOWN_STEPS = (*STEPS, "pause")  # the timings shown as steps, in server order; pause: what serving saw
KEEPS_SERVING = "the old code keeps serving"

# `tsdev reload`'s exit status (editor hooks and scripts tell the outcomes apart by it)
RELOADED = 0  # every worker reloaded, or there was nothing to reload
FAILED = 1  # the reload failed and was rolled back (or the server answered 5xx, or no reply came in time)
UNREACHABLE = 2  # no server answers at the URL, or it refused (403 without --allow-reload-forward, ...)
NEEDS_RESTART = 3  # an edit outside the reloadable packages needs a server restart (even if others reloaded)
RESTART_HINT = "restart the server (`tsdev watch` restarts it by itself)"


def exit_status(reply: ReloadReply) -> int:
    """FAILED when a worker failed, else NEEDS_RESTART when one lists needs_restart, else RELOADED."""
    if not reply.ok:
        return FAILED
    return NEEDS_RESTART if any(w.needs_restart for w in reply.workers) else RELOADED


def ahead_text(reply: CompileAheadReply) -> str:
    """`tsdev reload --ahead`'s line (and the watch daemon's), plain text: what an editor's buffer built, or why
    nothing."""
    waited = f" (waited {reply.waited:.2f} s for its turn)" if reply.waited >= 0.05 else ""
    if reply.outcome == "failed":
        return f"not compiled ahead: {reply.error} (nothing was reloaded){waited}"
    if reply.outcome != "compiled":
        return f"{'superseded' if reply.outcome == 'superseded' else 'nothing to compile ahead'}: {reply.reason}"
    names = [k.rsplit(".", 1)[-1] for k in reply.kernels]
    kernels = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    binaries = f"{reply.compiled} {'binary' if reply.compiled == 1 else 'binaries'}"
    if reply.reused:
        return (f"built already: {reply.module} with this text was compiled ahead before ({binaries}: {kernels}); "
                "saving it reloads without compiling them")
    return (f"compiled ahead: {binaries} of {reply.module} ({kernels}) in {reply.seconds:.2f} s (slowest "
            f"{reply.slowest:.2f} s){waited}; saving this text reloads without compiling them")


def graph_split(timings: Mapping[str, float], step: str = "recapture") -> str:
    """' (decode 0.25, prefill 0.20)' after the recapture step when the server reports the two graph kinds
    apart; '' for any other step."""
    kinds = [(k, timings[f"{step}_{k}"]) for k in GRAPH_KINDS if f"{step}_{k}" in timings]
    return f" ({', '.join(f'{k} {s:.2f}' for k, s in kinds)})" if kinds else ""


def dialects_text(kernels: Mapping[str, str]) -> str:
    """' (gluon 1, triton 2)': the kernels a reload replaced, counted per dialect; '' for none."""
    counts = collections.Counter(kernels.values())
    return f" ({', '.join(f'{name} {n}' for name, n in sorted(counts.items()))})" if counts else ""


def steps_text(timings: Mapping[str, float], order: Iterable[str] = SHOWN_STEPS, jit_kernels: int = 0,
               nodes_patched: int = 0, kernels: Mapping[str, str] | None = None) -> str:
    """'jit 0.08 drain 0.01 ... recapture 0.46 (decode 0.30, prefill 0.16) pause 0.63 total 0.64 s' (or
    'recapture 0.00 (412 graph nodes patched)' when the graphs were patched, not captured)."""
    patched = f" ({nodes_patched} graph nodes patched)" if nodes_patched else ""
    parts = [f"{name} {timings[name]:.2f}{patched if name == 'recapture' and patched else graph_split(timings, name)}"
             for name in (*order, "total") if name in timings]
    text = " ".join(parts) + " s" if parts else ""
    slowest = f", slowest {timings['jit_slowest']:.2f} s" if timings.get("jit_slowest") else ""
    if jit_kernels:
        return text + f" ({jit_kernels} kernel(s){dialects_text(kernels or {})} compiled{slowest})"
    return text + (f" (kernels edited{dialects_text(kernels)}: none compiled ahead)" if kernels else "")


def kernel_checks_text(worker: WorkerReport | None) -> list[str]:
    """One summary per checked op of a reload (see `checks_summary`)."""
    return checks_summary(worker.kernel_checks) if worker is not None else []


def checks_summary(results: Iterable[KernelCheckResult]) -> list[str]:
    """One summary per op: 'silu_and_mul: err 2e-03 ok · 4.1 → 3.6 µs (-12%) at 4 shapes' (the largest error over
    the shapes; the median times over the shapes timed both before and after, '*' marking a time from an earlier
    reload; only the time after when there is none before)."""
    by_op: dict[str, list] = {}
    for check in results:
        by_op.setdefault(check.op, []).append(check)
    texts = []
    for op, found in by_op.items():
        failed = [c for c in found if not c.ok]
        errors = [c.max_abs for c in found if c.max_abs is not None]
        text = f"{op}: " + (f"err {max(errors):.0e} " if errors else "") + ("ok" if not failed else "FAILED")
        timed = [c for c in found if c.us_before and c.us_after]
        if timed:
            before = statistics.median(c.us_before for c in timed)
            after = statistics.median(c.us_after for c in timed)
            stale = "" if all(c.before_fresh for c in timed) else "*"
            text += f" · {before:.1f}{stale} → {after:.1f} µs{_eager(timed)} ({(after / before - 1) * 100:+.0f}%)"
        elif timed_after := [c for c in found if c.us_after]:
            text += f" · {statistics.median(c.us_after for c in timed_after):.1f} µs{_eager(timed_after)}"
        text += f" at {f'{len(failed)} of ' if failed else ''}{len(found)} shape(s)"
        texts.append(text + share_text(found))
    return texts


def share_text(found: list[KernelCheckResult]) -> str:
    """' · [256x1024] 4.1 µs = 82 % of bandwidth': the share of the GPU's limit at the op's largest shape timed."""
    shared = [c for c in found if c.share is not None and c.us_after]
    if not shared:
        return ""
    c = shared[-1]
    return f" · [{'x'.join(map(str, c.shape))}] {c.us_after:.1f} µs = {100 * c.share:.0f} % of {c.bound}"


def _eager(checks: list[KernelCheckResult]) -> str:
    """Marks times that include the host's launch cost (an op no CUDA graph can hold)."""
    return " eager" if any(c.timed == "eager" for c in checks) else ""


def checks_table(results: Iterable[KernelCheckResult]) -> list[str]:
    """One line per op and shape: what `tsdev check --shapes` prints."""
    lines = [f"{'op':<22} {'shape':>14} {'dtype':<9} {'max abs':>9} {'max rel':>9} {'tolerance':>17} "
             f"{'µs before':>9} {'µs after':>9} {'timed':<5} {'of limit':>8}  outcome"]
    for c in results:
        shape, tolerance = "x".join(map(str, c.shape)), f"{c.atol:g} + {c.rtol:g}·|ref|"
        number = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        lines.append(f"{c.op:<22} {shape:>14} {c.dtype:<9} {number(c.max_abs, '9.2e')} {number(c.max_rel, '9.2e')} "
                     f"{tolerance:>17} {number(c.us_before, '9.1f')} {number(c.us_after, '9.1f')} {c.timed or '-':<5} "
                     f"{_limit(c):>8}  "
                     f"{'ok' if c.ok else 'FAILED' + (f': {c.error}' if c.error else '')}")
    return lines


def _limit(check: KernelCheckResult) -> str:
    """'82 % bw' / '61 % tc': the share of the GPU's limit (bandwidth or tensor cores), '-' where none was taken."""
    if check.share is None:
        return "-"
    return f"{100 * check.share:.0f} % {'bw' if check.bound == 'bandwidth' else 'tc'}"


def outside(modules: Iterable[str]) -> str:
    """Why a restart is needed."""
    return f"{', '.join(modules)} changed outside the reloadable packages"


def fold(names: list[str], width: int) -> str:
    """'a, b and 18 more': as many names as fit in `width` characters, the rest counted ('20 modules' when not even the
    first fits with the count), so that `r`'s twenty modules leave room on a screen line for what follows them."""
    for shown in range(len(names), 0, -1):
        text = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if shown < len(names) else "")
        if len(text) <= width:
            return text
    return f"{len(names)} modules" if len(names) > 1 else ", ".join(names)


def reloaded_text(worker: WorkerReport, width: int | None = None) -> str:
    """'tsdev_kernels.ops.act + 3 dependent(s)'; with `width`, the module names folded to it (the watch screen)."""
    names = ", ".join(worker.reloaded) if width is None else fold(worker.reloaded, width)
    return f"{names} + {len(worker.dependents)} dependent(s)"


def summary(worker: WorkerReport) -> str:
    """'tsdev_kernels.ops.act + 3 dependent(s), 22 object(s) patched' (plain text)."""
    return f"{reloaded_text(worker)}, {worker.patched} object(s) patched"


def notes(worker: WorkerReport) -> list[str]:
    """What a successful reload still wants the user to know: warnings, kernels that compiled in the pause (the
    compile-ahead missed them: the pause waited), and definitions left stale (plain text)."""
    found = [f"warning: {w}" for w in worker.warnings]
    if worker.compiled_in_pause:
        found.append("compiled in the pause, not ahead: " + ", ".join(
            f"{name} {seconds:.2f} s"
            for name, seconds in sorted(worker.compiled_in_pause.items(), key=lambda i: -i[1])))
    if worker.stale:
        found.append(f"stale (could not be patched): {', '.join(s.name for s in worker.stale)}")
    return found


def worker_text(worker: WorkerReport) -> str:
    """`tsdev reload`'s lines for one worker, as the README shows them. The first line starts with the
    outcome (`reload failed`, `needs restart`, `reloaded`, `nothing to reload`): editors show that much."""
    t = worker.timings
    rank = f"[dim]rank {worker.rank}:[/dim] " if worker.rank else ""
    if not worker.ok:
        return f"{rank}[red]reload failed[/red]: {escape(str(worker.error))}"
    lines = []
    if worker.needs_restart:
        lines.append(f"[yellow]needs restart: {escape(outside(worker.needs_restart))}; {RESTART_HINT}[/yellow]")
    if worker.reloaded:
        lines.append(f"reloaded [bold]{', '.join(worker.reloaded)}[/bold] and {len(worker.dependents)} dependent "
                     f"module(s), {worker.patched} object(s) patched in {t.get('reload', 0):.2f} s;\n"
                     f"{warm_text(worker)}; {recapture_text(worker)}; "
                     f"JIT-compiled {worker.jit_kernels} kernel(s){dialects_text(worker.kernels)} in "
                     f"{t.get('jit', 0):.2f} s{slowest(t)}; "
                     f"serving paused {t.get('pause', 0):.2f} s")
    elif not worker.needs_restart:
        lines.append("nothing to reload: no source in the reloadable packages changed since the last reload")
    lines += [f"kernel check {escape(text)}" for text in kernel_checks_text(worker)]
    lines += [f"[yellow]{escape(note)}[/yellow]" for note in notes(worker)]
    return rank + "\n".join(lines)


def slowest(timings: dict[str, float]) -> str:
    """The slowest single compile, when the compile-ahead reports it (side by side, it bounds the JIT step)."""
    return f" (slowest {timings['jit_slowest']:.2f} s)" if timings.get("jit_slowest") else ""


def recapture_text(worker: WorkerReport) -> str:
    seconds = worker.timings.get("recapture", 0)
    if not worker.graphs:
        return "no CUDA graphs to recapture (steps run eagerly here)"
    if worker.graph_nodes_patched:
        return (f"graphs patched in {seconds:.3f} s ({worker.graph_nodes_patched} kernel nodes pointed at the new "
                "binaries)")
    return f"recaptured in {seconds:.2f} s{graph_split(worker.timings)}"


def warm_text(worker: WorkerReport) -> str:
    if worker.kernels_only:
        return "no warm-up needed (only kernel bodies changed: their binaries were loaded)"
    return f"warmed in {worker.timings.get('warm', 0):.2f} s"


def rank_lines(workers: Iterable[WorkerReport]) -> list[str]:
    """One line per rank of a multi-rank reply ('rank 1: ok | reload 0.01 warm 0.19 recapture 0.02 s', or its
    error); none for a single rank, whose outcome is the reload's."""
    workers = list(workers)
    if len(workers) < 2:
        return []
    return [f"[dim]rank {w.rank}:[/dim] " + ("[green]ok[/green] | " + steps_text(w.timings) if w.ok
                                            else f"[red]FAILED[/red]: {escape(str(w.error))}") for w in workers]


def step_progress(step: str, elapsed: float, running: int | None, mode: str) -> str:
    """What a reload is busy with, while `tsdev reload` waits (plain text)."""
    if step != "drain":
        return f"reloading: {step} {elapsed:.1f} s"
    requests = "the running requests" if running is None else f"{running} running request(s)"
    if mode == "abort":
        return f"draining {elapsed:.1f} s: aborting {requests}"
    return f"draining {elapsed:.1f} s: waiting for {requests} to finish before reloading (--mode abort aborts them)"


class ReloadProgress:
    """What `tsdev reload` shows while its reload runs (fed the reload's events and a tick): nothing while a
    step is quick; a step running SHOW_AFTER s or longer, with its elapsed time, on a live status line on a
    terminal; elsewhere (editor hooks, logs) only a drain that waits, one line every PLAIN_EVERY s."""
    SHOW_AFTER = 0.5
    PLAIN_EVERY = 5.0

    def __init__(self, console: Console, mode: str):
        self.console, self.mode = console, mode
        self.step: str | None = None
        self.started, self.running = 0.0, None
        self.printed: float | None = None  # plain: elapsed time of the last line printed for this step
        self.status = None  # the live status line, on a terminal

    def event(self, event: Event) -> None:
        if not isinstance(event, ReloadStep):
            return
        if event.state == "started":
            self.step, self.started, self.running, self.printed = event.step, time.perf_counter(), event.running, None
        elif event.step == self.step:
            if self.printed is not None:
                self.console.print(f"drained in {event.seconds or 0:.1f} s" if event.state == "done"
                                   else f"{event.step} failed after {event.seconds or 0:.1f} s")
            self.step = None
        self.tick()

    def tick(self) -> None:
        if self.step is None:
            return self.close()
        elapsed = time.perf_counter() - self.started
        if elapsed < self.SHOW_AFTER:
            return
        text = step_progress(self.step, elapsed, self.running, self.mode)
        if self.console.is_terminal:
            if self.status is None:
                self.status = self.console.status(escape(text))
                self.status.start()
            else:
                self.status.update(escape(text))
        elif self.step == "drain" and (self.printed is None or elapsed - self.printed >= self.PLAIN_EVERY):
            self.console.print(escape(text))
            self.printed = elapsed

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
