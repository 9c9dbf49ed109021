"""Issue 32's numbers: what the kernel checks add to a reload's pause, and whether their times agree with
benchmarks/kernels_bench.py's for the same kernel and shape.

    python3 benchmarks/kernel_checks.py                # CUDA, the default model
    python3 benchmarks/kernel_checks.py --cycles 4

1. One server of the default model given --cycles never-seen edits of `silu_and_mul_values` (its output times a
   fresh constant near 1, so the checks pass) and their reverts, one reload of each pair with the checks off and the
   other with `report`, the edit's mode alternating (after one such pair not counted): the median pause of each mode,
   and of the checks (the target: the pause grows by at most 10 ms).
2. The times the `report` server gave in its reload replies (the ops the edit reached, the median over the reloads
   per shape) against kernels_bench's `graph_ms` in this process once the server stopped, on the same number of
   distinct inputs; then each declared op's `tsdev_kernels.checks.time_call` in this process against `graph_ms`, at the
   shapes the default model serves (the target for both: within 10 %).
"""
import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernels_bench import graph_ms
from tsdev_kernels import checks
from tsdev_kernels.ops import activation, attention, linear, norm, rope, sampling  # noqa: F401  (their CHECKS)
from tsdev_runtime.control_protocol import RELOAD_ROUTE, ReloadReply
from tsdev.outcome import kernel_checks_text
from tsdev.launch.child import ServerProcess, copy_project

HELPER, FILE = "    return act * up\n", "kernels/tsdev_kernels/ops/activation.py"
SERVED = checks.Serving(tokens=(1, 8, 64, 256), hidden=1024, intermediate=3072, dtype=torch.bfloat16,
                        fp8=True)  # Qwen3-0.6B's shapes, the fp8 projections' too


def pauses(cycles: int, rng: random.Random) -> tuple[dict[str, list[float]], list[float], dict[tuple, list[float]]]:
    """One server of the default model, given `cycles` never-seen edits and their reverts, each pair's reloads with
    the checks off and on (`report`), the edit's mode alternating: (mode -> pauses, check steps, (op, shape) -> the µs
    after each checked edit); prints each reload and the median of each timed step per mode."""
    with tempfile.TemporaryDirectory() as tmp:
        project = copy_project(Path(tmp) / "project")
        server = ServerProcess(["--device", "cuda", "--kernel-check", "report"], allow_reload_forward=True,
                               cwd=project, pythonpath=project, log_path=Path(tmp) / "serve.log")
        file = project / FILE
        original = file.read_text()
        paused, checked, times, steps = {"off": [], "report": []}, [], {}, {"off": {}, "report": {}}
        with server.running(timeout=600):
            for cycle in range(cycles):
                constant = f"{1 + rng.uniform(1e-4, 1e-3):.12f}"
                modes = ("off", "report") if cycle % 2 else ("report", "off")  # each mode edits half the time
                for mode, text in zip(modes, (original.replace(HELPER, f"    return act * up * {constant}\n"),
                                              original)):
                    file.write_text(text)
                    time.sleep(0.5)
                    reply = httpx.post(server.url + RELOAD_ROUTE, json={"id": f"{mode}-{time.monotonic_ns()}",
                                                                         "kernel_check": mode}, timeout=600)
                    worker = ReloadReply.model_validate_json(reply.content).workers[0]
                    assert worker.ok, worker.error
                    if cycle == 0:  # the first reload of each mode loads what later ones reuse
                        continue
                    paused[mode].append(worker.timings["pause"])
                    for step, seconds in worker.timings.items():
                        steps[mode].setdefault(step, []).append(seconds)
                    for c in worker.kernel_checks:
                        if c.us_after and c.timed == "graph":
                            times.setdefault((c.op, tuple(c.shape)), []).append(c.us_after)
                    if worker.kernel_checks:
                        checked.append(worker.timings["kernel_check"])
                        print("  " + " | ".join(kernel_checks_text(worker)))
                    print(f"  {mode} reload: pause {worker.timings['pause'] * 1e3:.1f} ms, check "
                          f"{worker.timings.get('kernel_check', 0) * 1e3:.1f} ms, {len(worker.kernel_checks)} "
                          f"check(s), all ok: {all(c.ok for c in worker.kernel_checks)}", flush=True)
        for mode, timed in steps.items():
            print(f"  {mode}: median ms per step: " + ", ".join(f"{step} {statistics.median(s) * 1e3:.1f}"
                                                             for step, s in timed.items()), flush=True)
        return paused, checked, times


def bench_us(check: checks.KernelCheck, shape: tuple[int, ...]) -> float:
    """kernels_bench's graph time of the op at `shape`: checks.TIMED_CALLS calls over the inputs a check times."""
    inputs = checks.timing_inputs(check, shape, SERVED.dtype, "cuda")
    calls = [lambda args=inputs[i % len(inputs)]: check.kernel(*args) for i in range(checks.TIMED_CALLS)]
    return graph_ms(calls, iters=20) * 1e3


def table(title: str, rows: list[tuple[str, tuple, float, float]]) -> float:
    print(f"{title}\n{'op':<20} {'shape':>22} {'check us':>9} {'bench us':>9} {'ratio':>6}")
    for op, shape, mine, bench in rows:
        print(f"{op:<20} {'x'.join(map(str, shape)):>22} {mine:9.2f} {bench:9.2f} {mine / bench:6.2f}")
    return max(abs(mine / bench - 1) for _, _, mine, bench in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=10, help="fresh edits (each reverted) counted")
    args = parser.parse_args()
    rng = random.Random(time.time_ns())
    paused, steps, served = pauses(args.cycles + 1, rng)
    off, on = statistics.median(paused["off"]), statistics.median(paused["report"])
    print(f"pause median: off {off * 1e3:.1f} ms, report {on * 1e3:.1f} ms ({(on - off) * 1e3:+.1f} ms, target <= 10); "
          f"the checks (after the pause) median {statistics.median(steps) * 1e3:.1f} ms")
    by_op = {c.op: c for c in checks.declared()}
    worst = table("the server's times (median over its reloads) against kernels_bench's graph time:",
                  [(op, shape, statistics.median(us), bench_us(by_op[op], shape))
                   for (op, shape), us in sorted(served.items())])
    rows = []
    for check in checks.declared():
        for shape in check.shapes(SERVED):
            mine, how, _ = checks.time_call(check, tuple(shape), SERVED.dtype, "cuda")
            rows.append((check.op + ("" if how == "graph" else f" ({how})"), tuple(shape), mine,
                         bench_us(check, tuple(shape))))
    worst = max(worst, table("time_call in this process against kernels_bench's graph time:", rows))
    print(f"largest disagreement with kernels_bench's timing: {worst * 100:.1f} % (target <= 10 %)")

if __name__ == "__main__":
    main()
