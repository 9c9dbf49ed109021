"""`tsdev history`: the notebook (tsdev/notebook.py) read back -- the saves as a table, a kernel's µs per shape across
saves as a chart in the terminal or a page, the fastest version that passed its check with its diff from the file
now, and any version written back (a running `tsdev watch` then reloads it)."""
from __future__ import annotations

import datetime
import difflib
import html
import re
import time
from collections.abc import Sequence
from pathlib import Path

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tsdev.notebook import Notebook

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
OUTCOME_COLORS = {"ok": "green", "kernel check failed": "red", "rolled back": "red", "restart failed": "red",
                  "needs restart": "yellow"}
BAR = 40  # the terminal chart's widest bar, in cells


def parse_since(text: str, now: float | None = None) -> float:
    """'30m', '2h', '3d', '1w' ago, or an ISO date/time ('2026-12-07', '2026-12-07T14:00'): a Unix time."""
    if match := re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw])", text.strip()):
        return (now or time.time()) - float(match[1]) * UNITS[match[2]]
    try:
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ValueError(f"--since {text!r}: give an age (30m, 2h, 3d, 1w) or a date (2026-12-07[T14:00])") from None


def when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at).strftime("%m-%d %H:%M:%S")


def saves_table(notebook: Notebook, kernel: str | None = None, file: str | None = None, since: float | None = None,
                outcome: str | None = None, limit: int | None = 50) -> Table:
    """The saves, newest first: id, time, trigger, files, kernels checked, outcome, golden, decode ms/step."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("id", "right"), ("time", "left"), ("kind", "left"), ("files", "left"),
                          ("kernels", "left"), ("outcome", "left"), ("golden", "left"), ("ms/step", "right")):
        table.add_column(name, justify=justify, overflow="fold")
    for row in notebook.saves(kernel, file, since, outcome, limit):
        color = OUTCOME_COLORS.get(row["outcome"], "dim")
        golden = "" if row["golden_same"] is None else ("same" if row["golden_same"] else "changed")
        table.add_row(str(row["id"]), when(row["at"]), row["kind"], escape(row["paths"] or row["trigger"]),
                      escape(row["ops"] or ""), f"[{color}]{escape(row['outcome'])}[/{color}]", golden,
                      "" if row["decode_ms"] is None else f"{row['decode_ms']:.2f}")
    return table


def series(notebook: Notebook, op: str, shape: str | None = None, last: int = 30) -> dict[str, list]:
    """shape -> the kernel's last rows there (oldest first): a save's id, time, µs after, ok, share, bound."""
    by_shape: dict[str, list] = {}
    for row in notebook.kernel_rows(op, shape):
        by_shape.setdefault(row["shape"], []).append(row)
    return {s: rows[-last:] for s, rows in by_shape.items()}


def chart(notebook: Notebook, op: str, shape: str | None = None, last: int = 30) -> list[Text | str]:
    """A bar per save and shape: its µs after the edit (✓ passed, ✗ failed), the fastest passing one marked ★."""
    found = series(notebook, op, shape, last)
    if not found:
        return [f"no record of {op}" + (f" at {shape}" if shape else "") + " in the notebook"]
    lines: list[Text | str] = []
    for s, rows in found.items():
        timed = [r["us_after"] for r in rows if r["us_after"] is not None]
        best = notebook.best(op, s)
        lines.append(Text(f"{op} [{s}]  µs per save (last {len(rows)})", style="bold"))
        if not timed:
            lines.append(Text("  not timed (times are taken on a GPU)", style="dim"))
        top = max(timed, default=1.0)
        for r in rows:
            us = r["us_after"]
            bar = "█" * max(1, round(BAR * us / top)) if us is not None else ""
            mark = "✓" if r["ok"] else "✗"
            star = " ★ best" if best is not None and best["save_id"] == r["save_id"] else ""
            share = f"  {100 * r['share']:.0f} % of {r['bound']}" if r["share"] is not None else ""
            text = Text(f"  #{r['save_id']:<6} {when(r['at'])} ")
            text.append(f"{bar:<{BAR}}", style="green" if r["ok"] else "red")
            text.append(f" {'-' if us is None else f'{us:.2f}'} µs {mark}{share}{star}")
            lines.append(text)
    return lines


def _svg(rows: Sequence, width: int = 640, height: int = 200) -> str:
    """An inline SVG line chart of the rows' µs after each save (failed saves as red dots)."""
    points = [(i, r["us_after"], r["ok"], r["save_id"]) for i, r in enumerate(rows) if r["us_after"] is not None]
    if not points:
        return '<p class="dim">not timed (times are taken on a GPU)</p>'
    low, high = min(p[1] for p in points), max(p[1] for p in points)
    span, pad, n = (high - low) or 1.0, 30, max(len(rows) - 1, 1)
    x = lambda i: pad + (width - 2 * pad) * i / n  # noqa: E731
    y = lambda us: height - pad - (height - 2 * pad) * (us - low) / span  # noqa: E731
    path = " ".join(f"{x(i):.1f},{y(us):.1f}" for i, us, _, _ in points)
    dots = "".join(f'<circle cx="{x(i):.1f}" cy="{y(us):.1f}" r="4" fill="{"#2a2" if ok else "#d22"}">'
                   f"<title>save #{sid}: {us:.2f} µs{'' if ok else ' (check failed)'}</title></circle>"
                   for i, us, ok, sid in points)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">'
            f'<rect width="{width}" height="{height}" fill="#fff" stroke="#ccc"/>'
            f'<text x="4" y="{pad - 10}" font-size="11">{high:.2f} µs</text>'
            f'<text x="4" y="{height - 8}" font-size="11">{low:.2f} µs</text>'
            f'<polyline points="{path}" fill="none" stroke="#36c" stroke-width="2"/>{dots}</svg>')


def _number(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _share(row) -> str:
    return "" if row["share"] is None else f"{100 * row['share']:.0f} % of {row['bound']}"


def html_page(notebook: Notebook, ops: Sequence[str], shape: str | None = None, last: int = 100) -> str:
    """A self-contained page (inline SVG and CSS, nothing fetched): per kernel and shape, its µs across saves and a
    table of the saves."""
    body = []
    for op in ops:
        for s, rows in series(notebook, op, shape, last).items():
            best = notebook.best(op, s)
            cells = "".join(
                f"<tr><td>#{r['save_id']}</td><td>{when(r['at'])}</td><td>{'ok' if r['ok'] else 'FAILED'}</td>"
                f"<td>{_number(r['max_abs'], '.1e')}</td><td>{_number(r['us_before'], '.2f')}</td>"
                f"<td>{_number(r['us_after'], '.2f')}</td><td>{_share(r)}</td>"
                f"<td>{html.escape(r['outcome'])}</td></tr>" for r in rows)
            best_line = (f"<p>fastest passing: save #{best['save_id']}, {best['us_after']:.2f} µs</p>"
                         if best is not None else "")
            body.append(f"<h2>{html.escape(op)} [{html.escape(s)}]</h2>{best_line}{_svg(rows)}"
                        "<table><tr><th>save</th><th>time</th><th>check</th><th>max err</th><th>µs before</th>"
                        f"<th>µs after</th><th>share of the limit</th><th>outcome</th></tr>{cells}</table>")
    project = notebook.project
    title = f"tsdev history — {html.escape(str(project or notebook.path))}"
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>{title}</title><style>'
            "body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}"
            "td,th{border-bottom:1px solid #ddd;padding:2px 8px;text-align:right}.dim{color:#888}"
            f"</style></head><body><h1>{title}</h1>{''.join(body) or '<p>no kernel records</p>'}</body></html>")


def best_report(notebook: Notebook, op: str, shape: str | None, project: Path) -> tuple[int | None, list[str]]:
    """(the best save's id, lines: which save, its time, and each of its files' diff from the file now)."""
    best = notebook.best(op, shape)
    if best is None:
        return None, [f"no passing, timed version of {op}" + (f" at {shape}" if shape else "") + " in the notebook"]
    lines = [f"fastest passing {op} [{best['shape']}]: save #{best['save_id']} ({when(best['at'])}), "
             f"{best['us_after']:.2f} µs" + (f", {100 * best['share']:.0f} % of {best['bound']}"
                                              if best["share"] is not None else "")]
    for path, _ in notebook.files_of(best["save_id"]):
        then = notebook.version_of(path, best["save_id"])
        if then is None:
            continue
        file = project / path
        now = file.read_text() if file.is_file() else ""
        diff = list(difflib.unified_diff(now.splitlines(keepends=True), then.splitlines(keepends=True),
                                         f"{path} (now)", f"{path} (save #{best['save_id']})"))
        lines += [line.rstrip("\n") for line in diff] or [f"{path}: the same as now"]
    lines.append(f"write it back: tsdev history --restore {best['save_id']}")
    return best["save_id"], lines


def restore(notebook: Notebook, save_id: int, project: Path) -> list[str]:
    """Write the files of save `save_id` back as that save read them; the paths written. A running `tsdev watch`
    sees the saves and reloads them."""
    files = notebook.files_of(save_id)
    if not files:
        raise ValueError(f"save #{save_id} holds no file (`tsdev history` lists the saves and their files)")
    written = []
    for path, _ in files:
        text = notebook.version_of(path, save_id)
        if text is None:
            continue
        target = project / path
        if not target.is_file() or target.read_text() != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            written.append(path)
    return written
