"""Save -> serving the new code through `tsdev watch`, the way a user gets it: edit the SiLU-and-mul Triton kernel
(negate its output) and revert it, `--cycles` times, and read each reload line's "save → serving" (from the
file's modification time to the reload's reply, measured by the daemon).

    python3 benchmarks/save_to_serving.py                    # CUDA, the default model
    python3 benchmarks/save_to_serving.py --cycles 5 -- --settle-ms 200
    python3 benchmarks/save_to_serving.py --device cpu --cycles 1   # a smoke run

Runs a copy of the project in a temporary folder (the watch's own server is its child). Prints every reload
line, then the median and the range; the last line is JSON.
"""
import argparse
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from reload_vs_restart import FILE, NEW, OLD  # the same edit of the same kernel
from tsdev.server_process import copy_project, free_port

RELOAD = re.compile(r"reload #(\d+) (ok|FAILED).*")
SECONDS = re.compile(r"save → serving (\d+\.\d+) s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=5, help="edit/revert cycles (two reloads each)")
    parser.add_argument("--device", default=None, help="the server's --device (default: its own choice)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the server, then per reload")
    parser.add_argument("watch_args", nargs="*", help="extra `tsdev watch` flags (after --)")
    args = parser.parse_args()

    project = copy_project(Path(tempfile.mkdtemp(prefix="tsdev-save-")))
    command = [sys.executable, "-m", "tsdev", "watch", "--no-tui", "--port", str(free_port()),
               "--server-log", str(project / "server.log"), *args.watch_args]
    if args.device:
        command += ["--device", args.device]
    env = {**os.environ, "PYTHONPATH": f"{project}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    daemon = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in daemon.stdout:
            lines.put(line)
        lines.put(None)  # the daemon's output ended

    threading.Thread(target=pump, daemon=True).start()

    def wait_for(pattern: re.Pattern, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                sys.exit(f"tsdev watch exited (status {daemon.wait()}) before '{pattern.pattern}'")
            print(line, end="", flush=True)
            if match := pattern.search(line):
                return match
        sys.exit(f"no line matching '{pattern.pattern}' within {timeout:.0f} s")

    try:
        wait_for(re.compile(r"watching"), args.timeout)
        source = project / FILE
        original = source.read_text()
        assert OLD in original, f"{FILE} no longer contains {OLD!r}: update the benchmark's edit"
        seconds = []
        for _ in range(args.cycles):
            for text in (original.replace(OLD, NEW), original):
                time.sleep(1.0)  # the previous reload's checks are done and the server is steady again
                source.write_text(text)
                line = wait_for(RELOAD, args.timeout)
                if line.group(2) != "ok":
                    sys.exit(f"the reload failed: {line.group(0)}")
                seconds.append(float(SECONDS.search(line.group(0)).group(1)))
        print(f"save → serving over {len(seconds)} reloads: median {statistics.median(seconds):.3f} s, "
              f"{min(seconds):.2f}–{max(seconds):.2f} s (target <= 0.4)")
        print(json.dumps({"summary": {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds),
                                      "reloads": len(seconds)}}))
    finally:
        daemon.send_signal(signal.SIGINT)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(project, ignore_errors=True)


if __name__ == "__main__":
    main()
