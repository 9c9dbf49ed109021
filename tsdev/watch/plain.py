"""`tsdev watch --no-tui`: one plain line per event, for CI logs, editors' terminals and `grep`.

The line formats live here and the TUI reuses them; the words for a reload's outcome come from
tsdev/outcome.py, which `tsdev reload` uses too.
"""
from __future__ import annotations

import asyncio
import signal
import time

from rich.console import Console
from rich.markup import escape

from tsdev import outcome
from tsdev.watch.args import WatchConfig
from tsdev.watch.daemon import Daemon
from tsdev.watch.records import Event, ReloadRecord, RestartRecord, WeightsRecord


def trigger_text(record: ReloadRecord) -> str:
    if record.files:
        return f"{record.trigger} {', '.join(record.files)}"
    if record.trigger == "another client" and record.modules:
        return f"{record.trigger}: {', '.join(record.modules)}"
    return record.trigger


def checks_text(record: ReloadRecord | RestartRecord) -> list[str]:
    parts = []
    if isinstance(record, WeightsRecord) and record.verdict is not None:  # new weights: a change is information
        parts.append(f"[cyan]{record.verdict.text()}{'' if record.verdict.same else ' (new weights)'}[/cyan]")
    elif record.verdict is not None:
        color = "green" if record.verdict.same else "yellow"
        parts.append(f"[{color}]{record.verdict.text()}[/{color}]")
    if record.probe is not None:
        parts.append(record.probe.text())
    if record.note:
        parts.append(f"[dim]{escape(record.note)}[/dim]")
    if isinstance(record, WeightsRecord) and record.retaken:
        parts.append("golden retaken on the new weights")
    if isinstance(record, ReloadRecord) and record.worker and not record.error:
        parts += [f"[yellow]{escape(note)}[/yellow]" for note in outcome.notes(record.worker)]
    if isinstance(record, ReloadRecord) and record.restart:
        parts.append(f"[yellow]{escape(record.restart)}[/yellow]")
    return parts


def message_line(event: Event) -> str:
    color = {"warning": "yellow", "error": "red"}.get(event.level)
    return f"[{color}]{escape(event.text)}[/{color}]" if color else escape(event.text)


def weights_steps(record: WeightsRecord) -> str:
    parts = [f"{name} {record.steps[name]:.2f}" for name in ("load", "update", "check") if name in record.steps]
    return " ".join(parts) + " s" if parts else ""


def weights_line(record: WeightsRecord) -> str:
    head, why = f"weights #{record.n}", escape(record.trigger)
    if record.error:
        tail = f" [dim]— {escape(record.note)}[/dim]" if record.note else ""
        return f"{head} [red]FAILED[/red] ({why}): {escape(record.error)}{tail}"
    return " | ".join([f"{head} [green]ok[/green] ({why}): update_weights direct", weights_steps(record),
                       *checks_text(record)])


def reload_line(record: ReloadRecord) -> str:
    """The reload's line, then one per rank when the server has several."""
    if isinstance(record, WeightsRecord):
        return weights_line(record)
    return "\n".join([_reload_line(record), *(f"  {line}" for line in outcome.rank_lines(record.ranks))])


def _reload_line(record: ReloadRecord) -> str:
    head = f"reload #{record.n}"
    why = escape(trigger_text(record))
    if record.error:
        return f"{head} [red]FAILED[/red] ({why}): {escape(record.error)} [dim]— {outcome.KEEPS_SERVING}[/dim]"
    if not record.reloaded:
        return f"{head}: {' | '.join(checks_text(record)) or 'nothing reloaded'} ({why})"
    steps = outcome.steps_text(record.steps, record.step_order(), record.worker.jit_kernels,
                               record.worker.graph_nodes_patched, record.worker.kernels)
    if record.served_after_save is not None:
        steps += f" | save → serving {serving_text(record)}"
    return " | ".join([f"{head} [green]ok[/green] ({why}): {escape(outcome.summary(record.worker))}", steps,
                       *map(escape, outcome.kernel_checks_text(record.worker)), *checks_text(record)])


def serving_text(record: ReloadRecord) -> str:
    """'0.92 s = settle 0.05 + jit 0.53 + pause 0.09 + read+plan 0.25', then what the server did after serving
    resumed (report-mode kernel checks) when it took a while."""
    text = f"{record.served_after_save:.2f} s"
    if split := record.serving_split():
        text += " = " + " + ".join(f"{name} {seconds:.2f}" for name, seconds in split)
    if (after := record.after_serving) is not None and after >= 0.05:
        text += f" (then {after:.2f} s checking, serving)"
    return text


def restart_line(record: RestartRecord, daemon: Daemon) -> str:
    if record.error:
        verb = "the server did not start" if record.n == 0 else "restart FAILED"
        return f"[red]{verb}[/red] after {record.seconds:.1f} s: {escape(record.error)}"
    info = daemon.info
    where = ", ".join(str(x) for x in (info.get("model"), info.get("device") and f"on {info['device']}",
                                         record.pid and f"pid {record.pid}") if x)
    if record.n == 0:
        head = f"server up in {record.seconds:.1f} s ({where}) at {info['url']}"
        if info.get("log"):
            head += f", log {info['log']}"
        if daemon.checker.golden:
            head += f"; golden completion: {len(daemon.checker.golden)} tokens"
    else:
        head = (f"restart #{record.n}: {escape(record.reason)} → restarted in {record.seconds:.1f} s"
                f"{' by the standby' if record.standby else ''} ({where})")
        if record.served_after_save is not None:
            head += f" | save → serving again {record.served_after_save:.2f} s"
        if where_it_went := restart_parts(record):
            head += f" | {where_it_went}"
    return " | ".join([head, *checks_text(record)])


def restart_parts(record: RestartRecord) -> str:
    """Where a restart's seconds went: the old server's stop, then the new server's own account of its start
    (GET /server_info's `startup`: the CLI, imports, checkpoint, load, warm-up, capture, other) and what is left
    of the daemon's `seconds`, split by `handover_parts` where the moments allow; '' when the server gave no
    account."""
    if not record.startup:
        return ""
    parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in record.startup.items())
    text = f"old server stopped in {record.stopped:.2f} s, then " if record.stopped is not None else ""
    text += f"start: {parts}"
    if (rest := record.seconds - sum(record.startup.values())) >= 0.005:
        text += ", " + (handover_parts(record.moments) or f"hand-over and health checks {rest:.2f}")
    return text + " s"


def handover_parts(moments: dict[str, float | None]) -> str:
    """What a restart took beyond the new server's own account: the hand-over (from the restart's beginning until
    the standby took the start; of it, the standby still busy after it was sent the arguments -- importing the
    saved sources), the set-up after the startup line (the reloader, the app) until it served, and the health checks
    until /health first answered (the API process's start, the polls); of them, the answer to the request that
    succeeded (sent within a poll of the API process listening: what is slow after that is the answer). '' when a
    moment is missing."""
    need = ("restart began", "arguments sent", "began", "startup line", "serving", "healthy")
    if any(moments.get(name) is None for name in need):
        return ""
    m = moments
    busy = max(m["began"] - m["arguments sent"], 0.0)  # (two processes' clocks: never "-0.00")
    answer = "" if m.get("health asked") is None else f" (the answer {m['healthy'] - m['health asked']:.2f})"
    return (f"hand-over {m['began'] - m['restart began']:.2f} (the standby busy {busy:.2f}), serving set-up "
            f"{m['serving'] - m['startup line']:.2f}, health checks {m['healthy'] - m['serving']:.2f}{answer}")


def started_line(event: Event, daemon: Daemon) -> str | None:
    record = event.record
    if isinstance(record, WeightsRecord):
        return f"weights #{record.n}: new checkpoint {escape(record.path)} → update_weights (direct)"
    if isinstance(record, ReloadRecord):
        modules = ", ".join(record.modules) if record.trigger == "save" else ""
        return f"reload #{record.n}: {escape(trigger_text(record))}" + (f" → {escape(modules)}" if modules else "")
    if record.n == 0:
        return (f"starting the server: {daemon.server.command_line}" if daemon.server
                else f"attaching to {daemon.config.url}")
    return f"restarting the server: {escape(record.reason)}"


class PlainPrinter:
    def __init__(self, console: Console | None = None):
        self.console = console or Console(soft_wrap=True, highlight=False)
        self.daemon: Daemon | None = None

    def __call__(self, event: Event) -> None:
        line = None
        if event.kind == "message":
            line = message_line(event)
        elif event.kind in ("reload_started", "restart_started"):
            line = started_line(event, self.daemon)
        elif event.kind == "reload_finished":
            line = reload_line(event.record)
        elif event.kind == "restart_finished":
            line = restart_line(event.record, self.daemon)
        if line:
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {line}")
            self.console.file.flush()


def run_plain(config: WatchConfig) -> int:
    printer = PlainPrinter()
    daemon = printer.daemon = Daemon(config, printer)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, daemon.stop)
        return await daemon.run()

    return asyncio.run(main())
