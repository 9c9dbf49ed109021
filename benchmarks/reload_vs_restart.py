"""Reload of an edited Triton kernel vs a full restart, on a running server (tsdev serve subprocess).

    python3 benchmarks/reload_vs_restart.py                 # default model and decode capture sizes
    python3 benchmarks/reload_vs_restart.py --cycles 5 -- --cudagraph-capture-sizes 1 16 64
    python3 benchmarks/reload_vs_restart.py --edit moe -- --model default-moe   # the fused-MoE kernels' edit

Runs a copy of the project in a temporary folder: starts the server (restart time = process start to
the end of the first 32-token completion), then edits the SiLU-and-mul Triton kernel (negates its output; `--edit
moe`: the fused-MoE kernels negate the router weights, on the decode path and the prefill path) and reverts it,
`--cycles` times, reloading after each save. Prints every step's time, the serving pause, the ratio to the restart, and
checks that outputs change with the edit and come back after the revert. The edit alternates with its revert, so after
the first cycle every compile is a cache hit: the `jit` column is then the repeated-edit case (the pause excludes
compiles either way: they run ahead). Never-seen edits, one after another, as users make them:
benchmarks/save_to_serving.py.
"""
import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tsdev.client import reload_forward
from tsdev.launch.child import ServerProcess, copy_project

FILE = "kernels/tsdev_kernels/ops/activation.py"
OLD = "    return act * up\n"
NEW = "    return -act * up\n"
EDITS = {  # name -> (file, [(old, new), ...])
    "activation": (FILE, [(OLD, NEW)]),
    "moe": ("kernels/tsdev_kernels/ops/moe.py", [("y = y.to(dt).to(tl.float32) * tl.load(TOPK_W + slot)",
                                    "y = y.to(dt).to(tl.float32) * -tl.load(TOPK_W + slot)"),
                                   ("y = y * tl.load(TOPK_W + slots, mask=row_ok, other=0.0)[:, None]",
                                    "y = y * -tl.load(TOPK_W + slots, mask=row_ok, other=0.0)[:, None]")]),
}
PROMPT = {"prompt": [5, 17, 300, 42, 9, 77, 123, 4], "max_tokens": 32, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--edit", choices=EDITS, default="activation", help="which kernel to edit and revert")
    parser.add_argument("server_args", nargs="*", help="extra `tsdev serve` flags (after --)")
    args = parser.parse_args()

    project = copy_project(Path(tempfile.mkdtemp(prefix="tsdev-reload-")))
    server = ServerProcess(args.server_args, args.port, allow_reload_forward=True, cwd=project, pythonpath=project)
    url = server.url
    start = time.perf_counter()
    try:
        server.start()
        server.wait_healthy()
        baseline = timed_request(url)[0]
        restart = time.perf_counter() - start
        steady = timed_request(url)[1]
        file, replacements = EDITS[args.edit]
        source = project / file
        original = edited = source.read_text()
        for old, new in replacements:
            assert old in original, f"{file} no longer contains {old!r}: update the benchmark's edit"
            edited = edited.replace(old, new)
        rows = []
        for cycle in range(args.cycles):
            for label, text in (("edit", edited), ("revert", original)):
                source.write_text(text)
                t = time.perf_counter()
                try:
                    reply = reload_forward(url)
                except RuntimeError as exc:
                    sys.exit(f"reload_forward answered {exc}")
                wall = time.perf_counter() - t
                worker = reply.workers[0]
                if not reply.ok:
                    sys.exit(f"reload failed: {worker.error}")
                if worker.warnings:
                    print("warnings:", worker.warnings)
                out, first_request = timed_request(url)
                changed = out != baseline
                assert changed == (label == "edit"), f"cycle {cycle} {label}: output changed={changed}"
                rows.append({**worker.timings, "wall": wall, "first_request": first_request,
                             "jit_kernels": worker.jit_kernels, "label": label})
        print(f"restart (process start -> first completion): {restart:.2f} s; steady request {steady * 1e3:.1f} ms")
        columns = ("jit", "drain", "flush", "reload", "warm", "recapture", "recapture_decode", "recapture_prefill",
                   "pause", "total", "wall", "first_request")
        print(f"{'':8}" + "".join(f"{k.replace('recapture_', 'rc ').replace('first_request', '1st req'):>11}"
                                  for k in columns))
        for row in rows:
            print(f"{row['label']:8}" + "".join(f"{row.get(k, 0):>11.3f}" for k in columns))
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("reload", "warm", "recapture", "pause", "total", "wall", "first_request")}
        print(f"median of {len(rows)} reloads: reload+warm+recapture "
              f"{med['reload'] + med['warm'] + med['recapture']:.3f} s, "
              f"pause {med['pause']:.3f} s (target <= 0.25), "
              f"restart / pause = {restart / med['pause']:.1f}x (target >= 30), "
              f"restart / total = {restart / med['total']:.1f}x, "
              f"first request after reload {med['first_request'] * 1e3:.1f} "
              f"ms vs steady {steady * 1e3:.1f} ms; outputs changed with each edit and came back with each revert")
        print(json.dumps({"summary": {"restart": round(restart, 3), **{k: round(v, 4) for k, v in med.items()},
                                      "restart_over_pause": round(restart / med["pause"], 1), "reloads": len(rows)}}))
    finally:
        server.stop(30)
        shutil.rmtree(project, ignore_errors=True)


def timed_request(url: str) -> tuple[list[int], float]:
    t = time.perf_counter()
    response = httpx.post(url + "/v1/completions", json=PROMPT, timeout=120)
    if response.status_code != 200:
        sys.exit(f"completion answered {response.status_code}: {response.text[:2000]}")
    return response.json()["choices"][0]["token_ids"], time.perf_counter() - t


if __name__ == "__main__":
    main()
