"""Issue 18's numbers in one run, each next to its target: the reload pause (median of --cycles edit/revert
cycles of a Triton kernel, each cycle two reloads) and a restart of the same server, save -> serving through
`tsdev watch` (2 x --cycles never-seen edits of two inlined helpers, each reverted: fresh and repeated edits reported
apart, benchmarks/save_to_serving.py), the decode step at batch 1 and 256 with its memory-bandwidth floor, and the
offline workload's output tokens per second.

    python3 benchmarks/speed.py                 # CUDA; about 3 minutes on the H200
    python3 benchmarks/speed.py --cycles 5 --skip offline
    python3 benchmarks/speed.py --compile-workers 8 --skip decode offline   # the edit loop with the compile pool

Runs benchmarks/reload_vs_restart.py, save_to_serving.py, decode_step.py and offline_throughput.py one after the other
(each in its own process, its output shown as it comes), then prints the table.
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = {"pause_s": 0.25, "restart_over_pause": 30, "save_to_serving_fresh_s": 0.8,
           "save_to_serving_repeated_s": 0.25,
           "watch_restart_s": 3.5, "decode_1_ms": 0.8, "decode_256_ms": 5.5, "offline_tok_s": 30_000}


def run(script: str, *args: str) -> str:
    """The script's output, echoed line by line; a failure ends this run with its status."""
    print(f"== {script} {' '.join(args)}", flush=True)
    proc = subprocess.Popen([sys.executable, str(HERE / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    if proc.wait():
        sys.exit(f"{script} failed with status {proc.returncode}")
    return "".join(lines)


def last_summary(output: str) -> dict:
    """The script's JSON summary line (the server's log lines may follow it)."""
    return json.loads([line for line in output.splitlines() if line.startswith('{"summary"')][-1])["summary"]


def decode_rows(output: str) -> dict[int, dict[str, float]]:
    """decode_step.py's table: batch -> step, graph, engine and floor (ms)."""
    rows = {}
    for match in re.finditer(r"^\s*(\d+)\s+([\d.]+)\s+([\d.na]+)\s+([\d.]+)\s+([\d.]+)\s", output, re.M):
        batch, *values = match.groups()
        rows[int(batch)] = dict(zip(("step", "graph", "engine", "floor"), map(float, values)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=5, help="edit/revert cycles of the reload (two reloads each)")
    parser.add_argument("--compile-workers", type=int, default=None,
                        help="the servers' --compile-workers (the compile pool; default: the server's default)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["reload", "watch", "decode", "offline"])
    args = parser.parse_args()
    measured = {}
    pool = ["--", "--compile-workers", str(args.compile_workers)] if args.compile_workers is not None else []
    if "reload" not in args.skip:
        summary = last_summary(run("reload_vs_restart.py", "--cycles", str(args.cycles), *pool))
        measured.update(pause_s=summary["pause"], restart_over_pause=summary["restart_over_pause"],
                        restart_s=summary["restart"], wall_s=summary["wall"])
    if "watch" not in args.skip:
        watch = last_summary(run("save_to_serving.py", "--cycles", str(2 * args.cycles), *pool))  # >= 10 fresh edits
        measured.update(save_to_serving_fresh_s=watch["fresh"]["median"],
                        save_to_serving_repeated_s=watch["repeated"]["median"],
                        watch_restart_s=watch["restart"]["median"])
    if "decode" not in args.skip:
        rows = decode_rows(run("decode_step.py", "--batch-sizes", "1", "256"))
        for batch in (1, 256):  # the engine's step (async scheduling: what serving pays per step) is held to the
            # target; the runner's serial step (host prep, replay, sampling, copy back one after another) beside it
            measured[f"decode_{batch}_ms"] = rows[batch]["engine"]
            measured[f"decode_{batch}_serial_ms"] = rows[batch]["step"]
            measured[f"decode_{batch}_graph_ms"] = rows[batch]["graph"]
            measured[f"decode_{batch}_floor_ms"] = rows[batch]["floor"]
    if "offline" not in args.skip:
        out = run("offline_throughput.py")
        measured["offline_tok_s"] = float(re.search(r"([\d,]+) output tok/s", out).group(1).replace(",", ""))
    print("\nwhat                          measured     target  met")
    for key, target in TARGETS.items():
        if key in measured:
            value = measured[key]
            met = value >= target if key in ("restart_over_pause", "offline_tok_s") else value <= target
            print(f"{key:<28} {value:>10,.3f} {target:>10,}  {'yes' if met else 'NO'}")
    print(json.dumps({"speed": measured}))


if __name__ == "__main__":
    main()
