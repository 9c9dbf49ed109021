"""The watch screen, driven by Textual's test pilot against the in-process fake server: what it shows."""
import pytest
import asyncio
import html
import re

from fake_server import URL, FakeServer, failed_worker, make_project, ok_worker, until
from tsdev.watch.args import WatchConfig
from tsdev.watch.tui import WatchApp


def screen_text(app) -> str:
    """The characters on the screen, line by line, from Textual's SVG screenshot (text placed by its x)."""
    spans = re.findall(r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)" textLength="([\d.]+)"[^>]*>([^<]*)</text>',
                       app.export_screenshot())
    spans = [(float(x), float(y), float(width), html.unescape(text).replace("\xa0", " "))
             for x, y, width, text in spans]
    cell = next(width / len(text) for _, _, width, text in sorted(spans, key=lambda s: -len(s[3])))
    rows: dict[float, dict[int, str]] = {}
    for x, y, _, text in spans:
        row = rows.setdefault(y, {})
        for i, char in enumerate(text):
            row[round(x / cell) + i] = char
    return "\n".join("".join(row.get(i, " ") for i in range(max(row) + 1)).rstrip() for _, row in sorted(rows.items()))


@pytest.mark.slow
def test_reload_row_with_timings_then_an_error_with_file_line_and_code(tmp_path):
    project, server = make_project(tmp_path), FakeServer()
    server.output_changed_at = 3
    act = project / "kernels/tsdev_kernels/ops/act.py"
    app = WatchApp(WatchConfig(attach=URL, project=project, probe_batch=2, probe_steps=4), server.transport())

    async def main():
        async with app.run_test(size=(200, 48)) as pilot:
            await until(lambda: app.daemon.watcher.ready.is_set() and app.daemon.info["state"] == "serving")
            await pilot.pause(0.3)
            act.write_text("def act(x):\n    return 2 * x\n")
            await until(lambda: app.daemon.reloads.records and app.daemon.reloads.records[-1].done)
            await pilot.pause(0.2)
            first = screen_text(app)

            server.answer = lambda request: failed_worker(f"{act}:2: SyntaxError: invalid syntax")
            act.write_text("def act(x):\n    return (2 * x\n")
            await until(lambda: len(app.daemon.reloads.records) == 2 and app.daemon.reloads.records[-1].done)
            await pilot.pause(0.2)
            second = screen_text(app)

            await pilot.press("c")
            await pilot.pause(0.2)
            cleared = screen_text(app)
            await pilot.press("q")
            await until(lambda: app.return_code is not None)
            return first, second, cleared

    first, second, cleared = asyncio.run(main())
    # the history row: trigger, module, dependents, each step's seconds, golden verdict, probe
    row = next(line for line in first.splitlines() if re.search(r" 1 +\d\d:\d\d:\d\d +save …\S*/ops/act\.py", line))
    for cell in ("0.01", "0.00", "0.03", "0.12", "0.46", "0.08", "0.63", "0.64", "changed @3", "ok"):
        assert cell in row, (cell, row)
    # the current reload's steps
    assert "✓ warm 0.12 s" in first and "✓ recapture 0.46 s (decode 0.30, prefill 0.16)" in first
    assert "golden: output changed at token 3 of 24" in first
    assert "fake-model" in first and "serving" in first
    # the error: message with file:line first, then the code around that line
    assert f"{act}:2: SyntaxError: invalid syntax" in second
    assert "2     return (2 * x" in second and "failed" in second and "✗ reload 0.02 s" in second
    assert "SyntaxError" not in cleared
    assert app.return_code == 0


async def one_save(app, pilot, project) -> None:
    """Once the daemon serves: save an edit of act.py and wait for its reload to end."""
    await until(lambda: app.daemon.watcher.ready.is_set() and app.daemon.info["state"] == "serving")
    await pilot.pause(0.3)
    (project / "kernels/tsdev_kernels/ops/act.py").write_text("def act(x):\n    return 2 * x\n")
    await until(lambda: app.daemon.reloads.records and app.daemon.reloads.records[-1].done)
    await pilot.pause(0.3)


def screens_after_one_save(tmp_path, workers, press: str | None = None) -> list[str]:
    """The screen after one save answered with `workers`, and after pressing `press` then (200x48)."""
    project, server = make_project(tmp_path), FakeServer()
    server.answer = lambda request: workers
    app = WatchApp(WatchConfig(attach=URL, project=project, probe_batch=2, probe_steps=4), server.transport())

    async def main():
        async with app.run_test(size=(200, 48)) as pilot:
            await one_save(app, pilot, project)
            screens = [screen_text(app)]
            if press:
                await pilot.press(press)
                await pilot.pause(0.3)
                screens.append(screen_text(app))
            await pilot.press("q")
            await until(lambda: app.return_code is not None)
            return screens

    return asyncio.run(main())


def screens_around_k(tmp_path, worker) -> tuple[str, str]:
    """The screen after one save answered with `worker`, and after pressing `k` then."""
    before, after = screens_after_one_save(tmp_path, [worker], press="k")
    return before, after


def test_a_reload_on_two_ranks_shows_each_ranks_line(tmp_path):
    from fake_server import ok_worker

    [shown] = screens_after_one_save(tmp_path, [ok_worker(), ok_worker().model_copy(update={"rank": 1})])
    assert "rank 0: ok | jit 0.08" in shown and "rank 1: ok | jit 0.08" in shown, shown


@pytest.mark.slow
def test_at_80_by_24_the_history_drops_columns_in_order_and_keeps_the_outcome(tmp_path):
    from tsdev.watch.tui import DROP_ORDER, visible_columns

    project, server = make_project(tmp_path), FakeServer()
    server.output_changed_at = 3
    app = WatchApp(WatchConfig(attach=URL, project=project, probe_batch=2, probe_steps=4), server.transport())

    async def main():
        async with app.run_test(size=(80, 24)) as pilot:
            await one_save(app, pilot, project)
            narrow = screen_text(app)
            await pilot.resize_terminal(200, 48)
            await pilot.pause(0.3)
            wide = screen_text(app)
            await pilot.press("q")
            await until(lambda: app.return_code is not None)
            return narrow, wide

    narrow, wide = asyncio.run(main())
    assert all(len(line) <= 80 for line in narrow.splitlines())
    assert "✓ warm 0.12 s" in narrow and "✓ recapture 0.46 s (decode 0.30, prefill 0.16)" in narrow  # chips whole
    header = next(line for line in narrow.splitlines() if "trigger" in line and "outcome" in line)
    for column in ("#", "total", "golden", "ms/step", "outcome"):
        assert column in header, header
    row = next(line for line in narrow.splitlines() if re.search(r"│ *1 +save", line))
    assert "changed @3" in row and "ok" in row and "0.64" in row, row
    footer = narrow.splitlines()[-1]
    for key in ("reload", "restart", "bench", "profile", "golden", "clear", "quit"):
        assert key in footer, footer
    assert "warm" in wide and "deps" in wide  # the wide screen shows every column again
    columns, _ = visible_columns(80)
    dropped = [c for c in DROP_ORDER if c not in columns]
    assert dropped == list(DROP_ORDER[: len(dropped)])  # dropped in the stated order
    assert visible_columns(400)[0] == tuple(c for c in visible_columns(400)[0])  # nothing dropped when wide
    assert len(visible_columns(400)[0]) == len(DROP_ORDER) + len(columns)


@pytest.mark.slow
def test_a_reloads_kernel_checks_show_as_one_summary_per_op_and_k_shows_them_per_shape(tmp_path):
    from fake_server import ok_worker

    from tsdev_runtime.control_protocol import KernelCheckResult

    def check(tokens, before, after):
        return KernelCheckResult(op="silu_and_mul", shape=[tokens, 6144], dtype="bfloat16", max_abs=2e-3, max_rel=4e-3,
                                 atol=1e-2, rtol=1.6e-2, ok=True, seed=7, us_before=before, us_after=after,
                                 before_fresh=True)

    summary, table = screens_around_k(tmp_path, ok_worker(kernel_checks=[check(1, 4.0, 3.6), check(256, 21.0, 19.0)]))
    assert "silu_and_mul: err 2e-03 ok · 12.5 → 11.3 µs (-10%) at 2 shape(s)" in summary, summary
    assert "kernel checks of reload #1:" in table
    assert (re.search(r"silu_and_mul +1x6144 +bfloat16 +2\.00e-03", table)
            and re.search(r"256x6144 .* 21\.0 +19\.0", table))


@pytest.mark.slow
def test_k_says_why_there_are_no_kernel_checks_where_they_cannot_run(tmp_path):
    from fake_server import ok_worker

    off = "kernel checks are off on cpu: they run the Triton kernels, which need CUDA, or Triton's interpreter"
    before, after = screens_around_k(tmp_path, ok_worker(warnings=[off]))
    assert "no kernel checks yet" not in after, after
    assert after.count("kernel checks are off on cpu") == before.count("kernel checks are off on cpu") + 1, after


def test_at_80x24_the_history_keeps_its_rows_beside_a_wrapped_warning_the_errors_and_the_log(tmp_path):
    from fake_server import ok_worker

    project, server = make_project(tmp_path), FakeServer()
    act = project / "kernels/tsdev_kernels/ops/act.py"
    warning = "patching the graphs failed, they were captured again: " + "a long reason that wraps " * 8
    server.answer = lambda request: [ok_worker(warnings=[warning])]
    app = WatchApp(WatchConfig(attach=URL, project=project, probe_batch=2, probe_steps=4), server.transport())

    async def main():
        async with app.run_test(size=(80, 24)) as pilot:
            await until(lambda: app.daemon.watcher.ready.is_set() and app.daemon.info["state"] == "serving")
            await pilot.pause(0.3)
            act.write_text("def act(x):\n    return 2 * x\n")
            await until(lambda: app.daemon.reloads.records and app.daemon.reloads.records[-1].done)
            server.answer = lambda request: failed_worker(f"{act}:2: SyntaxError: invalid syntax " + "detail " * 30)
            act.write_text("def act(x):\n    return (2 * x\n")
            await until(lambda: len(app.daemon.reloads.records) == 2 and app.daemon.reloads.records[-1].done)
            await pilot.pause(0.3)
            regions = {name: app.query_one(f"#{name}").region for name in ("history", "errors", "log")}
            text = screen_text(app)
            await pilot.press("q")
            await until(lambda: app.return_code is not None)
            return regions, text

    regions, text = asyncio.run(main())
    assert regions["errors"].height > 2, regions  # the errors panel is open
    assert regions["history"].height >= 6, regions  # borders, the header row and at least three rows
    rows = [line for line in text.splitlines() if re.match(r"│ (start|\d+) +(start|save)", line)]
    assert len(rows) >= 3, text  # the start row and both reloads
    assert regions["log"].height >= 4 and regions["log"].bottom <= 24, regions  # inside the screen, borders and all


def test_ctrl_c_quits_the_screen_and_stops_the_daemon_as_without_the_screen(tmp_path):
    project, server = make_project(tmp_path), FakeServer()
    app = WatchApp(WatchConfig(attach=URL, project=project, probe_batch=2, probe_steps=4), server.transport())

    async def main():
        async with app.run_test(size=(80, 24)) as pilot:
            await until(lambda: app.daemon.info["state"] == "serving")
            await pilot.press("ctrl+c")
            await until(lambda: app.return_code is not None, timeout=5)

    asyncio.run(main())
    assert app.daemon.stopping and app.return_code == 0


def panels(app, *names: str) -> dict[str, list[str]]:
    """The screen's lines inside each named widget (borders included)."""
    lines = screen_text(app).splitlines()
    assert len(lines) == app.size.height, lines
    regions = {name: app.query_one(f"#{name}").region for name in names}
    return {name: lines[region.y: region.bottom] for name, region in regions.items()}


async def press_r(app, pilot, records: int) -> None:
    """Press `r` and wait until the daemon has `records` reloads, the last one done."""
    await pilot.press("r")
    await until(lambda: len(app.daemon.reloads.records) == records and app.daemon.reloads.records[-1].done)
    await pilot.pause(0.2)


def test_at_80x24_a_failed_reload_after_a_full_history_shows_its_row_its_outcome_and_its_failing_line(tmp_path):
    from tsdev.outcome import KEEPS_SERVING

    project, server = make_project(tmp_path), FakeServer()
    act = project / "kernels/tsdev_kernels/ops/act.py"
    act.write_text("".join(f"X{i} = {i}\n" for i in range(1, 18)) + "def act(x):\n    return (2 * x\n"
                   + "".join(f"Y{i} = {i}\n" for i in range(5)))  # the error's line is 19, as in issue 68
    app = WatchApp(WatchConfig(attach=URL, project=project, probe_batch=2, probe_steps=4), server.transport())

    async def main():
        async with app.run_test(size=(80, 24)) as pilot:
            await until(lambda: app.daemon.watcher.ready.is_set() and app.daemon.info["state"] == "serving")
            for n in range(1, 9):
                await press_r(app, pilot, n)
            server.answer = lambda request: failed_worker(f"{act}:19: SyntaxError: '(' was never closed")
            server.reload_delay = 0.3  # the new row is drawn before the errors panel opens, as in a real reload
            await press_r(app, pilot, 9)
            shown = panels(app, "current", "history", "errors")
            await pilot.press("q")
            await until(lambda: app.return_code is not None)
            return shown

    shown = asyncio.run(main())
    history = "\n".join(shown["history"])
    assert not re.search(r"│ 1 +reload all", history), history  # more rows than fit: the first ones scrolled away
    assert re.search(r"│ 9 +reload all \(r\) .* failed", history), history  # the newest row, at the bottom
    assert any(f"FAILED: {KEEPS_SERVING}" in line for line in shown["current"]), shown["current"]
    assert any(re.search(r"❱ 19 +return \(2 \* x", line) for line in shown["errors"]), shown["errors"]
    assert any("act.py:19: SyntaxError" in line for line in shown["errors"]), shown["errors"]


def test_at_80x24_a_reload_of_twenty_modules_folds_them_and_keeps_its_steps_and_outcome(tmp_path):
    project, server = make_project(tmp_path), FakeServer()
    modules = [f"tsdev_runtime.models.model_{i}" for i in range(20)]
    server.answer = lambda request: ok_worker(reloaded=modules)
    app = WatchApp(WatchConfig(attach=URL, project=project, probe_batch=2, probe_steps=4), server.transport())

    async def main():
        async with app.run_test(size=(80, 24)) as pilot:
            await until(lambda: app.daemon.watcher.ready.is_set() and app.daemon.info["state"] == "serving")
            await press_r(app, pilot, 1)
            shown = panels(app, "current", "history")
            await pilot.press("q")
            await until(lambda: app.return_code is not None)
            return shown

    shown = asyncio.run(main())
    current = "\n".join(shown["current"])
    assert "reload #1  reload all (r)  →  20 modules + 1 dependent(s)" in current, current
    assert "✓ pause 0.63 s" in current and "golden: same 24 tokens" in current, current  # the last step, the outcome
    assert "model_1" not in current
    assert re.search(r"│ 1 +reload all \(r\) .* ok", "\n".join(shown["history"])), shown["history"]


def test_a_history_cursor_moved_up_stays_on_its_row_when_a_reload_adds_one(tmp_path):
    project, server = make_project(tmp_path), FakeServer()
    app = WatchApp(WatchConfig(attach=URL, project=project, probe_batch=2, probe_steps=4), server.transport())

    async def main():
        async with app.run_test(size=(80, 24)) as pilot:
            await until(lambda: app.daemon.watcher.ready.is_set() and app.daemon.info["state"] == "serving")
            for n in range(1, 4):
                await press_r(app, pilot, n)
            await pilot.press("up")  # onto reload #2, to read it (or `k` its kernel checks)
            await press_r(app, pilot, 4)
            table = app.query_one("#history")
            on = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
            history = panels(app, "history")["history"]
            await pilot.press("ctrl+end")  # back to the newest row, which the next reload's row then follows
            await press_r(app, pilot, 5)
            after = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
            await pilot.press("q")
            await until(lambda: app.return_code is not None)
            return on, history, after

    on, history, after = asyncio.run(main())
    assert on == "ReloadRecord-2", on
    assert any(re.match(r"│ 2 +reload all", line) for line in history), history
    assert after == "ReloadRecord-5", after


def test_a_reload_served_with_a_failing_kernel_check_reads_check_failed_in_its_row_as_in_the_notebook():
    """Under --kernel-checks report a failing check is served (the reload is ok): its history row says so in red, the
    word `tsdev history` uses, where the H100 drill of 2026-12-07 showed "ok" beside "kernel check failed"."""
    from tsdev_runtime.control_protocol import KernelCheckResult, WorkerReport
    from tsdev.watch.records import ReloadRecord, entry_of

    failing = KernelCheckResult(op="rms_norm", shape=[4, 64], dtype="float32", max_abs=1.0, max_rel=1.0, atol=0,
                                rtol=0, ok=False, seed=1)
    served = ReloadRecord(4, "save", ["norm.py"])
    served.finish(WorkerReport(ok=True, reloaded=["tsdev_kernels.ops.norm"], kernel_checks=[failing]))
    passing = ReloadRecord(5, "save", ["norm.py"])
    passing.finish(WorkerReport(ok=True, reloaded=["tsdev_kernels.ops.norm"], kernel_checks=[
        KernelCheckResult(op="rms_norm", shape=[4, 64], dtype="float32", max_abs=0.0, max_rel=0.0, atol=0, rtol=0,
                          ok=True, seed=1)]))
    served.done = passing.done = True  # as the daemon marks a reload it has told
    cells = WatchApp.cells(served)["outcome"]
    assert (cells.plain, str(cells.style)) == ("check failed", "red")
    assert entry_of(served).outcome == "kernel check failed"
    assert WatchApp.cells(passing)["outcome"].plain == "ok"


def test_a_restart_line_says_where_its_seconds_went_and_nothing_when_the_server_gave_no_account():
    from tsdev.watch.plain import restart_parts
    from tsdev.watch.records import RestartRecord

    record = RestartRecord(1, "an engine edit", seconds=2.5, stopped=0.4,
                           startup={"python and the CLI": 0.1, "imports": 0.3, "load": 0.9, "warm-up": 1.0})
    assert restart_parts(record) == ("old server stopped in 0.40 s, then start: python and the CLI 0.10, imports 0.30, "
                                     "load 0.90, warm-up 1.00, hand-over and health checks 0.20 s")
    assert restart_parts(RestartRecord(2, "an engine edit", seconds=2.5, stopped=0.4)) == ""  # an older server
    # the moments (the daemon's and the server's) split what is beyond the server's account
    record.moments = {"restart began": 100.0, "arguments sent": 100.02, "began": 100.08, "startup line": 102.38,
                      "serving": 102.45, "healthy": 102.5}
    assert restart_parts(record).endswith("warm-up 1.00, hand-over 0.08 (the standby busy 0.06), serving set-up 0.07, "
                                          "health checks 0.05 s")
    record.moments["health asked"] = 102.47  # the request that /health answered first: sent 0.03 s before
    assert restart_parts(record).endswith("health checks 0.05 (the answer 0.03) s")
    record.moments["arguments sent"] = None  # an ordinary start: no standby
    assert restart_parts(record).endswith("hand-over and health checks 0.20 s")
