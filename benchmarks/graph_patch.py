"""Issue 31, point 5: does pointing the captured graphs' kernel nodes at the new binaries pay, against capturing
them again -- and do the patched graphs serve what recaptured ones do?

    python3 benchmarks/graph_patch.py                # CUDA, the default model
    python3 benchmarks/graph_patch.py --cycles 3

One server of the default model. Each cycle: a never-seen edit of `silu_and_mul_values` (its output times a fresh
constant near 1), reloaded as a server does by default (a kernel-body edit: the graphs are patched); a greedy
completion; the same code reloaded again with `recapture` (forced, its binaries cached: the graphs the steps used
are captured, as before patching existed); the completion again, which must be the same tokens; then the revert,
patched, whose completion must be the first one's. Prints the recapture step and the pause of both kinds, medians,
as ratios of one run.
"""
import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tsdev_runtime.control_protocol import RELOAD_ROUTE, ReloadReply, WorkerReport
from tsdev.launch.child import ServerProcess, copy_project

HELPER, FILE, MODULE = ("    return act * up\n", "kernels/tsdev_kernels/ops/activation.py",
                        "tsdev_kernels.ops.activation")
PROMPT = {"prompt": "The three laws of thermodynamics are", "max_tokens": 24, "temperature": 0}


def reload(url: str, **body) -> WorkerReport:
    reply = httpx.post(url + RELOAD_ROUTE, json={"id": f"patch-{time.monotonic_ns()}", **body}, timeout=600)
    worker = ReloadReply.model_validate_json(reply.content).workers[0]
    assert worker.ok, worker.error
    return worker


def tokens(url: str) -> str:
    reply = httpx.post(url + "/v1/completions", json=PROMPT, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=6, help="never-seen edits (each reverted)")
    args = parser.parse_args()
    rng = random.Random(time.time_ns())
    patched, recaptured = [], []
    with tempfile.TemporaryDirectory() as tmp:
        project = copy_project(Path(tmp) / "project")
        server = ServerProcess(["--device", "cuda"], allow_reload_forward=True, cwd=project, pythonpath=project,
                               log_path=Path(tmp) / "serve.log")
        file = project / FILE
        original = file.read_text()
        with server.running(timeout=600):
            golden = tokens(server.url)
            for cycle in range(args.cycles):
                file.write_text(original.replace(HELPER, f"    return act * up * {1 + rng.uniform(1e-3, 5e-3):.12f}\n"))
                time.sleep(0.3)
                first = reload(server.url)
                assert first.graph_nodes_patched > 0, first  # a kernel-body edit
                edited = tokens(server.url)
                again = reload(server.url, modules=[MODULE], recapture=True)
                assert again.graph_nodes_patched == 0, again
                assert tokens(server.url) == edited, "the recaptured graphs serve other tokens than the patched ones"
                file.write_text(original)
                time.sleep(0.3)
                back = reload(server.url)
                assert tokens(server.url) == golden, "the revert, patched, does not serve the original tokens"
                patched += [first, back]
                recaptured.append(again)
                print(f"cycle {cycle}: patched {first.graph_nodes_patched} nodes in "
                      f"{first.timings['recapture'] * 1e3:.1f} ms (pause {first.timings['pause'] * 1e3:.1f} ms); "
                      f"recaptured in {again.timings['recapture'] * 1e3:.1f} ms (pause "
                      f"{again.timings['pause'] * 1e3:.1f} ms); edited output "
                      f"{'differs from' if edited != golden else 'equals'} the original", flush=True)
    median = lambda workers, key: statistics.median(w.timings[key] for w in workers) * 1e3  # noqa: E731
    print(f"recapture step, median: patched {median(patched, 'recapture'):.1f} ms over {len(patched)} reloads, "
          f"captured {median(recaptured, 'recapture'):.1f} ms over {len(recaptured)} "
          f"({median(recaptured, 'recapture') / median(patched, 'recapture'):.0f}x)")
    print(f"pause, median: patched {median(patched, 'pause'):.1f} ms, captured {median(recaptured, 'pause'):.1f} ms "
          f"(-{median(recaptured, 'pause') - median(patched, 'pause'):.1f} ms)")
    print("the patched graphs served the recaptured graphs' tokens after every edit, "
          "and the original after each revert")


if __name__ == "__main__":
    main()
