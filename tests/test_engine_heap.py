"""The engine freezes what its startup made out of the garbage collector's reach (`freeze_heap`), and a new
engine thaws it (`thaw_heap`), so that an engine dropped in a reference cycle is still freed."""
import pytest
import gc
import weakref

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams


def engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", kv_pages=64))


@pytest.mark.slow
def test_a_collection_after_startup_walks_only_what_serving_made(tiny_model_dir):
    first = engine(tiny_model_dir)
    assert gc.get_freeze_count() > 10_000  # torch, the model, the engine
    made_since = len(gc.get_objects())  # the collector's generations: the frozen objects are not in them
    assert made_since < gc.get_freeze_count() / 10
    assert all(r["finish_reason"] == "length"
               for r in first.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True)))


@pytest.mark.slow
def test_an_engine_dropped_in_a_reference_cycle_is_freed_by_the_next_one(tiny_model_dir):
    dropped = engine(tiny_model_dir)
    dropped.cycle = dropped
    kv = weakref.ref(dropped.runner)
    del dropped
    gc.collect()
    assert kv() is not None  # frozen: the collector does not see the cycle
    engine(tiny_model_dir)
    assert kv() is None
