"""Scheduling under pressure: preemption by recompute, abort, prefix-cache eviction."""
import pytest
from tsdev_runtime.engine.block_manager import BlockManager
from tsdev_runtime.engine.sequence import SamplingParams, Sequence

from consumer import Consumer

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 900 + 1 for j in range(10 + 3 * i)] for i in range(6)]


@pytest.mark.slow
def test_preemption_under_tiny_pool_gives_the_same_tokens(make_engine):
    expected = make_engine().generate(PROMPTS, GREEDY)
    # 6 sequences of up to 49 tokens need ~60 pages of 4; 20 pages force preemptions.
    small = make_engine(kv_pages=20, max_model_len=64)
    got = small.generate(PROMPTS, GREEDY)
    assert small.scheduler.num_preemptions > 0
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    assert small.block_manager.num_used_pages == 0


@pytest.mark.slow
def test_abort_frees_pages_and_others_continue(make_engine):
    engine = make_engine()
    consumer = Consumer(engine)
    consumer.add("a", PROMPTS[3], GREEDY)
    consumer.add("b", PROMPTS[4], GREEDY)
    for _ in range(3):
        consumer.step()
    used_by_both = engine.block_manager.num_used_pages
    assert engine.abort("a")
    assert engine.block_manager.num_used_pages < used_by_both
    assert not engine.abort("a")
    outputs = []
    while engine.has_unfinished():
        outputs += consumer.step()
    assert {o.request_id for o in outputs} == {"b"}
    assert engine.block_manager.num_used_pages == 0


def test_waiting_request_can_be_aborted(make_engine):
    engine = make_engine(max_running=1)
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)
    engine.step()
    assert engine.abort("b")
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used_pages == 0


def test_prefix_cache_shares_full_pages_and_evicts_when_needed():
    bm = BlockManager(num_pages=4, page_size=4)
    a = Sequence("a", list(range(10)), GREEDY)
    assert bm.allocate(a, 10)  # 3 pages
    a.num_computed_tokens = 10
    bm.commit_full_pages(a)  # pages 0..1 are full
    b = Sequence("b", list(range(8)) + [99, 98], GREEDY)
    bm.match_prefix(b)
    assert b.num_cached_tokens == 8 and b.pages == a.pages[:2]
    bm.free_pages(a)
    bm.free_pages(b)
    assert bm.num_free_pages == 4
    c = Sequence("c", [50 + i for i in range(16)], GREEDY)
    assert bm.allocate(c, 16)  # needs all 4 pages: the cached ones are evicted
    d = Sequence("d", list(range(10)), GREEDY)
    bm.free_pages(c)
    bm.match_prefix(d)
    assert d.num_cached_tokens == 0


def test_flush_forgets_cached_prefixes():
    bm = BlockManager(num_pages=8, page_size=4)
    a = Sequence("a", list(range(9)), GREEDY)
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit_full_pages(a)
    bm.free_pages(a)
    bm.flush()
    b = Sequence("b", list(range(9)), GREEDY)
    bm.match_prefix(b)
    assert b.num_cached_tokens == 0


def test_chunked_prefill_runs_beside_decodes(make_engine):
    engine = make_engine(max_batched_tokens=8)
    engine.add_request("short", PROMPTS[0][:3], GREEDY)
    engine.step()  # short prefilled, now decoding
    engine.add_request("long", PROMPTS[5], GREEDY)
    batch = engine.scheduler.schedule()
    assert [s.request_id for s in batch.seqs] == ["short", "long"]
    assert batch.num_tokens == [1, 7]



def test_a_request_waiting_for_pages_counts_its_prefix_lookup_once():
    from tsdev_runtime.engine.scheduler import Scheduler

    bm = BlockManager(num_pages=10, page_size=4)
    cached = Sequence("cached", list(range(12)), GREEDY)
    assert bm.allocate(cached, 12)
    cached.num_computed_tokens = 12
    bm.commit_full_pages(cached)
    bm.free_pages(cached)  # 3 full pages stay in the prefix cache
    scheduler = Scheduler(bm, max_running=4, max_batched_tokens=64)
    scheduler.add(Sequence("hog", [500 + i for i in range(28)], GREEDY))
    scheduler.schedule()  # the hog takes the 7 uncached pages
    scheduler.add(Sequence("late", list(range(12)) + [99], GREEDY))
    for _ in range(3):
        assert [s.request_id for s in scheduler.schedule().seqs] == ["hog"]  # late waits: no page for its last token
    assert (bm.hits, bm.queries) == (0, 1)  # only the hog's lookup (a miss) so far
    scheduler.finish(scheduler.find("hog"), "length")
    assert [s.request_id for s in scheduler.schedule().seqs] == ["late"]
    assert (bm.hits, bm.queries) == (3, 3 + 1)  # late: 3 cached pages found, counted once
