"""Sleep / wake / reload_weights on CUDA (on the H200: `just device-test tests/test_sleep_gpu.py -s`): level 2 gives
back >= 90% of the weights + KV pool (cudaMemGetInfo), wake and recapture times, the drill with graphs (bf16 and
fp8, and the block-FP8 default checkpoints), its negative control failing, and a reload while awake keeping every
address the graphs captured."""
import time

import pytest
import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.weights_drill import DrillFailed, drill, greedy
from tsdev_runtime.weights.processing import DEBUG_DERIVED_ENV

pytestmark = pytest.mark.gpu


def engine(**overrides) -> LLMEngine:
    # a KV pool of a few GB keeps the test quick and the accounting meaningful
    return LLMEngine(EngineConfig(**{**dict(model=None, device="cuda", kv_pages=4096, max_running=64), **overrides}))


def segments_held() -> str:
    """The allocator's segments of 64 MiB or more still reserved, with their pool and stream (for a failure)."""
    big = [(s["total_size"] >> 20, s["allocated_size"] >> 20, s.get("segment_pool_id"), s["stream"])
           for s in torch.cuda.memory_snapshot() if s["total_size"] >= 64 << 20]
    return (f"reserved {torch.cuda.memory_reserved() >> 20} MiB, allocated {torch.cuda.memory_allocated() >> 20} MiB; "
            f"segments >= 64 MiB (MiB, MiB allocated, pool, stream): {big}")


def test_level_2_gives_back_the_weights_and_kv_and_wake_recaptures():
    e = engine()
    expected = greedy(e)
    weights = sum(t.numel() * t.element_size() for t in [*e.runner.model.parameters(), *e.runner.model.buffers()])
    kv = e.runner.kv_cache.numel() * e.runner.kv_cache.element_size()
    info = e.control.free_memory(2)
    device_freed = info["free_after"] - info["free_before"]
    print(f"\nweights {weights / 1e9:.2f} GB + KV {kv / 1e9:.2f} GB; freed {info['freed'] / 1e9:.2f} GB by storage, "
          f"{device_freed / 1e9:.2f} GB per cudaMemGetInfo")
    assert info["freed"] >= weights + kv * 0.99
    assert device_freed >= 0.9 * (weights + kv), segments_held()
    start = time.perf_counter()
    woken, recapture = e.control.restore_memory()
    wake = time.perf_counter() - start
    start = time.perf_counter()
    e.control.load_weights()
    reload = time.perf_counter() - start
    print(f"wake {wake:.3f} s (recapture {recapture}), reload {reload:.3f} s")
    assert set(woken) == {"weights", "kv_cache"} and e.runner.decode_graphs.graphs  # recaptured
    assert greedy(e) == expected


def test_level_1_wake_is_bit_identical_without_a_reload():
    e = engine()
    checksum, expected = e.control.checksum(), greedy(e)
    e.control.free_memory(1)
    e.control.restore_memory()
    assert e.control.cannot_step() is None and e.control.checksum() == checksum and greedy(e) == expected


def test_reload_when_awake_keeps_every_address_the_graphs_captured():
    e = engine()
    tensors = dict(e.runner.model.named_parameters()) | dict(e.runner.model.named_buffers())
    before = {n: t.data_ptr() for n, t in tensors.items()}
    graphs = dict(e.runner.decode_graphs.graphs)
    expected = greedy(e)
    e.control.load_weights()
    assert {n: t.data_ptr() for n, t in tensors.items()} == before
    assert e.runner.decode_graphs.graphs == graphs  # not recaptured: replayed as they were
    assert greedy(e) == expected


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_drill_ten_rounds_with_graphs(quantization):
    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    e = engine(quantization=quantization)
    assert e.runner.decode_graphs is not None
    weights_bytes = sum(t.numel() * t.element_size() for t in e.runner.model.parameters())
    report = drill(e, rounds=10)
    print(f"\n{report}")
    assert report.mode == "graphs" and all(len(times) == 10 for times in report.seconds.values())
    assert len(report.freed_bytes) == 10 and min(report.freed_bytes) >= weights_bytes  # each sleep freed the weights


@pytest.mark.parametrize("model", ["default-fp8", "default-moe-fp8"])
def test_drill_ten_rounds_with_graphs_on_block_fp8_checkpoints(model):
    """The checkpoints as stored (e4m3 + 128 x 128 block scales) through the block-FP8 Triton kernels, dense and
    experts, in the captured graphs: each round equal to a fresh load, greedy output equal."""
    e = engine(model=model)
    assert e.runner.decode_graphs is not None
    assert any(getattr(m, "block", None) for m in e.runner.model.modules())  # loaded as stored
    report = drill(e, rounds=10)
    print(f"\n{model}: {report}")
    assert report.mode == "graphs" and all(len(times) == 10 for times in report.seconds.values())


@pytest.mark.parametrize("mode", ["skip", "rebind"])
def test_the_negative_control_fails_the_drill_with_graphs(monkeypatch, mode):
    e = engine()
    monkeypatch.setenv(DEBUG_DERIVED_ENV, mode)
    with pytest.raises(DrillFailed):
        drill(e, rounds=1)
