"""The GPU's idle share the engine reports (`/metrics` tsdev_gpu_idle_seconds, offline_throughput.py's "waiting for
the host"): the host's time preparing a step's inputs is the GPU's idle time, not its busy time.

Run on the H200: python3 -m pytest -q -m gpu tests/test_gpu_idle_gpu.py
"""
import time

import pytest

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.model_runner import ModelRunner
from tsdev_runtime.engine.sequence import SamplingParams

pytestmark = pytest.mark.gpu
HOST_DELAY = 0.005  # seconds added to each decode step's input preparation


def run(engine: LLMEngine) -> tuple[float, float, int, float]:
    """(GPU busy s, GPU idle s, decode steps, wall s) of 4 greedy requests of 48 tokens."""
    busy, idle, steps = engine.gpu_busy_seconds, engine.gpu_idle_seconds, engine.num_decode_steps
    start = time.perf_counter()
    engine.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    return (engine.gpu_busy_seconds - busy, engine.gpu_idle_seconds - idle, engine.num_decode_steps - steps,
            time.perf_counter() - start)


def test_a_slower_host_shows_as_gpu_idle_time(monkeypatch):
    engine = LLMEngine(EngineConfig(model=None, device="cuda", kv_pages=1024, max_running=8))
    run(engine)  # warm
    busy, idle, steps, wall = run(engine)
    assert busy > 0 and idle >= 0 and busy + idle <= wall * 1.01
    prepare = ModelRunner.host_inputs

    def slow(self, batch):
        time.sleep(HOST_DELAY)
        return prepare(self, batch)

    monkeypatch.setattr(ModelRunner, "host_inputs", slow)
    slow_busy, slow_idle, slow_steps, slow_wall = run(engine)
    print(f"\nbusy {busy * 1e3:.1f} ms, idle {idle * 1e3:.1f} ms over {steps} decode steps in {wall * 1e3:.1f} ms; "
          f"host {HOST_DELAY * 1e3:.0f} ms slower per step: busy {slow_busy * 1e3:.1f} ms, "
          f"idle {slow_idle * 1e3:.1f} ms")
    # each decode step's GPU work (about a millisecond at 4 rows) waits for the slower host: most of the delay is idle
    assert slow_idle - idle >= 0.6 * HOST_DELAY * slow_steps
    assert slow_busy < busy * 1.5 + 1e-3  # and none of it is counted as the GPU's work
