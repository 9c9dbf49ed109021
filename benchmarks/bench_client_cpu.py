"""CPU per request of `tsdev bench`'s client against locust's, on the same workload and server, in one run.

    python3 -m venv /tmp/locust-venv && /tmp/locust-venv/bin/pip install locust
    tsdev serve --device cpu --port 8124 &
    python3 benchmarks/bench_client_cpu.py --url http://127.0.0.1:8124 --locust /tmp/locust-venv/bin/locust

Both stream REQUESTS completions (16 prompt tokens, 32 generated), CONCURRENCY at a time, parsing every event;
each reports the CPU its own process spent while requests ran (tsdev: `client_cpu_ms_per_request`). Target
(issue 28): tsdev's CPU per request no more than locust's.
"""
import argparse
import asyncio
import os
import subprocess
from pathlib import Path

from tsdev.bench import BenchConfig, run_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--locust", default="locust", help="a locust executable (from a venv of its own)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    locustfile = Path(__file__).with_name("locust_streaming.py")
    for round_ in range(args.rounds):
        config = BenchConfig(url=args.url, num_prompts=args.requests, input_len=16, output_len=32,
                             max_concurrency=args.concurrency)
        metrics = asyncio.run(run_bench(config))["metrics"]
        print(f"round {round_ + 1}: tsdev bench: {args.requests} requests, {metrics['output_tokens']} tokens, "
              f"client CPU {metrics['client_cpu_s']:.2f} s = {metrics['client_cpu_ms_per_request']:.2f} ms per request",
              flush=True)
        env = {**os.environ, "REQUESTS": str(args.requests)}
        out = subprocess.run([args.locust, "-f", str(locustfile), "--headless", "-u", str(args.concurrency), "-r",
                              str(args.concurrency), "-H", args.url, "--only-summary"], env=env, capture_output=True,
                             text=True, timeout=1800)
        line = next((l for l in (out.stdout + out.stderr).splitlines() if l.startswith("locust:")), out.stderr[-500:])
        print(f"round {round_ + 1}: {line}", flush=True)


if __name__ == "__main__":
    main()
