"""The reload's warm step runs the engine's warm-up unless the reloader reports `kernels_only` (every change inside
Triton kernel bodies, their new binaries already loaded: tests/hotreload/test_hotreload_triton.py checks that
report, tests/test_reload_gpu.py that nothing compiles after it on the GPU)."""
import asyncio

import pytest

from tsdev_runtime.control_protocol import ReloadRequest
from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev.hotreload import Reloader
from tsdev.outcome import worker_text

PACKAGES = ["tsdev_kernels.ops", "tsdev_runtime.layers", "tsdev_runtime.models", "tsdev_runtime.sampling"]
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


class Reporting:
    """The toolkit's reloader with its report's `kernels_only` set as told (on CPU Triton's interpreter runs the
    kernels, which never qualify)."""

    def __init__(self, kernels_only: bool):
        self.reloader, self.kernels_only = Reloader(PACKAGES), kernels_only

    def __getattr__(self, name):
        return getattr(self.reloader, name)

    def reload(self, modules=None, sources=None):
        tx = self.reloader.reload(modules=modules, sources=sources)
        tx.report.kernels_only = self.kernels_only
        return tx


@pytest.mark.slow
@pytest.mark.parametrize("kernels_only", [True, False])
def test_the_warm_step_runs_the_warm_up_only_when_more_than_kernel_bodies_changed(make_engine, kernels_only):
    engine = make_engine(cudagraph_capture_sizes=[1, 2])
    before = engine.generate([[5, 17, 300, 42]], GREEDY)[0]["token_ids"]
    warmups = []
    ranked = engine.control.ranked  # (one rank: the runner) the reload's warm step runs its warm-up
    warmup = ranked.warmup
    ranked.warmup = lambda: warmups.append(1) or warmup()

    async def scenario():
        ae = AsyncEngine(engine)
        engine.control.allow_reloads(Reporting(kernels_only))
        await ae.start()
        try:
            return await engine.control.reload_forward(
                ReloadRequest(id="r1", modules=["tsdev_kernels.ops.activation"]))
        finally:
            await ae.stop()

    reply = asyncio.run(scenario())
    assert reply.ok, reply
    worker = reply.workers[0]
    assert worker.kernels_only is kernels_only and "warm" in worker.timings
    assert worker.graphs is False  # a CPU engine: nothing was captured, and the reload line says so
    assert "recaptured" not in worker_text(worker) and "no CUDA graphs to recapture" in worker_text(worker)
    assert len(warmups) == (0 if kernels_only else 1)
    assert engine.generate([[5, 17, 300, 42]], GREEDY)[0]["token_ids"] == before


def test_the_reload_line_says_when_no_warm_up_was_needed():
    from tsdev_runtime.control_protocol import WorkerReport

    timings = {"reload": 0.01, "warm": 0.0, "recapture": 0.05, "pause": 0.07}
    skipped = WorkerReport(ok=True, reloaded=["tsdev_kernels.ops.activation"], kernels_only=True, timings=timings)
    ran = WorkerReport(ok=True, reloaded=["tsdev_kernels.ops.activation"], timings={**timings, "warm": 0.12})
    assert "no warm-up needed (only kernel bodies changed" in worker_text(skipped)
    assert "warmed in 0.12 s" in worker_text(ran) and "no warm-up" not in worker_text(ran)
