"""Startup time of `tsdev serve`: process start to its first line and to a healthy server, and the server's own split.

    python3 benchmarks/startup.py                  # default model, default flags, 3 starts
    python3 benchmarks/startup.py -- --max-running 256

The split comes from the server's `startup:` line: the process's age, split into python and the CLI (the
interpreter, the CLI's imports and checks), imports (the runtime, the HTTP stack), checkpoint (the default model's,
written on first use), load (model, weights, KV pool, first CUDA use), warm-up, capture (decode + prefill graphs),
the Triton compiles of the warm-up and capture, and what none of them holds (other). The first start
may create the default checkpoint; the later ones reuse it (and Triton's disk cache).
"""
import argparse
import tempfile
import time
from pathlib import Path

from tsdev.launch.child import ServerProcess


def start_once(port: int, server_args: list[str]) -> tuple[float, float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(server_args, port, log_path=Path(tmp) / "serve.log")
        begin = time.perf_counter()
        server.start()
        try:
            while not server.output().strip() and server.proc.poll() is None:
                time.sleep(0.005)
            first_line = time.perf_counter() - begin
            server.wait_healthy()
            wall = time.perf_counter() - begin
        finally:
            server.stop(60)
        lines = server.output().splitlines()
    split = next((line.strip() for line in lines if line.startswith("startup:")), "(no startup line)")
    return first_line, wall, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--port", type=int, default=8319)
    parser.add_argument("server_args", nargs="*", help="extra `tsdev serve` flags (after --)")
    args = parser.parse_args()
    for i in range(args.starts):
        first_line, wall, split = start_once(args.port, args.server_args)
        print(f"start {i + 1}: process start -> first line {first_line:.2f} s, healthy {wall:.2f} s; {split}",
              flush=True)


if __name__ == "__main__":
    main()
