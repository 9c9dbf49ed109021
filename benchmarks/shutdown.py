"""Ctrl-C to exit of `tsdev serve`, with its output in a file, a pipe and a terminal (a pseudo-terminal).

    python3 benchmarks/shutdown.py                      # the default model on this machine's default device
    python3 benchmarks/shutdown.py --runs 5 --device cpu
    python3 benchmarks/shutdown.py --device cpu --no-api-process   # any other flag goes to `tsdev serve`

Each run starts a server, sends one completion (so the engine has stepped), then SIGINT, and times the signal
to the process's exit. Target (README): under a second whatever stdout is.
"""
import argparse
import os
import pty
import signal
import statistics
import subprocess
import sys
import time

import httpx


def one(where: str, args: list[str], port: int) -> float:
    command = [sys.executable, "-m", "tsdev", "serve", *args, "--port", str(port)]
    if where == "terminal":
        leader, follower = pty.openpty()
        out = follower
    elif where == "file":
        out = open(f"/tmp/tsdev-shutdown-{os.getpid()}.log", "w")
    else:
        out = subprocess.PIPE
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the server did not start ({where})")
        if where == "pipe":
            os.set_blocking(proc.stdout.fileno(), False)
            proc.stdout.read()  # keep the pipe drained
        if where == "terminal":
            os.set_blocking(leader, False)
            try:
                os.read(leader, 1 << 16)
            except BlockingIOError:
                pass
        time.sleep(0.1)
    httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=60)
    start = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    proc.wait(30)
    seconds = time.perf_counter() - start
    if where == "terminal":
        os.close(leader)
        os.close(follower)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--port", type=int, default=8311)
    args, passed = parser.parse_known_args()
    serve_args = (["--device", args.device] if args.device else []) + passed
    for where in ("file", "pipe", "terminal"):
        times = [one(where, serve_args, args.port) for _ in range(args.runs)]
        print(f"stdout to a {where:<8}: SIGINT -> exit median {statistics.median(times):.2f} s "
              f"({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
