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


def test_what_a_standby_froze_before_its_first_engine_stays_frozen(tiny_model_dir):
    """A restart's standby freezes what it imported before it becomes the server (tsdev/launch/standby.py): the first
    engine's `thaw_heap` leaves that frozen (its `freeze_heap` then collects only what the start made); what an
    engine froze, the next engine thaws."""
    from tsdev_runtime.engine import llm_engine

    gc.unfreeze()
    llm_engine._frozen_by_an_engine = False  # (as a fresh process: no engine froze anything yet)
    gc.collect()
    gc.freeze()  # the standby's
    frozen = gc.get_freeze_count()
    llm_engine.thaw_heap(collect=True)
    assert gc.get_freeze_count() == frozen  # left frozen
    engine(tiny_model_dir)
    assert gc.get_freeze_count() > frozen and llm_engine._frozen_by_an_engine
    llm_engine.thaw_heap(collect=False)  # a next engine's
    assert gc.get_freeze_count() == 0
