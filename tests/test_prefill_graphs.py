"""Prefill graphs on CPU: the bucket ladder, the cut forward (run eagerly here), and capture failures."""
import math

import pytest
import torch

from batches import CASES, make_batch, written_slots
from tsdev_runtime.context import step_context
from tsdev_runtime.engine.prefill_graphs import PrefillGraphs, cut_at_attention, prefill_buckets
from tsdev_runtime.engine.sequence import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def ladder_step(size: int) -> int:
    """The rule, written independently: the largest power of two <= size / 8, clamped to 16..512."""
    return min(512, max(16, 2 ** math.floor(math.log2(size / 8))))


@pytest.mark.parametrize("max_tokens,budget", [(2048, 2048), (2048, 1000), (8192, 8192), (4096, 2048), (100, 2048),
                                               (16, 2048), (17, 2048), (2048, 300)])
def test_bucket_ladder_follows_the_rule(max_tokens, budget):
    buckets = prefill_buckets(max_tokens, budget)
    top = min(max_tokens, budget)
    assert buckets[-1] == top and buckets == sorted(set(buckets))
    assert buckets[0] == min(16, top)
    for a, b in zip(buckets, buckets[1:-1]):
        assert b - a == ladder_step(a), (a, b)
    if len(buckets) > 1:
        assert 0 < buckets[-1] - buckets[-2] <= ladder_step(buckets[-2])
    for a, b in zip(buckets, buckets[1:]):  # above the 16-token minimum step, padding wastes at most 1/8
        assert (b - (a + 1)) / b <= 0.125 or a < 128


def test_bucket_ladder_by_example():
    default = prefill_buckets(2048, 2048)
    assert default[:17] == list(range(16, 257, 16)) + [288]
    assert [b for b in default if b > 1024] == list(range(1152, 2049, 128))
    assert len(default) == 40
    assert prefill_buckets(8192, 8192)[-3:] == [7168, 7680, 8192]  # steps capped at 512
    assert prefill_buckets(2048, 1000)[-2:] == [960, 1000]
    assert prefill_buckets(8, 2048) == [8]
    assert prefill_buckets(0, 2048) == [] and prefill_buckets(2048, 0) == []


def test_explicit_buckets_are_clamped_and_include_the_top():
    assert prefill_buckets(2048, 2048, [64, 300, 5000]) == [64, 300, 2048]
    assert prefill_buckets(2048, 512, [64, 300, 5000]) == [64, 300, 512]
    assert prefill_buckets(256, 2048, [1000]) == [256]


@pytest.mark.slow
def test_engine_flags_choose_the_buckets(make_engine):
    assert make_engine(max_batched_tokens=256).runner.prefill_graphs.buckets == prefill_buckets(2048, 256)
    assert make_engine(prefill_graph_max_tokens=0).runner.prefill_graphs is None
    assert make_engine(enforce_eager=True).runner.prefill_graphs is None
    explicit = make_engine(prefill_graph_capture_sizes=[32, 100])
    assert explicit.runner.prefill_graphs.buckets == [32, 100, 256]


def test_a_mixed_steps_context_names_its_leading_decodes_for_attention(make_engine):
    """The scheduler puts decodes first; the step's context says how many lead (attention runs them on the decode
    kernel: attention.paged_attention's `decodes`) and orders them apart from the rest."""
    engine = make_engine()
    _, _, ctx = engine.runner.prepare(make_batch(engine, CASES["mixed-decodes-and-prefill"]))  # rows 1, 1, 37, 1
    assert ctx.decodes == 2 and ctx.order[:2].tolist() == [0, 1] and ctx.order[2:].tolist() == [2, 3]
    _, _, ctx = engine.runner.prepare(make_batch(engine, [(7, 6), (9, 8)], seed=1))  # a decode step
    assert ctx.decodes == 0 and ctx.order.tolist() == [1, 0]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_cut_forward_equals_the_plain_forward(make_engine, case):
    engine = make_engine(max_batched_tokens=256)
    batch = make_batch(engine, CASES[case])
    assert engine.runner.prefill_graphs.size_for(batch.total_tokens) is not None
    before = engine.runner.kv_cache.clone()
    plain = engine.runner.compute_logits(batch, use_graphs=False).clone()
    plain_kv = engine.runner.kv_cache.clone()
    engine.runner.kv_cache.copy_(before)
    cut = engine.runner.compute_logits(batch).clone()
    torch.testing.assert_close(cut, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engine.runner.kv_cache, plain_kv, rtol=1e-5, atol=1e-5)
    # padding rows write no KV: exactly the batch's own slots changed
    changed = (engine.runner.kv_cache != before).flatten(4).any(-1).any(1).any(0)  # [page, offset]
    assert {tuple(i) for i in changed.nonzero().tolist()} == written_slots(engine, batch)


@pytest.mark.slow
def test_attention_is_cut_only_inside_cut_at_attention(make_engine):
    engine = make_engine()
    model, layers = engine.runner.model, engine.runner.prefill_graphs.attention
    assert len(layers) == engine.runner.model_config.num_hidden_layers
    input_ids, positions, context = engine.runner.prepare(make_batch(engine, CASES["batched-uneven"]))
    seen = []

    def cut(layer, q, k, v):
        seen.append(layer)
        return layer.attend(q, k, v)

    def broken(layer, q, k, v):
        raise RuntimeError("boom")

    with step_context(context), torch.inference_mode():
        plain = model(input_ids, positions)
        assert seen == []
        with cut_at_attention(layers, cut):
            torch.testing.assert_close(model(input_ids, positions), plain, rtol=1e-5, atol=1e-5)
        assert seen == layers  # every layer, once, in order
        with pytest.raises(RuntimeError, match="boom"), cut_at_attention(layers, broken):
            model(input_ids, positions)
    assert all(layer.graph_cut is None for layer in layers)  # reset, after a failure too


@pytest.mark.slow
def test_the_cut_forward_survives_a_reload_of_the_attention_layer(make_engine):
    from tsdev.hotreload import Reloader

    engine = make_engine(max_batched_tokens=256)
    batch = make_batch(engine, CASES["prefix-cached-mixed"])
    assert engine.runner.prefill_graphs.size_for(batch.total_tokens) > batch.total_tokens  # padded: needs the cut
    before = engine.runner.kv_cache.clone()
    plain = engine.runner.compute_logits(batch, use_graphs=False).clone()
    engine.runner.kv_cache.copy_(before)
    tx = Reloader(["tsdev_runtime.layers", "tsdev_runtime.models"]).reload(modules=["tsdev_runtime.layers.attention"])
    try:
        assert tx.report.ok, tx.report.error
        assert "tsdev_runtime.models.qwen3" in tx.report.dependents
        torch.testing.assert_close(engine.runner.compute_logits(batch), plain, rtol=1e-5, atol=1e-5)
    finally:
        tx.rollback()


@pytest.mark.slow
def test_a_graph_captured_under_other_properties_is_not_replayed(make_engine, monkeypatch):
    from tsdev_runtime.engine import prefill_graphs

    engine = make_engine(max_batched_tokens=64)
    graphs = engine.runner.prefill_graphs
    batch = make_batch(engine, CASES["mixed-decodes-and-prefill"])
    stale = prefill_graphs._Bucket(pool=None)
    stale.properties = ("ref", True)  # as if captured under TSDEV_KERNELS=ref
    stale.pieces = [type("Piece", (), {"replay": lambda self: pytest.fail("replayed a graph of other properties")})()]
    graphs.graphs = {graphs.size_for(batch.total_tokens): stale}
    monkeypatch.setenv("TSDEV_KERNELS", "triton")
    plain = engine.runner.compute_logits(batch, use_graphs=False).clone()
    torch.testing.assert_close(engine.runner.compute_logits(batch), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_generation_through_the_cut_forward_equals_eager(make_engine):
    prompts = [[(5 * i + j) % 900 + 1 for j in range(3 + 11 * i)] for i in range(6)]
    params = [greedy(6 + 3 * i) for i in range(6)]
    cut = make_engine(max_batched_tokens=48).generate(prompts, params)  # chunked prefills mixed with decodes
    eager = make_engine(max_batched_tokens=48, enforce_eager=True).generate(prompts, params)
    assert [r["token_ids"] for r in cut] == [r["token_ids"] for r in eager]


@pytest.mark.slow
def test_a_failed_capture_at_startup_warns_and_prefill_runs_eagerly(make_engine, monkeypatch, capsys):
    def broken(self, size):
        raise RuntimeError(f"boom at {size} tokens")

    monkeypatch.setattr(PrefillGraphs, "_capture", broken)
    engine = make_engine(max_batched_tokens=64)
    assert "boom at 64 tokens" in engine.runner.prefill_graphs.disabled
    assert "prefill runs eagerly" in capsys.readouterr().err
    monkeypatch.setattr(PrefillGraphs, "forward", lambda *a, **k: pytest.fail("the disabled graphs were used"))
    prompts = [[3, 5, 7, 11, 13], [2, 4, 6]]
    tokens = [r["token_ids"] for r in engine.generate(prompts, greedy(5))]
    assert tokens == [r["token_ids"] for r in make_engine(enforce_eager=True).generate(prompts, greedy(5))]


@pytest.mark.slow
def test_a_failed_capture_during_a_reload_raises_and_out_of_memory_says_what_to_lower(make_engine, monkeypatch):
    engine = make_engine(max_batched_tokens=64)

    def broken(self, size):
        raise RuntimeError("boom")

    monkeypatch.setattr(PrefillGraphs, "_capture", broken)
    with pytest.raises(RuntimeError, match="capturing the prefill graphs failed: RuntimeError: boom"):
        engine.runner.capture_graphs(strict=True)

    def out_of_memory(self, size):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(PrefillGraphs, "_capture", out_of_memory)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match="--prefill-graph-max-tokens"):
            engine.runner.capture_graphs(strict=strict)


def test_the_buckets_and_the_startup_line_stop_at_the_context_length(make_engine):
    from tsdev.launch.serve import describe_graphs

    engine = make_engine(max_model_len=512, max_batched_tokens=2048)
    info = engine.describe()
    assert info.prefill_graph_buckets[-1] == 512 and max(info.prefill_graph_buckets) == 512
    assert "(16..512 tokens)" in describe_graphs(info, False, engine.startup_timings)
