"""Startup time of `tsdev serve`: process start to a healthy server, and the server's own split.

    python3 benchmarks/startup.py                  # default model, default flags, 3 starts
    python3 benchmarks/startup.py -- --max-running 256

The split comes from the server's `startup:` line: imports (torch, triton, the runtime, the HTTP stack),
load (model, weights, KV pool, first CUDA use), warm-up, capture (decode + prefill graphs). The first start
may create the default checkpoint; the later ones reuse it (and Triton's disk cache).
"""
import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tsdev.client import wait_until_healthy


def start_once(port: int, server_args: list[str]) -> tuple[float, str]:
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    begin = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tsdev", "serve", "--port", str(port), *server_args],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc, log=lambda: Path(log.name).read_text()[-3000:],
                           interval=0.05)
        wall = time.perf_counter() - begin
    finally:
        proc.terminate()
        proc.wait(60)
    log.seek(0)
    split = next((line.strip() for line in log if line.startswith("startup:")), "(no startup line)")
    return wall, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--port", type=int, default=8319)
    parser.add_argument("server_args", nargs="*", help="extra `tsdev serve` flags (after --)")
    args = parser.parse_args()
    for i in range(args.starts):
        wall, split = start_once(args.port, args.server_args)
        print(f"start {i + 1}: process start -> healthy {wall:.2f} s; {split}", flush=True)


if __name__ == "__main__":
    main()
