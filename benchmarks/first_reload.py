"""The first reload after a start against the ones after it: distinct never-seen edits of a kernel helper
(`silu_and_mul_values` times a fresh constant), reloaded through the engine's control (`reload_forward`) in one
process on the served model,
each reload's step timings and the hot-reload transaction's own (read, plan, compile, execute, patch, kernels), and
for the first two the engine thread's profile (cProfile of every call the reload runs there).

    python3 benchmarks/first_reload.py                  # CUDA, the default model
    python3 benchmarks/first_reload.py --device cpu --edits 3
    python3 benchmarks/first_reload.py --http           # through a `tsdev serve --allow-reload-forward` child
                                                        # and its HTTP route, as a client without the daemon does

Runs a copy of the project in a temporary folder (imported first), so the checkout is never edited.
"""
import argparse
import asyncio
import cProfile
import io
import json
import pstats
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tsdev.launch.child import copy_project  # noqa: E402
from tsdev.hotreload.snapshot import import_roots  # noqa: E402

HELPER = "kernels/tsdev_kernels/ops/activation.py"
LINE = "    return act * up\n"


async def run(project: Path, device: str, edits: int, calls_to: Path | None = None) -> None:
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.control_protocol import ReloadRequest
    from tsdev_runtime.engine.async_engine import AsyncEngine
    from tsdev_runtime.engine.llm_engine import LLMEngine
    from tsdev.hotreload import Reloader, default_packages

    from tsdev_runtime.engine.sequence import SamplingParams

    engine = LLMEngine(EngineConfig(model=None, device=device))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # served once, as a server has before a reload
    ae = AsyncEngine(engine)
    await ae.start()
    reloader = Reloader(default_packages(project))
    transactions = []
    reload = reloader.reload

    def kept(*args, **kwargs):
        transactions.append(reload(*args, **kwargs))
        return transactions[-1]

    reloader.reload = kept
    engine.control.allow_reloads(reloader)
    forward = engine.control.reload_forward
    on_thread = ae._on_engine_thread
    file = project / HELPER
    original = file.read_text()
    assert LINE in original, f"{HELPER} no longer holds {LINE!r}"
    rng = random.Random()
    calls = []
    for i in range(edits):
        profile = cProfile.Profile() if i < 2 else None
        ae._on_engine_thread = ((lambda fn, *a, p=profile: on_thread(lambda: p.runcall(fn, *a))) if profile
                                else on_thread)
        file.write_text(original.replace(LINE, f"    return act * up * {1 + rng.random() / 1000:.9f}\n"))
        reply = await forward(ReloadRequest(id=f"first-{i}", kernel_check="off"))
        worker = reply.workers[0]
        assert worker.ok, worker.error
        print(f"reload {i + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in worker.timings.items()))
        print("  transaction: " + ", ".join(f"{k} {v:.3f}" for k, v in transactions[-1].report.timings.items()))
        if profile:
            calls.append({"timings": worker.timings,
                          "calls": {f"{path}:{line}({name})": stat[1] for (path, line, name), stat
                                    in pstats.Stats(profile).stats.items()}})
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(25)
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:5000])
    file.write_text(original)
    await ae.stop()
    if calls_to:
        calls_to.write_text(json.dumps(calls))


def run_http(project: Path, device: str, edits: int) -> None:
    """The same edits through a server process and POST /v1/rl/engine/reload_forward (its compile pool, the default
    report-mode kernel checks): each reply's timings."""
    import httpx

    from tsdev.launch.child import ServerProcess

    file = project / HELPER
    original = file.read_text()
    server = ServerProcess(["--device", device], allow_reload_forward=True, cwd=project, pythonpath=project,
                           log_path=project / "server.log")
    with server.running(timeout=600):
        rng = random.Random()
        for i in range(edits):
            file.write_text(original.replace(LINE, f"    return act * up * {1 + rng.random() / 1000:.9f}\n"))
            reply = httpx.post(server.url + "/v1/rl/engine/reload_forward", json={"id": f"http-{i}"}, timeout=300)
            worker = reply.json()["workers"][0]
            assert worker["ok"], worker["error"]
            print(f"reload {i + 1} (http): " + ", ".join(f"{k} {v:.3f}" for k, v in worker["timings"].items()))
    file.write_text(original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--edits", type=int, default=4)
    parser.add_argument("--http", action="store_true", help="through a server process's HTTP route")
    parser.add_argument("--calls-json", type=Path, help="write the first two reloads' timings and the calls each made "
                        "on the engine thread (function -> count) to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = copy_project(Path(tmp))
        if args.http:
            run_http(project, args.device, args.edits)
            return
        sys.path[:0] = [str(p) for p in import_roots(project)]
        asyncio.run(run(project, args.device, args.edits, args.calls_json))


if __name__ == "__main__":
    main()
