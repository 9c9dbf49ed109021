"""Save -> serving the new code through `tsdev watch`, the way a user gets it, edit after edit: each cycle makes a
never-seen edit of a Triton helper that several kernels inline (`silu_and_mul_values` in
kernels/tsdev_kernels/ops/activation.py, `rms_norm_values` in kernels/tsdev_kernels/ops/norm.py, in turn: their output
times a constant drawn fresh for this run and cycle, so no binary of it is in Triton's cache) and then reverts it (the
original's binaries are cached: a repeated edit). Each reload line's "save → serving" (from the file's modification time
to the reload's reply, measured by the daemon) is reported for fresh and repeated edits apart. Then `--restarts` edits
of an engine file (a comment added to runtime/tsdev_runtime/engine/scheduler.py), each answered with a restart: "save →
serving again" from the restart line, each save --restart-gap seconds after the server serves again (the standby that
takes the next start imports torch, Triton and the HTTP stack first, ~4 s on the H200 host: a save sooner than that
waits for it); the servers' startup lines follow (where each restart's seconds went).

The watch builds each saved text's kernels at its first sight, before the settle (docs/watch.md); with
TSDEV_WATCH_BUILD_ON_SIGHT=0 in the environment only the reload builds them (an A/B of that).

With `--ahead MS`, every other pair of cycles sends the fresh edit's text as an editor's unsaved buffer first
(POST /v1/rl/engine/compile_ahead, what `tsdev reload --ahead` does) and saves it MS milliseconds later: the server
builds its kernels while the old code serves, and the save's jit step finds them built. Fresh edits with and without
the buffer sent ahead are reported apart (`fresh_ahead`, `fresh`), on the same server, alternately.

    python3 benchmarks/save_to_serving.py                    # CUDA, the default model
    python3 benchmarks/save_to_serving.py --cycles 8 --restarts 0 --ahead 1000   # the buffer sent 1 s before the save
    python3 benchmarks/save_to_serving.py --cycles 5 -- --settle-ms 200
    python3 benchmarks/save_to_serving.py --device cpu --cycles 1   # a smoke run

Runs a copy of the project in a temporary folder (the watch's own server is its child). Prints every reload
line, then the medians and ranges; the last line is JSON (`fresh` and `repeated`; `median` is the fresh one).
"""
import argparse
import json
import os
import queue
import random
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

from tsdev.launch.child import copy_project, free_port, project_pythonpath

RELOAD = re.compile(r"reload #(\d+) (ok|FAILED).*")
SECONDS = re.compile(r"save → serving (\d+\.\d+) s")
RESTART = re.compile(r"restart #\d+: .*save → serving again (\d+\.\d+) s|restart FAILED.*")
# outside the reloadable packages: an edit restarts the server
ENGINE_FILE = "runtime/tsdev_runtime/engine/scheduler.py"
HELPERS = [("kernels/tsdev_kernels/ops/activation.py", "    return act * up\n", "    return act * up * {c}\n"),
           ("kernels/tsdev_kernels/ops/norm.py", "    return w * (x * rstd).to(dt).to(tl.float32)\n",
            "    return w * (x * rstd).to(dt).to(tl.float32) * {c}\n")]


def fresh_constant(rng: random.Random) -> str:
    """A float literal near 1 that no earlier run used (Triton's disk cache is keyed by the source)."""
    return f"{1 + rng.uniform(1e-4, 1e-3):.12f}"


def send_ahead(url: str, path: Path, text: str) -> None:
    """POST the text as an editor's unsaved buffer of `path`, in a thread (its reply comes while the save is made);
    the reply is printed when it comes."""
    from tsdev.client import compile_ahead
    from tsdev.outcome import ahead_text

    def send() -> None:
        sent = time.monotonic()
        try:
            reply = compile_ahead(url, str(path), text)
        except Exception as exc:  # the benchmark goes on: that save is then a fresh one like the others
            print(f"compile ahead failed: {type(exc).__name__}: {exc}", flush=True)
            return
        print(f"buffer sent ahead, answered after {time.monotonic() - sent:.2f} s: {ahead_text(reply)}", flush=True)

    threading.Thread(target=send, daemon=True).start()


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "reloads": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--restarts", type=int, default=3,
                        help="then this many edits of an engine file (a comment), each answered with a restart")
    parser.add_argument("--restart-gap", type=float, default=6.0,
                        help="seconds between serving again and the next engine-file save (a user reads the output)")
    parser.add_argument("--cycles", type=int, default=10,
                        help="fresh-edit/revert cycles (two reloads each: a fresh edit, then a repeated one)")
    parser.add_argument("--device", default=None, help="the server's --device (default: its own choice)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the server, then per reload")
    parser.add_argument("--ahead", type=float, default=None, metavar="MS",
                        help="cycles 2-3, 6-7, ...: send the fresh edit's text as an unsaved buffer to compile ahead, "
                             "MS milliseconds before saving it")
    parser.add_argument("watch_args", nargs="*", help="extra `tsdev watch` flags (after --)")
    args = parser.parse_args()

    project = copy_project(Path(tempfile.mkdtemp(prefix="tsdev-save-")))
    port = free_port()
    command = [sys.executable, "-m", "tsdev", "watch", "--no-tui", "--port", str(port),
               "--server-log", str(project / "server.log"), *args.watch_args]
    if args.device:
        command += ["--device", args.device]
    env = {**os.environ, "PYTHONPATH": project_pythonpath(project)}
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
        originals = {file: (project / file).read_text() for file, _, _ in HELPERS}
        for file, old, _ in HELPERS:
            assert old in originals[file], f"{file} no longer contains {old!r}: update the benchmark's edit"
        rng = random.Random(time.time_ns())
        seconds = {"fresh": [], "repeated": [], **({"fresh_ahead": []} if args.ahead is not None else {})}
        for cycle in range(args.cycles):
            file, old, new = HELPERS[cycle % len(HELPERS)]
            edited = originals[file].replace(old, new.format(c=fresh_constant(rng)))
            ahead = args.ahead is not None and (cycle // 2) % 2 == 1  # both files with and without, alternately
            for kind, text in (("fresh_ahead" if ahead else "fresh", edited), ("repeated", originals[file])):
                time.sleep(1.0)  # the previous reload's checks are done and the server is steady again
                if kind == "fresh_ahead":
                    send_ahead(f"http://127.0.0.1:{port}", project / file, text)
                    time.sleep(args.ahead / 1000)
                (project / file).write_text(text)
                line = wait_for(RELOAD, args.timeout)
                if line.group(2) != "ok":
                    sys.exit(f"the reload failed: {line.group(0)}")
                seconds[kind].append(float(SECONDS.search(line.group(0)).group(1)))
        for kind, target in (("fresh", "0.6, each <= 1.0"), ("fresh_ahead", "0.6, each <= 1.0"), ("repeated", "0.25")):
            values = seconds.get(kind)
            if not values:
                continue
            print(f"save → serving, {kind} edits, over {len(values)} reloads: "
                  f"median {statistics.median(values):.3f} s, "
                  f"{min(values):.2f}–{max(values):.2f} s (target <= {target})")
        engine_file = project / ENGINE_FILE
        engine_source = engine_file.read_text()
        for n in range(args.restarts):
            time.sleep(args.restart_gap)
            engine_file.write_text(engine_source + f"# edit {fresh_constant(rng)}\n")
            line = wait_for(RESTART, args.timeout)
            if line.group(1) is None:
                sys.exit(f"the restart failed: {line.group(0)}")
            seconds.setdefault("restart", []).append(float(line.group(1)))
        result = {kind: summary(values) for kind, values in seconds.items() if values}
        if "restart" in result:
            values = seconds["restart"]
            print(f"save of an engine file → serving again over {len(values)} restarts: median "
                  f"{statistics.median(values):.2f} s, {min(values):.2f}–{max(values):.2f} s (target <= 2.5), "
                  f"each save {args.restart_gap:g} s after serving again")
            log = (project / "server.log").read_text(errors="replace")
            print("the servers' startup lines (the first start, then each restart):")
            print("\n".join(line for line in log.splitlines() if line.startswith("startup:")))
            print("the weights: " + "; ".join(  # the old server's offer, the new one's source (weights/handover.py)
                line.strip() for line in log.splitlines()
                if line.startswith("weights for the restart:") or "the weights handed over" in line
                or "the weights read (not handed over" in line))
        print(json.dumps({"summary": {**result.get("fresh", {}), **result}}))  # (--cycles 0: restarts alone)
    finally:
        daemon.send_signal(signal.SIGINT)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(project, ignore_errors=True)


if __name__ == "__main__":
    main()
