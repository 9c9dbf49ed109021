"""The `tsdev watch` screen (Textual): server state, the reload in flight step by step, the history,
errors with the code around them, and one key per action. It only draws the daemon's events; the
daemon runs on Textual's own asyncio loop.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

from rich.console import Console, Group
from rich.markup import escape
from rich.syntax import Syntax
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, RichLog, Static

from tsdev.outcome import (KEEPS_SERVING, SHOWN_STEPS, checks_table, fold, graph_split, kernel_checks_text,
                           rank_lines, reloaded_text)
from tsdev.notebook import sparkline
from tsdev.watch.args import WatchConfig
from tsdev.watch.daemon import Daemon
from tsdev.watch.records import Event, ReloadRecord, RestartRecord, WeightsRecord, outcome_of
from tsdev.watch.plain import checks_text, message_line, restart_line, started_line, trigger_text, weights_line

WHERE = re.compile(r"(?P<path>[^\s:'\"]+\.py):(?P<line>\d+)")
STATE_COLORS = {"serving": "green", "paused": "yellow", "sleeping": "yellow", "draining": "yellow", "reloading": "cyan",
                "checking": "cyan", "starting": "cyan", "restarting": "magenta", "down": "red"}
COLUMNS = ("#", "time", "trigger", "reloaded", "deps", *SHOWN_STEPS, "total", "golden", "decode ms/step", "outcome")
HEADERS = {"recapture": "recap", "decode ms/step": "ms/step"}  # narrow enough for ~170 columns
# The widest a cell of each column gets (trigger and reloaded are clipped to it); cells are padded by 1 each side.
WIDTHS = {"#": 5, "time": 8, "trigger": 24, "reloaded": 24, "deps": 4, **dict.fromkeys(SHOWN_STEPS, 5), "total": 5,
          "golden": 11, "decode ms/step": 13, "outcome": 13}
# On a narrow screen the history drops columns in this order (the log and the current reload show every step), and
# the trigger is clipped to what is left, down to MIN_TRIGGER characters.
DROP_ORDER = ("deps", "flush", "drain", "jit", "reload", "warm", "recapture", "time", "reloaded", "pause")
MIN_TRIGGER = 12
HISTORY_MIN, LOG_MIN = 6, 4  # rows, borders included: the history's header and three rows; the log's two lines
CONTEXT = 3  # lines of code shown each side of an error's line, where the errors panel has room


def visible_columns(width: int) -> tuple[tuple[str, ...], int]:
    """The history's columns for a screen `width` cells wide, and the trigger's width."""
    columns = list(COLUMNS)
    room = width - 2  # the table's border

    def needed() -> int:
        return sum(WIDTHS[c] + 2 for c in columns)

    for name in DROP_ORDER:
        if needed() <= room:
            break
        columns.remove(name)
    trigger = max(MIN_TRIGGER, min(WIDTHS["trigger"], WIDTHS["trigger"] - (needed() - room)))
    return tuple(columns), trigger


def chip_lines(chips: list[str], width: int, gap: str = "   ") -> list[str]:
    """Markup chips joined into lines of at most `width` cells, each chip whole on one line."""
    lines, line, used = [], [], 0
    for chip in chips:
        length = Text.from_markup(chip).cell_len
        if line and used + len(gap) + length > width:
            lines.append(gap.join(line))
            line, used = [], 0
        used += (len(gap) if line else 0) + length
        line.append(chip)
    return lines + ([gap.join(line)] if line else [])


def clip_to(text: str, width: int) -> str:
    """Keep wide cells from pushing the timings off the screen (the log has the whole line)."""
    return text if len(text) <= width else text[: width - 1] + "…"


def clip_path(text: str, width: int) -> str:
    """A trigger such as "save kernels/tsdev_kernels/ops/act.py" clipped in the middle: its first word and the end of
    the path (the file's name) stay."""
    if len(text) <= width:
        return text
    head = text.split(" ", 1)[0] + " " if " " in text else ""
    head = head if len(head) <= width // 3 else ""
    return head + "…" + text[len(text) - (width - len(head) - 1):]


def panel_heights(height: int, errors: bool) -> tuple[int, int]:
    """The most rows (borders included) the current reload's panel and the errors panel take on a screen `height`
    rows high: half of what the header and the footer leave for the current reload; a quarter each while errors
    show, and never less than the history and the log leave them (6 each at 80x24)."""
    body = height - 2
    if not errors:
        return max(3, body // 2), 0
    share = max(3, body // 4, min(6, (body - HISTORY_MIN - LOG_MIN) // 2))
    return share, share


def excerpt(error: str, rows: int = 2 * CONTEXT + 1) -> Syntax | None:
    """The code around the error's file:line in `rows` lines at most, that line (marked ❱) always among them."""
    match = WHERE.search(error)
    if not match or rows < 1:
        return None
    path, line = Path(match["path"]), int(match["line"])
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    before = min(CONTEXT, rows // 2)
    first = max(1, line - before)
    last = min(line + CONTEXT, first + rows - 1)
    code = "\n".join(lines[first - 1: last])
    return Syntax(code, "python", line_numbers=True, start_line=first, highlight_lines={line}, theme="ansi_dark")


def rows(text: Text, width: int) -> int:
    """How many lines `text` takes at `width` cells."""
    return len(text.wrap(Console(width=width), width))


def fit_lines(text: Text, width: int, most: int) -> Text:
    """`text` wrapped at `width` in `most` lines at most, the last one ending in … when some were left out."""
    lines = text.wrap(Console(width=width), width)
    if len(lines) <= most:
        return text
    last = lines[most - 1].copy()
    last.rstrip()
    last.truncate(width - 1)
    return Text("\n").join([*lines[: most - 1], last.append("…")])


class History(DataTable):
    """The history. Its cursor goes to each new row while it is on the newest one, and that row stays in view as the
    panels around the table open and close; a cursor moved up (to read a row, or for `k`) stays where it is, until
    it is moved back to the last row (↓, ctrl+end)."""

    @property
    def following(self) -> bool:
        return self.cursor_row >= self.row_count - 1

    def add_newest(self, cells: list, key: str) -> None:
        following = self.following
        self.add_row(*cells, key=key)
        if following:
            self.move_cursor(row=self.row_count - 1)

    def on_resize(self) -> None:
        if self.row_count and self.following:
            self.call_after_refresh(self.move_cursor, row=self.row_count - 1)


class Log(RichLog):
    """The log, its newest line in view when the panels around it open and close (a write scrolls to it too)."""

    def on_resize(self) -> None:
        self.call_after_refresh(self.scroll_end, animate=False, x_axis=False)


class WatchApp(App):
    TITLE = "tsdev watch"
    # The current reload's and the errors' max-height are set by lay_out_panels (panel_heights): their contents are
    # fitted to them, so that the outcome and the error's line always show.
    CSS = f"""
    #header {{ height: 1; background: $boost; padding: 0 1; }}
    #current {{ height: auto; min-height: 3; overflow-y: auto; border: round $primary; padding: 0 1; }}
    #history {{ height: 2fr; min-height: {HISTORY_MIN}; border: round $panel; }}
    #errors {{ height: auto; overflow-y: auto; scrollbar-gutter: stable; scrollbar-size-vertical: 1;
              border: round $error; padding: 0 1; display: none; }}
    #log {{ height: 1fr; min-height: {LOG_MIN}; max-height: 9; border: round $panel; }}
    """
    # Short labels: the footer holds all of them at 80 columns (the README lists what each does)
    BINDINGS = [
        Binding("r", "reload_all", "reload"),
        Binding("R", "restart", "restart"),
        Binding("b", "bench", "bench"),
        Binding("p", "profile", "profile"),
        Binding("g", "golden", "golden"),
        Binding("k", "kernel_checks", "kernels"),
        Binding("c", "clear", "clear"),
        Binding("q", "quit", "quit"),
        # Ctrl-C quits as it does with --no-tui (Textual's default only says to press ctrl+q); before any widget's
        # ctrl+c (the screen's copy of selected text)
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
    ]
    ENABLE_COMMAND_PALETTE = False  # every action has its key

    def __init__(self, config: WatchConfig, transport=None):
        super().__init__()
        self.daemon = Daemon(config, self.on_daemon_event, transport)
        self.errors: list[str] = []
        self.failure: str | None = None  # why the first start failed, printed after the screen closes
        self.live: ReloadRecord | RestartRecord | None = None
        self.records: dict[str, ReloadRecord | RestartRecord] = {}  # the history's rows, by row key
        self.columns: tuple[str, ...] = ()
        self.trigger_width = WIDTHS["trigger"]
        self.current_rows, self.errors_rows = panel_heights(24, False)  # set for the screen by lay_out_panels

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Static("waiting for the first save...", id="current")
        yield History(id="history", zebra_stripes=True, cursor_type="row")
        yield Static(id="errors")
        yield Log(id="log", wrap=True, markup=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#history", DataTable)
        self.lay_out_history(self.size.width)
        self.lay_out_panels()
        self.query_one("#current").border_title = "current"
        table.border_title = "history"
        self.query_one("#errors").border_title = "errors (first first; kept until the next success)"
        self.query_one("#log").border_title = "log"
        self.draw_header()
        self.set_interval(0.2, self.draw_current)
        self.run_worker(self.run_daemon(), exclusive=True)

    async def run_daemon(self) -> None:
        code = await self.daemon.run()
        self.exit(return_code=code)

    # --- keys --------------------------------------------------------------------------------------

    def action_reload_all(self) -> None:
        self.daemon.reload_all()

    def action_restart(self) -> None:
        self.daemon.restart()

    def action_bench(self) -> None:
        self.daemon.bench()

    def action_profile(self) -> None:
        self.daemon.arm_profile()

    def action_golden(self) -> None:
        self.daemon.retake_golden()

    def action_kernel_checks(self) -> None:
        """The kernel checks of the history's selected reload (else the latest that has some), a line per shape."""
        table = self.query_one("#history", DataTable)
        selected = None
        if table.row_count:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
            selected = self.records.get(key)
        checked = [r for r in self.records.values() if isinstance(r, ReloadRecord) and r.worker is not None
                   and r.worker.kernel_checks]
        record = selected if selected in checked else (checked[-1] if checked else None)
        if record is None:
            off = next((w for r in reversed(self.records.values()) if isinstance(r, ReloadRecord) and r.worker
                        for w in r.worker.warnings if w.startswith("kernel checks are off")), None)
            self.log_line(escape(off) if off else "no kernel checks yet: a reload that changes a Triton kernel "
                          "checks it (`tsdev check` runs them now)")
            return
        self.log_line(f"kernel checks of reload #{record.n}:")
        for line in checks_table(record.worker.kernel_checks):
            self.log_line(escape(line))

    def action_clear(self) -> None:
        self.query_one("#history", DataTable).clear()
        self.records.clear()
        self.query_one("#log", RichLog).clear()
        self.errors.clear()
        self.draw_errors()

    async def action_quit(self) -> None:
        self.log_line("stopping the server..." if self.daemon.server else "detaching...")
        self.daemon.stop()

    # --- drawing -----------------------------------------------------------------------------------

    def on_daemon_event(self, event: Event) -> None:
        record = event.record
        if event.kind == "state":
            self.draw_header()
        elif event.kind == "message":
            self.log_line(message_line(event))
        elif event.kind in ("reload_started", "restart_started"):
            self.live = record
            self.log_line(started_line(event, self.daemon))
            self.draw_row(record)
        elif event.kind == "reload_step":
            self.draw_row(record)
        elif event.kind in ("reload_finished", "restart_finished"):
            self.draw_row(record)
            if isinstance(record, RestartRecord):
                self.log_line(restart_line(record, self.daemon))
            elif isinstance(record, WeightsRecord):
                self.log_line(weights_line(record))
                if record.error and record.n == 0:
                    self.failure = record.error
            if record.error:
                if record.error not in self.errors:
                    self.errors.append(record.error)
            elif isinstance(record, RestartRecord) or record.ok:
                self.errors.clear()
            self.draw_errors()
        self.draw_current()

    def log_line(self, markup: str) -> None:
        log = self.query_one("#log", RichLog)
        width = log.scrollable_content_region.width or None  # wrap at the widget, not at min_width
        log.write(Text.from_markup(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {markup}"), width=width)

    def draw_header(self) -> None:
        info = self.daemon.info
        color = STATE_COLORS.get(info["state"], "white")
        parts = ["[b]tsdev watch[/b]", f"[{color}]● {info['state']}[/{color}]"]
        if info.get("model"):
            parts.append(escape(info["model"]) + (f" on {info['device']}" if info.get("device") else ""))
        parts.append(info["url"] + (" (attached)" if info.get("attach") else ""))
        if info.get("pid"):
            parts.append(f"pid {info['pid']}")
        if info.get("log"):
            parts.append(f"[dim]log {escape(info['log'])}[/dim]")
        self.query_one("#header", Static).update(Text.from_markup("  │  ".join(parts)))

    def draw_current(self) -> None:
        """The reload in flight, or the last one: its head on one line, its steps, and once done its outcome, which
        always shows (the steps give up lines first, ending in …; module lists fold)."""
        record = self.live
        widget = self.query_one("#current", Static)
        if record is None:
            return
        if isinstance(record, RestartRecord):
            verb = "starting the server" if record.n == 0 else f"restart #{record.n}: {escape(record.reason)}"
            if record.done:
                state = "[red]failed[/red]" if record.error else f"[green]up in {record.seconds:.1f} s[/green]"
            else:
                state = f"[yellow]{time.time() - record.started:.1f} s...[/yellow]"
            widget.update(Text.from_markup(f"{verb}  {state}"))
            return
        width, room = widget.content_region.width or self.size.width - 4, self.current_rows - 2
        head = Text.from_markup(self.current_head(record, width), overflow="ellipsis")
        head.no_wrap = True
        outcome = [fit_lines(Text.from_markup(self.current_outcome(record)), width, max(1, room - 1))
                   ] if record.done else []
        shown = max(0, room - 1 - sum(rows(text, width) for text in outcome))
        chips = chip_lines(self.current_chips(record), width)
        if len(chips) > shown:
            chips = chip_lines(self.current_chips(record), width - 2)[:shown]
            chips[-1:] = [line + " …" for line in chips[-1:]]
        ranks = rank_lines(record.ranks) if record.done else []
        widget.update(Group(head, *map(Text.from_markup, chips), *outcome, *map(Text.from_markup, ranks)))

    @staticmethod
    def current_head(record: ReloadRecord, width: int) -> str:
        """'reload #3  reload all (r)  →  tsdev_runtime.models.qwen3 and 19 more + 4 dependent(s)' (markup)."""
        weights = isinstance(record, WeightsRecord)
        head = f"[b]{'weights' if weights else 'reload'} #{record.n}[/b]  {escape(trigger_text(record))}"
        arrow = "  →  "
        room = width - Text.from_markup(head + arrow).cell_len
        if weights:
            return head + arrow + "update_weights (direct)"
        if record.reloaded:
            dependents = f" + {len(record.dependents)} dependent(s)"
            return head + arrow + escape(reloaded_text(record.worker, room - len(dependents)))
        if record.modules and not record.done:
            return head + arrow + escape(fold(record.modules, room))
        return head

    @staticmethod
    def current_chips(record: ReloadRecord) -> list[str]:
        """A chip per step: done (its seconds), failed, running, still to come; once the reload is done, the steps
        that did not run are left out (a failed reload's room goes to its outcome)."""
        weights, chips = isinstance(record, WeightsRecord), []
        for name in ("update", "check") if weights else (*record.step_order(), "check"):
            if name == record.failed:
                chips.append(f"[red]✗ {name} {record.steps.get(name, 0):.2f} s[/red]")
            elif name in record.steps:
                patched = record.worker.graph_nodes_patched if record.worker and name == "recapture" else 0
                split = f" ({patched} nodes patched)" if patched else graph_split(record.steps, name)
                chips.append(f"[green]✓ {name} {record.steps[name]:.2f} s{split}[/green]")
            elif record.current == name and not record.done:
                chips.append(f"[yellow]▶ {name} {time.perf_counter() - record.step_started:.1f} s[/yellow]")
            elif not record.done:
                chips.append(f"[dim]· {name}[/dim]")
        if record.served_after_save is not None:
            chips.append(f"[b]save → serving {record.served_after_save:.2f} s[/b]")
        return chips

    def current_outcome(self, record: ReloadRecord) -> str:
        if isinstance(record, WeightsRecord) and record.error:
            return f"[red]FAILED: {escape(record.error)}[/red]"
        if record.error:
            return f"[red]FAILED: {KEEPS_SERVING}[/red]"
        return (" | ".join([*map(escape, self.kernel_texts(record)), *checks_text(record)])
                or "[green]ok[/green]")

    def kernel_texts(self, record: ReloadRecord) -> list[str]:
        """Each checked op's summary (its share of the limit among it), then a sparkline of its last saves' µs
        from the notebook (tsdev history OP charts them)."""
        texts, notebook = kernel_checks_text(record.worker), self.daemon.notebook
        if notebook is None or record.worker is None:
            return texts
        ops = list(dict.fromkeys(c.op for c in record.worker.kernel_checks))  # checks_summary's order
        return [f"{text} {sparkline(values)}" if len(values := notebook.sparkline_of(op)) > 1 else text
                for op, text in zip(ops, texts)]

    def on_resize(self, event) -> None:
        self.lay_out_history(event.size.width)
        self.lay_out_panels()
        self.call_after_refresh(self.draw_errors)  # fitted to the panel's new width
        self.call_after_refresh(self.draw_current)

    def lay_out_panels(self) -> None:
        """The most rows the current reload and the errors take on this screen (panel_heights)."""
        self.current_rows, self.errors_rows = panel_heights(self.size.height, bool(self.errors))
        self.query_one("#current").styles.max_height = self.current_rows
        self.query_one("#errors").styles.max_height = self.errors_rows or None

    def lay_out_history(self, width: int) -> None:
        """The history's columns for this width (visible_columns); its rows drawn again when they change."""
        columns, trigger = visible_columns(width)
        if (columns, trigger) == (self.columns, self.trigger_width):
            return
        self.columns, self.trigger_width = columns, trigger
        table = self.query_one("#history", DataTable)
        table.clear(columns=True)
        for name in columns:
            table.add_column(HEADERS.get(name, name), key=name)
        for record in self.records.values():
            self.draw_row(record)

    def draw_row(self, record: ReloadRecord | RestartRecord) -> None:
        table = self.query_one("#history", History)
        cells = self.cells(record, self.trigger_width)
        cells = {name: cells[name] for name in self.columns}
        key = f"{type(record).__name__}-{record.n}"
        self.records[key] = record
        if key not in table.rows:
            table.add_newest(list(cells.values()), key)
        else:
            for column, value in cells.items():
                table.update_cell(key, column, value, update_width=True)

    @staticmethod
    def cells(record: ReloadRecord | RestartRecord, trigger_width: int = WIDTHS["trigger"]) -> dict:
        def clip(text: str) -> str:
            return clip_path(text, trigger_width)

        cells = dict.fromkeys(COLUMNS, "")
        cells["time"] = time.strftime("%H:%M:%S", time.localtime(record.started))
        if isinstance(record, RestartRecord):
            cells.update({"#": f"R{record.n}" if record.n else "start",
                          "trigger": clip(f"restart: {record.reason}") if record.n else "start",
                          "total": f"{record.seconds:.2f}" if record.done else "…"})
        elif isinstance(record, WeightsRecord):
            cells.update({"#": f"W{record.n}", "trigger": clip(record.trigger), "reloaded": "new weights",
                          "total": f"{record.steps['update']:.2f}" if "update" in record.steps else ""})
        else:
            reloaded = fold(record.reloaded or record.modules, WIDTHS["reloaded"])
            cells.update({"#": str(record.n), "trigger": clip(trigger_text(record)),
                          "reloaded": clip_to(reloaded, WIDTHS["reloaded"]),
                          "deps": str(len(record.dependents)) if record.worker else ""})
            for name in (*SHOWN_STEPS, "total"):
                if name in record.steps:
                    cells[name] = f"{record.steps[name]:.2f}"
        if isinstance(record, WeightsRecord) and record.verdict is not None and not record.verdict.same:
            cells["golden"] = Text(f"new @{record.verdict.position}", "cyan")  # expected with new weights
        elif record.verdict is not None:
            cells["golden"] = (Text("same", "green") if record.verdict.same
                               else Text(f"changed @{record.verdict.position}", "yellow"))
        if record.probe is not None:
            delta = record.probe.delta
            cells["decode ms/step"] = f"{record.probe.ms:.2f}" + (f" ({delta:+.2f})" if delta is not None else "")
        if record.done:
            if isinstance(record, ReloadRecord) and outcome_of(record) == "kernel check failed":
                cells["outcome"] = Text("check failed", "red")  # rolled back under strict, served under report
            elif record.error:
                cells["outcome"] = Text("failed", "red")
            elif isinstance(record, ReloadRecord) and record.restart:
                cells["outcome"] = Text("needs restart", "yellow")
            elif isinstance(record, WeightsRecord):
                cells["outcome"] = Text("weights", "green")
            elif isinstance(record, ReloadRecord) and not record.reloaded:
                cells["outcome"] = Text("no change", "dim")
            else:
                cells["outcome"] = Text("restarted" if record.n and isinstance(record, RestartRecord) else "ok",
                                        "green")
        else:
            cells["outcome"] = Text("running", "yellow")
        return cells

    def draw_errors(self) -> None:
        """The errors, first first. The first one fits the panel: its message (cut with … only where it would leave
        no room), then as much of the code around its line as is left, that line (❱) always among it."""
        widget = self.query_one("#errors", Static)
        widget.display = bool(self.errors)
        self.lay_out_panels()
        width, room = widget.scrollable_content_region.width or self.size.width - 5, self.errors_rows - 2
        parts = []
        for n, error in enumerate(self.errors):
            message, code = Text(error, style="bold red"), excerpt(error)
            if n == 0 and code is not None:
                shown = min(rows(message, width), max(1, room - 1))
                message, code = fit_lines(message, width, shown), excerpt(error, room - shown)
            elif n == 0:
                message = fit_lines(message, width, max(1, room))
            parts += [message, *([code] if code is not None else [])]
        widget.update(Group(*parts))


def run_tui(config: WatchConfig) -> int:
    app = WatchApp(config)
    app.run()
    if app.failure:
        print(f"tsdev watch: the server did not start: {app.failure}")
    return app.return_code or 0
