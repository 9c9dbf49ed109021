"""Direct weight updates on CUDA (issue 16; on the H200: `pytest -q -m gpu tests/test_update_weights_gpu.py -s`).

The default model (bf16, and fp8 where the GPU runs it) is updated in place to a checkpoint with other weights:
every parameter, buffer and derived tensor keeps its data_ptr, the decode and prefill graph objects are the same
objects (not recaptured), greedy output equals a fresh engine on the new weights, and the checksums equal a fresh
load's. Prints the update's time next to a restart's (a fresh engine: load, warm-up, capture) and the checksum's.
"""
import time

import pytest
import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.weights_drill import fresh_checksum, greedy
from tsdev_runtime.weights.default_model import SHAPES, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def quantizations() -> list[str | None]:
    if not torch.cuda.is_available():
        return [None]
    from tsdev_kernels.ops import fp8

    return [None] + (["fp8"] if fp8.fp8_unsupported_reason("cuda") is None else [])


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-0.6b-B")
    write_checkpoint(out, SHAPES["qwen3-0.6b"], seed=2)
    return out


def graph_objects(engine: LLMEngine) -> dict:
    runner = engine.runner
    return {"decode": dict(runner.decode_graphs.graphs), "prefill": dict(runner.prefill_graphs.graphs)}


def addresses(engine: LLMEngine) -> dict[str, int]:
    model = engine.runner.model
    return {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("quantization", quantizations())
def test_direct_update_keeps_every_address_and_graph_and_matches_a_fresh_engine(other_weights, quantization):
    config = EngineConfig(model=None, device="cuda", kv_pages=4096, max_running=64, quantization=quantization)
    start = time.perf_counter()
    engine = LLMEngine(config)
    restart = time.perf_counter() - start
    original, a = greedy(engine), engine.model_dir
    graphs, before = graph_objects(engine), addresses(engine)
    assert graphs["decode"] and graphs["prefill"]

    start = time.perf_counter()
    update = engine.control.load_weights(other_weights, "direct")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert update.recapture_seconds == 0
    assert addresses(engine) == before  # data pointers before == after
    after = graph_objects(engine)
    assert all(after[k][s] is graphs[k][s] for k in graphs for s in graphs[k]) and after.keys() == graphs.keys()
    updated = greedy(engine)
    assert updated != original

    start = time.perf_counter()
    sums = engine.control.checksum(derived=False)
    checksum_seconds = time.perf_counter() - start
    assert sums == fresh_checksum(EngineConfig(model=None, device="cuda", quantization=quantization),
                                  str(other_weights))
    fresh = LLMEngine(EngineConfig(model=str(other_weights), device="cuda", kv_pages=4096, max_running=64,
                                   quantization=quantization))
    assert greedy(fresh) == updated
    del fresh

    engine.control.load_weights(a, "direct")
    assert greedy(engine) == original and addresses(engine) == before
    full = engine.control.load_weights(a, "full")
    assert full.recapture_seconds > 0 and greedy(engine) == original
    print(f"\n{quantization or 'bf16'}: direct update {seconds:.3f} s ({update.load}), restart {restart:.3f} s "
          f"({restart / seconds:.1f}x), full update {full.load.seconds + full.recapture_seconds:.3f} s, "
          f"checksum {checksum_seconds:.3f} s")
