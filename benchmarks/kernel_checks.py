"""Issue 32's numbers: what the kernel checks add to a reload's pause, and whether their times agree with
benchmarks/kernels_bench.py's for the same kernel and shape.

    python3 benchmarks/kernel_checks.py                # CUDA, the default model
    python3 benchmarks/kernel_checks.py --cycles 3

1. Two servers of the default model (`--kernel-check off`, then `report`), each given --cycles never-seen edits of
   `silu_and_mul_values` (its output times a fresh constant near 1, so the checks pass) and their reverts: the median
   pause of each, and of the check step (the target: the pause grows by at most 10 ms).
2. In this process: each op's check time (kernels/checks.py `time_call`: 10 calls back to back on one input, the
   median of 5 runs) against kernels_bench's eager time (`eager_ms`: the same calls on 4 distinct inputs) at the
   shapes the default model serves (the target: within 10 %).
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
from benchmarks.kernels_bench import eager_ms
from kernels import checks
from kernels.ops import activation, linear, norm, rope  # noqa: F401  (their CHECKS)
from runtime.control_protocol import RELOAD_ROUTE, ReloadReply
from tsdev.server_process import ServerProcess, copy_project

HELPER, FILE = "    return act * up\n", "kernels/ops/activation.py"
SERVED = checks.Serving(tokens=(1, 8, 64, 256), hidden=1024, intermediate=3072, dtype=torch.bfloat16)  # Qwen3-0.6B


def pauses(mode: str, cycles: int, rng: random.Random) -> tuple[list[float], list[float]]:
    """(pauses, check steps) of 2 x cycles reloads of a server with --kernel-check mode."""
    with tempfile.TemporaryDirectory() as tmp:
        project = copy_project(Path(tmp) / "project")
        server = ServerProcess(["--device", "cuda", "--kernel-check", mode], allow_reload_forward=True, cwd=project,
                               pythonpath=project, log_path=Path(tmp) / "serve.log")
        file = project / FILE
        original = file.read_text()
        paused, checked = [], []
        with server.running(timeout=600):
            for cycle in range(cycles):
                constant = f"{1 + rng.uniform(1e-4, 1e-3):.12f}"
                for text in (original.replace(HELPER, f"    return act * up * {constant}\n"), original):
                    file.write_text(text)
                    time.sleep(0.5)
                    reply = httpx.post(server.url + RELOAD_ROUTE, json={"id": f"{mode}-{time.monotonic_ns()}"},
                                       timeout=600)
                    worker = ReloadReply.model_validate_json(reply.content).workers[0]
                    assert worker.ok, worker.error
                    paused.append(worker.timings["pause"])
                    checked.append(worker.timings.get("kernel_check", 0.0))
                    if worker.kernel_checks:
                        print(f"  {mode} reload: pause {worker.timings['pause'] * 1e3:.1f} ms, check step "
                              f"{worker.timings['kernel_check'] * 1e3:.1f} ms, {len(worker.kernel_checks)} check(s), "
                              f"all ok: {all(c.ok for c in worker.kernel_checks)}", flush=True)
        return paused, checked


def agreement() -> list[tuple[str, tuple, float, float]]:
    """(op, shape, check µs, kernels_bench-style µs) for each op at the served shapes."""
    rows = []
    for check in checks.declared():
        for shape in check.shapes(SERVED):
            generator = torch.Generator(device="cuda").manual_seed(1)
            inputs = [check.inputs(tuple(shape), SERVED.dtype, "cuda", generator) for _ in range(4)]
            bench = eager_ms([lambda args=args: check.kernel(*args) for args in inputs], iters=20) * 1e3
            rows.append((check.op, tuple(shape), checks.time_call(check, shape, SERVED.dtype, "cuda"), bench))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=5, help="fresh edits (each reverted) per server")
    args = parser.parse_args()
    rng = random.Random(time.time_ns())
    off, _ = pauses("off", args.cycles, rng)
    on, steps = pauses("report", args.cycles, rng)
    grown = (statistics.median(on) - statistics.median(off)) * 1e3
    print(f"pause median: off {statistics.median(off) * 1e3:.1f} ms, report {statistics.median(on) * 1e3:.1f} ms "
          f"(+{grown:.1f} ms, target <= 10); check step median {statistics.median(steps) * 1e3:.1f} ms")
    print(f"{'op':<20} {'shape':>22} {'check us':>9} {'bench us':>9} {'ratio':>6}")
    worst = 0.0
    for op, shape, mine, bench in agreement():
        worst = max(worst, abs(mine / bench - 1))
        print(f"{op:<20} {'x'.join(map(str, shape)):>22} {mine:9.2f} {bench:9.2f} {mine / bench:6.2f}")
    print(f"largest disagreement with kernels_bench's timing: {worst * 100:.1f} % (target <= 10 %)")


if __name__ == "__main__":
    main()
