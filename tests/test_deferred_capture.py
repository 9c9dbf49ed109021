"""A reload recaptures first only the graphs the steps used since the last capture; the others are captured one
at a time between steps once serving resumed, and run eagerly until then (on CPU a capture runs nothing, but
which sizes are captured when, and what the steps run meanwhile, is the same)."""
import pytest
import asyncio

from tsdev_runtime.control_protocol import ReloadRequest
from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev.hotreload import Reloader

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
GRAPHS = dict(cudagraph_capture_sizes=[1, 2, 4, 8], prefill_graph_capture_sizes=[16, 32, 64])  # + 256, the top
PACKAGES = ["tsdev_kernels.ops", "tsdev_runtime.layers", "tsdev_runtime.models", "tsdev_runtime.sampling"]


@pytest.mark.slow
def test_a_reload_captures_the_used_sizes_first_and_leaves_the_rest_pending(make_engine):
    engine = make_engine(**GRAPHS)  # startup captures every size
    assert engine.runner.graphs_pending == 0
    engine.generate([[5, 17, 300, 42, 9]], GREEDY)  # one 5-token prefill (bucket 16), then decodes at batch 1
    timings = engine.control.capture_graphs(deferring=True)
    assert sorted(timings["decode"]) == [1] and sorted(timings["prefill"]) == [16]
    assert engine.runner.decode_graphs.pending == [8, 4, 2] and engine.runner.prefill_graphs.pending == [256, 64, 32]
    captured = [engine.control.capture_next() for _ in range(engine.runner.graphs_pending)]
    assert [sorted(c["decode"]) for c in captured] == [[8], [4], [2], [], [], []]
    assert [sorted(c["prefill"]) for c in captured] == [[], [], [], [256], [64], [32]]
    assert engine.runner.graphs_pending == 0


def test_with_nothing_used_a_reload_still_captures_the_smallest_of_each_kind(make_engine):
    engine = make_engine(**GRAPHS)
    timings = engine.control.capture_graphs(deferring=True)
    assert sorted(timings["decode"]) == [1] and sorted(timings["prefill"]) == [16]


def test_full_recapture_captures_everything_before_serving_resumes(make_engine):
    engine = make_engine(**GRAPHS, full_recapture=True)
    engine.generate([[5, 17, 300]], GREEDY)
    timings = engine.control.capture_graphs(deferring=True)
    assert sorted(timings["decode"]) == [1, 2, 4, 8] and sorted(timings["prefill"]) == [16, 32, 64, 256]
    assert engine.runner.graphs_pending == 0


def test_sleeping_drops_what_is_pending(make_engine):
    engine = make_engine(**GRAPHS)
    engine.control.capture_graphs(deferring=True)
    assert engine.runner.graphs_pending == 6
    engine.runner.release_graphs()
    assert engine.runner.graphs_pending == 0


@pytest.mark.slow
def test_the_server_captures_the_pending_graphs_while_serving_after_the_reload_and_serves_the_same_tokens(make_engine):
    engine = make_engine(**GRAPHS)
    prompts = [[5, 17, 300, 42, 9], [7, 8, 9], list(range(3, 30))]
    before = [r["token_ids"] for r in engine.generate(prompts, GREEDY)]
    control = engine.control
    captured_later, capture_next = [], control.capture_next  # counted, not read once: the loop may capture them all
    control.capture_next = lambda: captured_later.append(1) or capture_next()  # before the test could look (load)

    async def scenario():
        ae = AsyncEngine(engine)
        control.allow_reloads(Reloader(PACKAGES))
        await ae.start()
        try:
            reply = await control.reload_forward(
                ReloadRequest(id="r1", modules=["tsdev_runtime.layers.activation"], recapture=True))  # (no graph patch)
            assert reply.ok, reply
            pending_after_reload = len(captured_later) + engine.runner.graphs_pending
            outputs = await asyncio.gather(*(collect(ae, f"q{i}", p) for i, p in enumerate(prompts)))
            for _ in range(100):
                if not engine.runner.graphs_pending:
                    break
                await asyncio.sleep(0.01)
            return reply, pending_after_reload, outputs
        finally:
            await ae.stop()

    reply, pending_after_reload, outputs = asyncio.run(scenario())
    assert pending_after_reload > 0 and engine.runner.graphs_pending == 0
    assert outputs == before  # eager until captured, replayed after: the same tokens


async def collect(ae: AsyncEngine, request_id: str, prompt: list[int]) -> list[int]:
    tokens = []
    async for out in ae.generate(request_id, prompt, GREEDY):
        tokens += out.new_token_ids
    return tokens


def test_while_requests_run_a_deferred_graph_is_captured_at_most_once_every_32_steps(make_engine):
    from tsdev_runtime.engine.async_engine import STEPS_PER_DEFERRED_CAPTURE

    engine = make_engine(**GRAPHS)
    engine.control.capture_graphs(deferring=True)  # as a reload leaves them: 6 pending
    busy_captures, steps = [], []
    capture_next, step = engine.control.capture_next, engine.step
    engine.control.capture_next = lambda: busy_captures.append(engine.has_unfinished()) or capture_next()
    engine.step = lambda: steps.append(1) or step()
    params = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)

    async def scenario():
        ae = AsyncEngine(engine)
        await ae.start()
        try:
            async for _ in ae.generate("long", [5, 17, 300], params):
                pass
            for _ in range(100):  # idle now: the rest go back to back
                if not engine.runner.graphs_pending:
                    break
                await asyncio.sleep(0.01)
        finally:
            await ae.stop()

    asyncio.run(scenario())
    assert len(steps) >= 70 and engine.runner.graphs_pending == 0
    assert 1 <= sum(busy_captures) <= len(steps) // STEPS_PER_DEFERRED_CAPTURE + 1


@pytest.mark.slow
def test_a_start_told_what_to_capture_first_captures_the_rest_while_serving(make_engine):
    """A restart by tsdev watch: the new server captures before serving only the graphs the old one had used (from
    its /server_info), the others between steps after, as a reload does."""
    used = make_engine(**GRAPHS)
    used.generate([[5, 17, 300, 42, 9]], GREEDY)
    info = used.describe()
    assert (info.decode_graphs_used, info.prefill_graphs_used) == ([1], [16])
    engine = make_engine(**GRAPHS, cudagraph_capture_first=info.decode_graphs_used,
                         prefill_graph_capture_first=info.prefill_graphs_used)
    assert engine.runner.decode_graphs.pending == [8, 4, 2] and engine.runner.prefill_graphs.pending == [256, 64, 32]
    want = [r["token_ids"] for r in used.generate([[7, 8, 9], list(range(3, 40))], GREEDY)]

    async def scenario():
        ae = AsyncEngine(engine)
        await ae.start()
        try:
            got = await asyncio.gather(*(collect(ae, f"s{i}", p)
                                         for i, p in enumerate(([7, 8, 9], list(range(3, 40))))))
            for _ in range(100):
                if not engine.runner.graphs_pending:
                    break
                await asyncio.sleep(0.01)
            return got
        finally:
            await ae.stop()

    assert asyncio.run(scenario()) == want and engine.runner.graphs_pending == 0
