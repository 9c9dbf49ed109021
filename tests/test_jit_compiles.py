"""Triton compiles are counted per kernel (`tsdev_jit_compiles_total` in /metrics), and one outside startup and
reloads -- while serving -- is logged as a warning naming the kernel and its specialisation. On the CPU nothing
compiles (Triton's interpreter), so Triton's post-compile hook is called here as Triton calls it after a compile
(keyword arguments of `JITFunction._call_hook`); on the H200 tests/test_compile_at_startup_gpu.py checks the count
of a real startup and that serving adds none."""
import pytest
import logging
from types import SimpleNamespace

import triton
from fastapi.testclient import TestClient

from tsdev_runtime.engine.compiles import jit_compiles
from tsdev_runtime.engine import compiles
from tsdev_runtime.server.app import build_app
from test_server_api import labels, metric_lines


def triton_compiled(name: str) -> None:
    """What Triton does after compiling tsdev_kernels.ops.norm.`name` (its disk cache included)."""
    triton.knobs.runtime.jit_post_compile_hook(
        key=("sig", ("*fp32",)), repr=f"{name}[num_warps=4, num_ctas=1, num_stages=3](X: *fp32)",
        fn=SimpleNamespace(module="tsdev_kernels.ops.norm", name=name, jit_function=None), compile={},
        is_manual_warmup=False, already_compiled=False)


def warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_compiles_are_counted_by_kernel_in_metrics_and_warned_about_only_while_serving(tiny_model_dir, caplog):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=128, kv_pages=64))
    assert getattr(triton.knobs.runtime.jit_post_compile_hook, "counts_into", None) is compiles.COMPILES
    before = jit_compiles().get("tsdev_kernels.ops.norm._probe_kernel", 0)
    with caplog.at_level(logging.WARNING, logger="tsdev_runtime.server"):
        with compiles.COMPILES.expected():  # as startup and reloads mark themselves
            triton_compiled("_probe_kernel")
        assert not warnings(caplog)
        triton_compiled("_probe_kernel")
    assert jit_compiles()["tsdev_kernels.ops.norm._probe_kernel"] == before + 2
    [record] = warnings(caplog)
    assert "tsdev_kernels.ops.norm._probe_kernel" in record.getMessage() and "num_warps=4" in record.getMessage()
    with TestClient(build_app(engine, "tiny-c")) as client:
        counted = metric_lines(client, "tsdev_jit_compiles_total")
    assert counted[labels(model_name="tiny-c", kernel="tsdev_kernels.ops.norm._probe_kernel")] == before + 2


@pytest.mark.slow
def test_a_second_engine_does_not_chain_the_hook_twice(tiny_model_dir):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

    for _ in range(2):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=128, kv_pages=64))
    before = compiles.COMPILES.counts["tsdev_kernels.ops.norm._once"]
    triton_compiled("_once")
    assert compiles.COMPILES.counts["tsdev_kernels.ops.norm._once"] == before + 1


def test_compiles_the_disk_cache_did_not_answer_are_counted_apart(tiny_model_dir):
    """Triton's compilation listener says whether its disk cache answered a compile: the startup line counts those it
    did not (built in this process) apart from the loads."""
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.compiles import jit_built
    from tsdev_runtime.engine.llm_engine import LLMEngine

    LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=128, kv_pages=64))
    before = jit_built()
    for hit in (False, True, False):
        triton.knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=hit)
    assert jit_built() == before + 2
