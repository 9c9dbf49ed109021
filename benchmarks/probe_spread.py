"""How much the daemon's decode probe moves on a server where nothing changes, and what moves with it.

Starts `tsdev serve` (the default model), then runs the daemon's probe (`tsdev.watch.checks.decode_ms`, one round
each: `--batch` streams of `--steps` tokens) `--rounds` times, a `--gap` of idle between rounds as between reloads.
For each round it prints the probe's ms/step beside what the server measured over the same steps (its step time
and the host's share of it, from /metrics' tsdev_step_seconds and tsdev_step_host_seconds) and the GPU's SM clock
and power during the round (nvidia-smi, sampled every 50 ms, where there is one). The summary gives each column's
spread, and how far the fastest of 1, 2 or 3 rounds in a row moved from one group of rounds to the next (what a
reload that changed nothing would show) and how many groups the daemon would call steady (two of their rounds
within 3 %).

    python3 benchmarks/probe_spread.py                     # CUDA, the default model, 24 rounds
    python3 benchmarks/probe_spread.py --device cpu --rounds 4 --steps 16
"""
import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tsdev.launch.child import ServerProcess
from tsdev.watch.checks import decode_ms, steady_ms


class ClockSampler:
    """nvidia-smi's SM clock (MHz) and power (W), timestamped, read in a thread."""

    def __init__(self):
        self.samples: list[tuple[float, float, float]] = []
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
                stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                clock, power = (float(v) for v in line.split(",")[:2])
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), clock, power))

    def between(self, start: float, end: float) -> tuple[float, float] | None:
        inside = [(c, p) for t, c, p in self.samples if start <= t <= end]
        if not inside:
            return None
        return statistics.mean(c for c, _ in inside), statistics.mean(p for _, p in inside)

    def stop(self):
        if self.proc:
            self.proc.terminate()


async def step_totals(client: httpx.AsyncClient, url: str) -> tuple[float, float, float]:
    """(steps, seconds, host seconds) the server's engine has counted so far."""
    text = (await client.get(url + "/metrics")).text
    totals = {"tsdev_step_seconds_count": 0.0, "tsdev_step_seconds_sum": 0.0, "tsdev_step_host_seconds_sum": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return (totals["tsdev_step_seconds_count"], totals["tsdev_step_seconds_sum"],
            totals["tsdev_step_host_seconds_sum"])


def spread(values: list[float]) -> str:
    mid = statistics.median(values)
    return f"median {mid:.3f}, {min(values):.3f}-{max(values):.3f} ({100 * (max(values) - min(values)) / mid:.1f} %)"


async def probe_rounds(url: str, args, clocks: ClockSampler) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(timeout=120) as client:
        await decode_ms(client, url, 256, args.batch, args.steps,
                        rounds=(1, 1))  # the first round after start: left out
        for i in range(args.rounds):
            await asyncio.sleep(args.gap)
            before, start = await step_totals(client, url), time.perf_counter()
            [probe] = await decode_ms(client, url, 256, args.batch, args.steps, rounds=(1, 1))
            end, after = time.perf_counter(), await step_totals(client, url)
            steps, seconds, host = (a - b for a, b in zip(after, before))
            row = {"probe": probe, "step": 1e3 * seconds / steps, "host": 1e3 * host / steps,
                   "gpu": clocks.between(start, end)}
            rows.append(row)
            gpu = f"SM {row['gpu'][0]:.0f} MHz, {row['gpu'][1]:.0f} W" if row["gpu"] else "no nvidia-smi"
            print(f"round {i + 1}: probe {probe:.3f} ms/step | server step {row['step']:.3f} ms, host "
                  f"{row['host']:.3f} ms ({steps:.0f} steps) | {gpu}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--gap", type=float, default=1.0, help="idle seconds before each round")
    parser.add_argument("--port", type=int, default=8327)
    parser.add_argument("server_args", nargs="*", help="extra `tsdev serve` flags (after --)")
    args = parser.parse_args()
    clocks = ClockSampler()
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(["--device", args.device, *args.server_args], args.port,
                               log_path=Path(tmp) / "serve.log")
        server.start()
        try:
            server.wait_healthy()
            rows = asyncio.run(probe_rounds(f"http://127.0.0.1:{args.port}", args, clocks))
        finally:
            server.stop(60)
            clocks.stop()
    for name in ("probe", "step", "host"):
        print(f"{name:5} ms/step over {len(rows)} rounds: {spread([r[name] for r in rows])}")
    for size in (1, 2, 3):
        groups = [[r["probe"] for r in rows[i:i + size]] for i in range(0, len(rows) - size + 1, size)]
        figures = [min(group) for group in groups]
        moves = [100 * (b - a) / a for a, b in zip(figures, figures[1:])]
        steady = sum(steady_ms(group) is not None for group in groups)
        if moves:
            print(f"fastest of {size} round(s) in a row, change from one group to the next: {min(moves):+.1f} to "
                  f"{max(moves):+.1f} %, {sum(abs(m) <= 5 for m in moves)} of {len(moves)} within 5 %"
                  + (f"; {steady} of {len(groups)} groups steady" if size > 1 else ""))
    if len(rows) > 2:
        probe, step, host = ([r[k] for r in rows] for k in ("probe", "step", "host"))
        print(f"correlation over rounds: probe~server step {statistics.correlation(probe, step):+.2f}, "
              f"probe~host {statistics.correlation(probe, host):+.2f}")


if __name__ == "__main__":
    main()
