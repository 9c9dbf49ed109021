"""`tsdev watch --no-tui` end to end: a real child server on the tiny model, running a temporary copy of
the project whose files the tests edit. The tests run in order against one daemon."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve_process import copy_project
from tsdev.launch.child import free_port, project_pythonpath

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)

LAYER, LAYER_LINE = "runtime/tsdev_runtime/layers/activation.py", "        return act_ops.silu_and_mul(x)\n"


class Output:
    """The daemon's stdout lines as they come; `next` waits for the next line matching a pattern."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.seen = 0
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def next(self, pattern: str, timeout: float = 90) -> re.Match:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i in range(self.seen, len(self.lines)):
                    if match := re.search(pattern, self.lines[i]):
                        self.seen = i + 1
                        return match
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise AssertionError(f"no line matching {pattern!r} in:\n" + "\n".join(self.lines))

    def since(self, start: int) -> list[str]:
        with self._cond:
            return self.lines[start:]


@pytest.fixture(scope="module")
def watch(tmp_path_factory, tiny_model_dir):
    project = copy_project(tmp_path_factory.mktemp("watch-project"))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": project_pythonpath(project)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsdev", "watch", str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024",
         "--cudagraph-capture-sizes", "1", "4", "--port", str(port), "--no-tui", "--probe-batch", "4",
         "--probe-steps", "16", "--server-log", str(project / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=project, env=env)
    out = Output(proc)
    try:
        out.next(r"watching \S*/kernels/tsdev_kernels/, \S*/runtime/tsdev_runtime/", timeout=120)
        yield proc, out, project, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()


def edit(project, path, old, new) -> None:
    file = project / path
    text = file.read_text()
    assert old in text, f"{path} no longer contains {old!r}"
    file.write_text(text.replace(old, new, 1))


def test_startup_line_names_the_server(watch):
    proc, out, project, url = watch
    line = "\n".join(out.lines)
    assert re.search(r"server up in [\d.]+ s \(tiny-qwen3\d*, on cpu, pid \d+\) at " + re.escape(url), line)
    assert re.search(r"golden completion: 24 tokens \| decode [\d.]+ ms/step at batch 4", line)


def test_layer_edit_gives_one_reload_line_with_step_timings_and_golden_verdict(watch):
    proc, out, project, url = watch
    start = len(out.lines)
    edit(project, LAYER, LAYER_LINE, LAYER_LINE.replace("(x)\n", "(x) * 1.5\n"))
    line = out.next(r"reload #\d+ (ok|FAILED).*").group(0)
    assert "(save runtime/tsdev_runtime/layers/activation.py): tsdev_runtime.layers.activation + " in line
    for step in ("drain", "flush", "reload", "warm", "recapture", "jit", "pause", "total"):
        assert re.search(rf"\b{step} \d+\.\d\d\b", line), (step, line)
    # compared with the code before, or (a loaded CPU) marked as not comparable: this figure, or the startup's
    assert re.search(r"golden: output changed at token \d+ of 24 \| decode [\d.]+ ms/step at batch 4 \(([+-]|unsteady|"
                     r"not compared)", line)
    split = re.search(r"\| save → serving (\d+\.\d\d) s = ([^|(]+)", line)
    seconds = float(split.group(1))
    assert 0 < seconds < 60  # from the file's modification time to serving resumed
    parts = dict(re.findall(r"(settle|jit|check inputs|pause|read\+plan) (-?\d+\.\d\d)", split.group(2)))
    assert {"settle", "jit", "pause", "read+plan"} <= set(parts), line
    assert abs(sum(map(float, parts.values())) - seconds) <= 0.01 + 0.005 * len(parts), line  # the parts add up
    time.sleep(1.5)
    assert len([x for x in out.since(start) if re.search(r"reload #\d+ (ok|FAILED)", x)]) == 1

    edit(project, LAYER, LAYER_LINE.replace("(x)\n", "(x) * 1.5\n"), LAYER_LINE)  # back: the startup output again
    assert "golden: same 24 tokens" in out.next(r"reload #\d+ ok").string


def test_reload_from_an_editor_hook_appears_in_the_daemon(watch):
    proc, out, project, url = watch
    env = {**os.environ, "PYTHONPATH": project_pythonpath(project, "")}
    hook = subprocess.run([sys.executable, "-m", "tsdev", "reload", "--url", url, "--modules",
                           "tsdev_kernels.ops.norm"],
                          capture_output=True, text=True, env=env, cwd=project)
    assert hook.returncode == 0, hook.stdout + hook.stderr
    assert "reloaded tsdev_kernels.ops.norm" in hook.stdout
    line = out.next(r"reload #\d+ ok \(another client: tsdev_kernels\.ops\.norm\)").string
    assert "golden: same 24 tokens" in line


def test_edit_outside_the_reloadable_packages_restarts_the_server(watch):
    proc, out, project, url = watch
    edit(project, "runtime/tsdev_runtime/engine/scheduler.py", '"""', '"""Edited by the watch test. ')
    line = out.next(r"restart #1: .*").string
    assert "tsdev_runtime.engine.scheduler changed outside the reloadable packages → restarted in" in line
    assert "golden: same 24 tokens" in line
    assert httpx.get(url + "/health").status_code == 200
    # where its seconds went: the old server's stop, then the new server's own account and the daemon's rest
    where = re.search(r"restarted in (\d+\.\d) s.*\| old server stopped in \d+\.\d\d s, then start: ([^|]+) s \|", line)
    assert where, line
    listed = re.sub(r" \([^)]*\)", "", where.group(2))  # (a part's own share of itself: not added)
    parts = {name.strip(): float(seconds) for name, seconds in re.findall(r"([A-Za-z -]+) (\d+\.\d\d)", listed)}
    assert {"python and the CLI", "imports", "load", "warm-up", "capture", "other"} <= set(parts), line
    if "by the standby" in line:  # the rest split by the moments the daemon and the server took
        assert {"hand-over", "serving set-up", "health checks"} <= set(parts), line
        assert re.search(r"hand-over \d+\.\d\d \(the standby busy \d+\.\d\d\)", line), line
    assert abs(sum(parts.values()) - float(where.group(1))) <= 0.06 + 0.005 * len(parts), line  # they add up


def test_killed_server_is_restarted(watch):
    proc, out, project, url = watch
    old_pid = int(re.findall(r"pid (\d+)", "\n".join(out.lines))[-1])
    os.kill(old_pid, signal.SIGKILL)
    line = out.next(r"restart #2: .*").string
    assert "the server exited (killed by SIGKILL) → restarted in" in line
    new_pid = int(re.search(r"pid (\d+)", line).group(1))
    assert new_pid != old_pid and httpx.get(url + "/health").status_code == 200


def test_stopping_the_daemon_stops_its_server(watch):
    proc, out, project, url = watch
    pid = int(re.findall(r"pid (\d+)", "\n".join(out.lines))[-1])
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
