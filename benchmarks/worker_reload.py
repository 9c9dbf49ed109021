"""What a compile worker spends on an edit before its compile: bringing its copy of the modules to the server's
sources (its `Reloader`), for a never-seen edit of `silu_and_mul_values` (kernels/tsdev_kernels/ops/activation.py).
Each way in a process of its own running the worker's code (tsdev/hotreload/compile_worker.py): holding the kernel
modules only (`pool.imported`, what workers hold) and holding every module the server imported (the models and
layers too, as workers did before 46e97ea). Each edit is new (a fresh constant), so Triton compiles it: "other" is
the job's time minus its compile. No GPU: the kernels compile for sm_90.

    python3 benchmarks/worker_reload.py --edits 4
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from tsdev.hotreload import compile_worker, default_packages, manifest
from tsdev.hotreload.pool import imported
from tsdev.hotreload.snapshot import under

HELPER = b"    return act * up\n"
SHIPPED = Path(__file__).resolve().parent.parent / "tsdev" / "warmup"


def measure(modules: list[str], edits: int) -> list[float]:
    """In this process, as a worker holding `modules` (and what they import): seconds before each edit's compile."""
    from triton.backends.compiler import GPUTarget

    packages, target = default_packages(), GPUTarget("cuda", 90, 32)
    compile_worker.init(tuple(packages), (target.backend, target.arch, target.warp_size), os.getppid(), tuple(modules))
    held = [name for name in sys.modules if under(name, packages) and getattr(sys.modules[name], "__file__", None)]
    sources = {name: Path(sys.modules[name].__file__).read_bytes() for name in held}
    entries = [e for path in SHIPPED.glob("sm90-*.json") for e in manifest.read(path)
               if e["name"] == "_silu_and_mul_kernel"][:1]
    [job] = manifest.jobs(entries, target)
    name = "tsdev_kernels.ops.activation"
    assert HELPER in sources[name], "the edited line is gone from activation.py: update HELPER"
    salt, other = random.random(), []
    for i in range(edits):
        edited = sources[name].replace(HELPER, f"    return act * up * {1 + salt + i / 997}\n".encode())
        start = time.perf_counter()
        done = compile_worker.compile_job({**sources, name: edited}, job)
        assert done.error is None, done.error
        other.append(time.perf_counter() - start - done.seconds)
    return other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edits", type=int, default=4)
    parser.add_argument("--modules", nargs="*", help=argparse.SUPPRESS)  # (a measuring child: what it holds)
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    if args.modules is not None:
        print(json.dumps(measure(args.modules, args.edits)))
        return
    import tsdev_runtime.engine.llm_engine  # noqa: F401  the server's modules

    packages = default_packages()
    every = sorted(name for name in sys.modules if under(name, packages))
    results = {}
    for label, modules in (("kernel modules", imported(packages)), ("every module", every)):
        child = subprocess.run([sys.executable, __file__, "--edits", str(args.edits), "--modules", *modules],
                               capture_output=True, text=True, check=True)
        other = json.loads(child.stdout.strip().splitlines()[-1])
        results[label] = {"modules": len(modules), "other_median_s": round(median(other), 4),
                          "other_s": [round(x, 4) for x in other]}
        print(f"{label} ({len(modules)} given): before the compile {median(other):.3f} s median "
              f"({', '.join(f'{x:.3f}' for x in other)})")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
