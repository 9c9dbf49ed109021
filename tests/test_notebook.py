"""The kernel author's notebook (tsdev/notebook.py) and `tsdev history` (tsdev/history.py): records written by a
reload the daemon checks with the interpreter's kernel checks, two writers at once, a version restored and reloaded,
pruning that keeps the best, the terminal chart and the page."""
import asyncio
import importlib
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch
from typer.testing import CliRunner

from fake_server import FakeServer, make_project, ok_worker
from tsdev_kernels import checks
from tsdev_kernels.ops import norm  # noqa: F401
from tsdev_runtime.engine.kernel_checks import reported
from tsdev.cli import app
from tsdev.notebook import Entry, KernelRow, Notebook, Writer, notebook_path, read_texts, sparkline
from tsdev.watch.records import ReloadRecord, entry_of

RMS_NORM = next(c for c in checks.declared() if c.op == "rms_norm")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path / "cache"))


def entry(at: float, us: float | None, ok: bool = True, text: str = "v", shape: str = "4x64", path: str = "k.py",
          outcome: str = "ok") -> Entry:
    return Entry(at=at, kind="reload", trigger="save", outcome=outcome, files={path: text},
                 kernels=[KernelRow("rms_norm", shape, "bfloat16", ok, 1e-3, None, us, 1000, 0,
                                    None if us is None else 0.5, "bandwidth")])


def test_a_reload_checked_with_the_interpreter_is_recorded_with_its_files_text_and_kernels(tmp_path):
    from test_watch_daemon import session

    project, server = make_project(tmp_path / "p"), FakeServer()
    results = checks.run_all([(RMS_NORM, (4, 64)), (RMS_NORM, (8, 64))], torch.float32, "cpu")  # the real check
    assert all(r.ok for r in results)
    server.answer = lambda request: ok_worker(kernel_checks=reported(results),
                                              kernels={"tsdev_kernels.ops.act.k": "triton"})
    text = "def act(x):\n    return -x\n"
    events = session(project, server, lambda daemon: (project / "kernels/tsdev_kernels/ops/act.py").write_text(text))
    notebook = Notebook(notebook_path(project))
    saves = notebook.saves(kernel="rms_norm")
    assert len(saves) == 1 and saves[0]["outcome"] == "ok" and saves[0]["kind"] == "reload"
    assert saves[0]["golden"] == "golden: same 24 tokens" and saves[0]["decode_ms"] is not None
    assert notebook.files_of(saves[0]["id"]) == [("kernels/tsdev_kernels/ops/act.py", text)]
    rows = notebook.kernel_rows("rms_norm")
    assert [r["shape"] for r in rows] == ["4x64", "8x64"]
    assert [r["max_abs"] for r in rows] == [r.max_abs for r in results] and all(r["ok"] for r in rows)
    assert rows[0]["bytes"] == 2 * 4 * 64 * 4 + 64 * 4 and rows[0]["flops"] == 0  # on the check's own inputs
    assert notebook.saves(outcome="restarted")  # the daemon's start, as a restart record
    # what the record costs the save → serving: the texts read when the reload is asked for; the rest is a thread's
    record = next(e.record for e in events if e.kind == "reload_finished")
    files = ["kernels/tsdev_kernels/ops/act.py"]
    start = time.perf_counter()
    for _ in range(100):
        read_texts(project, files)
    read_ms = (time.perf_counter() - start) * 10
    writer = Writer(tmp_path / "bench.sqlite", project)
    start = time.perf_counter()
    for _ in range(100):
        writer.put(entry_of(record))
    put_ms = (time.perf_counter() - start) * 10
    writer.flush()
    writer.close()
    print(f"\nnotebook: texts read {read_ms:.3f} ms, entry built and queued {put_ms:.3f} ms per save (the save → "
          f"serving pays the first only); the thread's write {1e3 * statistics.median(writer.write_seconds):.2f} ms")
    assert writer.written == 100 and not writer.errors


def test_two_writers_at_once_both_land_and_texts_are_kept_once(tmp_path):
    path = tmp_path / "nb.sqlite"
    Notebook(path).close()
    errors = []

    def write(tag: int) -> None:
        notebook = Notebook(path)  # a connection of its own, as a second daemon has
        try:
            for i in range(40):
                notebook.add(entry(1000.0 + i, 5.0 + tag, text=f"shared {i % 4}"))
        except sqlite3.Error as exc:
            errors.append(exc)
        finally:
            notebook.close()

    threads = [threading.Thread(target=write, args=(tag,)) for tag in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    notebook = Notebook(path)
    assert not errors and len(notebook.saves(limit=None)) == 80
    assert notebook.db.execute("SELECT count(*) FROM texts").fetchone()[0] == 4
    assert notebook.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_two_processes_write_at_once(tmp_path):
    path = tmp_path / "nb.sqlite"
    Notebook(path).close()
    code = ("import sys; from tsdev.notebook import Notebook, Entry\n"
            "n = Notebook(sys.argv[1])\n"
            "for i in range(30):\n"
            "    n.add(Entry(at=float(i), kind='reload', trigger='save', outcome='ok', files={'a.py': 'x'}))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)]) for _ in range(2)]
    assert [p.wait(60) for p in procs] == [0, 0]
    assert len(Notebook(path).saves(limit=None)) == 60


def test_a_version_restored_is_what_the_reloader_serves(tmp_path, monkeypatch):
    from tsdev.hotreload import Reloader
    from tsdev.history import best_report, restore

    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # edits land within the same second: no .pyc
    name = f"nbpkg_{os.getpid()}"
    project = tmp_path / name
    project.mkdir()
    (project / "__init__.py").write_text("")
    (project / "ops.py").write_text("def scale():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    mod = importlib.import_module(f"{name}.ops")
    reloader = Reloader([name])
    notebook = Notebook(tmp_path / "nb.sqlite", project)
    fast = notebook.add(entry(1.0, 3.0, text=(project / "ops.py").read_text(), path="ops.py"))

    def reload() -> None:
        importlib.invalidate_caches()
        tx = reloader.reload()
        assert tx.report.ok, tx.report.error
        tx.commit()

    try:
        (project / "ops.py").write_text("def scale():\n    return 2\n")
        reload()
        assert mod.scale() == 2
        notebook.add(entry(2.0, 5.0, text=(project / "ops.py").read_text(), path="ops.py"))
        found, lines = best_report(notebook, "rms_norm", None, project)
        assert found == fast and "-    return 2" in lines and "+    return 1" in lines
        assert restore(notebook, fast, project) == ["ops.py"]
        reload()  # what tsdev watch does when it sees the write
        assert mod.scale() == 1
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


def test_pruning_by_age_and_size_keeps_each_kernels_best(tmp_path):
    notebook = Notebook(tmp_path / "nb.sqlite")
    now = 100 * 86400.0
    best = notebook.add(entry(0.0, 2.0, text="fast " * 2000))  # old, and the fastest passing
    notebook.add(entry(1.0, 1.0, ok=False, text="wrong"))  # faster, but its check failed
    notebook.add(entry(2.0, 1.5, text="rolled", outcome="rolled back"))  # faster, but rolled back
    old = [notebook.add(entry(3.0 + i, 9.0, text=f"old {i}")) for i in range(5)]
    recent = [notebook.add(entry(now - 60 + i, 8.0, text=f"new {i} " * 5000)) for i in range(20)]
    assert notebook.prune(keep_days=30, max_mb=None, now=now) == 7
    ids = {row["id"] for row in notebook.saves(limit=None)}
    assert best in ids and not ids & set(old) and set(recent) <= ids
    assert notebook.db.execute("SELECT count(*) FROM texts WHERE text = 'wrong'").fetchone()[0] == 0
    before = notebook.used_mb()
    notebook.prune(keep_days=None, max_mb=before / 3, now=now)
    ids = {row["id"] for row in notebook.saves(limit=None)}
    assert best in ids and notebook.used_mb() <= before / 3 and len(ids) < 21
    assert notebook.version_of("k.py", best) == "fast " * 2000


def populate(path, saves: int) -> None:
    """`saves` saves in one transaction (Notebook.add commits each: the test's time goes elsewhere)."""
    notebook = Notebook(path)
    db = notebook.db
    db.execute("BEGIN")
    db.executemany("INSERT INTO saves(id, at, kind, trigger, outcome) VALUES (?, ?, 'reload', 'save', ?)",
                   [(i, 1e9 + i, "ok" if i % 7 else "kernel check failed") for i in range(1, saves + 1)])
    db.executemany("INSERT INTO files VALUES (?, ?, ?)", [(i, f"ops/f{i % 5}.py", "h") for i in range(1, saves + 1)])
    db.executemany("INSERT INTO kernels(save_id, op, shape, dtype, ok, max_abs, us_after) VALUES (?,?,?,?,?,?,?)",
                   [(i, f"op{i % 10}", s, "bfloat16", 1, 1e-3, 4.0 + (i % 13) / 10) for i in range(1, saves + 1)
                    for s in ("1x1024", "256x1024")])
    db.execute("INSERT INTO texts VALUES ('h', 'x')")
    db.execute("COMMIT")
    notebook.close()


def test_history_of_ten_thousand_saves_answers_with_a_table(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    populate(notebook_path(project), 10_000)
    runs = []
    for args in (["history"], ["history", "--kernel", "op3", "--outcome", "ok"], ["history", "--file", "f2.py"],
                 ["history", "op3"]):
        start = time.perf_counter()
        result = CliRunner().invoke(app, [*args, "--project", str(project)], env={"COLUMNS": "160"})
        runs.append((" ".join(args), time.perf_counter() - start))
        assert result.exit_code == 0, result.output
    print("\n10,000 saves: " + ", ".join(f"`tsdev {a}` {s * 1e3:.0f} ms" for a, s in runs) + " (in-process)")
    table = CliRunner().invoke(app, ["history", "--kernel", "op3", "--outcome", "ok", "--limit", "3",
                                     "--project", str(project)], env={"COLUMNS": "160"}).output
    assert "10000" not in table and "9993" in table and "kernel check failed" not in table  # 9993 % 10 == 3
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tsdev", "history", "--project", str(project)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "160"})
    print(f"`tsdev history` as a process over 10,000 saves: {time.perf_counter() - start:.2f} s")
    assert out.returncode == 0 and "10000" in out.stdout


def test_the_chart_and_the_page_show_a_kernels_times_across_saves(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "k.py").write_text("now\n")
    notebook = Notebook(notebook_path(project), project)
    for i, us in enumerate([5.0, 4.0, 3.0, 6.0]):
        notebook.add(entry(1e9 + i, us, ok=us != 3.0, text=f"v{i}\n"))
    chart = CliRunner().invoke(app, ["history", "rms_norm", "--project", str(project)], env={"COLUMNS": "120"}).output
    lines = [line for line in chart.splitlines() if line.strip().startswith("#")]
    assert "rms_norm [4x64]" in chart and len(lines) == 4
    assert "4.00 µs ✓  50 % of bandwidth ★ best" in lines[1] and "3.00 µs ✗" in lines[2]
    bars = [line.count("█") for line in lines]
    assert bars[3] == max(bars) and bars[2] < bars[1] < bars[0] < bars[3]  # bars follow the µs
    page = tmp_path / "history.html"
    result = CliRunner().invoke(app, ["history", "rms_norm", "--html", str(page), "--project", str(project)])
    assert result.exit_code == 0, result.output
    html = page.read_text()
    assert "<svg" in html and "<polyline" in html and html.count("<circle") == 4 and "rms_norm [4x64]" in html
    assert "save #2: 4.00 µs" in html and "fastest passing: save #2" in html
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    best = CliRunner().invoke(app, ["history", "--best", "rms_norm", "--project", str(project)]).output
    assert "save #2" in best and "-now" in best and "+v1" in best
    restored = CliRunner().invoke(app, ["history", "--restore", "2", "--project", str(project)])
    assert restored.exit_code == 0 and (project / "k.py").read_text() == "v1\n"
    assert sparkline([5.0, 4.0, 3.0, 6.0]) == "▆▃▁█"
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if browser is None:
        return  # no headless browser here: the page's content was checked above
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=60).stdout
    assert "<svg" in dom and "rms_norm [4x64]" in dom


def test_the_writer_feeds_the_sparklines_and_survives_a_restart(tmp_path):
    path, project = tmp_path / "nb.sqlite", tmp_path
    writer = Writer(path, project)
    for us in (5.0, 4.0):
        writer.put(entry(1.0, us))
    writer.close()
    again = Writer(path, project)  # a new daemon: the sparkline starts from the notebook
    again._loaded.wait(10)
    again.put(entry(2.0, 3.0))
    assert again.sparkline_of("rms_norm") == [5.0, 4.0, 3.0]
    again.close()
    asyncio.run(asyncio.sleep(0))


def test_a_failed_check_and_a_rollback_are_told_apart():
    from tsdev_runtime.control_protocol import KernelCheckResult, WorkerReport

    failing = KernelCheckResult(op="rms_norm", shape=[4, 64], dtype="float32", max_abs=1.0, max_rel=1.0, atol=0,
                                rtol=0, ok=False, seed=1)
    record = ReloadRecord(1, "save", ["k.py"])
    record.finish(WorkerReport(ok=False, error="kernel check failed: rms_norm at 4x64 ...", kernel_checks=[failing]))
    assert entry_of(record).outcome == "kernel check failed"
    record = ReloadRecord(2, "save", ["k.py"])
    record.finish(WorkerReport(ok=False, error="k.py:2: SyntaxError"))
    assert entry_of(record).outcome == "rolled back"
    record = ReloadRecord(3, "save", ["k.py"])
    record.finish(WorkerReport(ok=True, reloaded=["k"]))
    assert entry_of(record).outcome == "ok"


def test_the_screen_shows_each_changed_kernels_share_of_the_limit_and_its_last_saves_as_a_sparkline(tmp_path):
    from fake_server import URL
    from tsdev_runtime.control_protocol import KernelCheckResult, WorkerReport
    from tsdev.outcome import checks_table
    from tsdev.watch.args import WatchConfig
    from tsdev.watch.tui import WatchApp

    def result(tokens: int, us: float, share: float) -> KernelCheckResult:
        return KernelCheckResult(op="rms_norm", shape=[tokens, 1024], dtype="bfloat16", max_abs=4e-3, max_rel=1e-2,
                                 atol=1e-2, rtol=1e-2, ok=True, seed=1, us_before=4.4, us_after=us, before_fresh=True,
                                 timed="graph", bytes=2 * tokens * 1024 * 2 + 2048, flops=0, share=share,
                                 bound="bandwidth")

    screen = WatchApp(WatchConfig(attach=URL, project=tmp_path))
    try:
        for us in (6.0, 5.0, 4.4):
            screen.daemon.notebook.put(entry(1.0, us))
        record = ReloadRecord(1, "save", ["k.py"])
        record.finish(WorkerReport(ok=True, reloaded=["tsdev_kernels.ops.norm"],
                                   kernel_checks=[result(1, 2.0, 0.01), result(256, 4.1, 0.82)]))
        screen.daemon.notebook.put(entry_of(record))
        text = screen.current_outcome(record)
        assert "rms_norm: err 4e-03 ok · 4.4 → 3.0 µs (-31%) at 2 shape(s)" in text
        assert "[256x1024] 4.1 µs = 82 % of bandwidth" in text
        assert text.endswith(" " + sparkline([6.0, 5.0, 4.4, 3.05]))  # the last saves' µs (medians), this one last
        assert sparkline([6.0, 5.0, 4.4, 3.05]) == "█▆▄▁"
    finally:
        screen.daemon.notebook.close()
    assert "82 % bw" in checks_table(record.worker.kernel_checks)[2]
