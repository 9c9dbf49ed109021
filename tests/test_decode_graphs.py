"""The decode-graph path (on CPU the same padded static batch runs eagerly instead of replaying)."""
import pytest
import torch

from batches import GREEDY, decode_batch
from tsdev_runtime.engine.cuda_graphs import DecodeGraphs
from tsdev_runtime.engine.sequence import SamplingParams


def test_graph_path_equals_eager_and_pads_to_the_next_size(make_engine, monkeypatch):
    engine = make_engine(cudagraph_capture_sizes=[2, 4, 8])
    timings = engine.runner.capture_graphs()["decode"]
    assert sorted(timings) == [2, 4, 8]
    batch = decode_batch(engine, [5, 9, 14])  # 3 sequences -> the size-4 graph with one padding row
    eager = engine.runner.compute_logits(batch, use_graphs=False).clone()
    sizes = []
    forward = DecodeGraphs._forward
    monkeypatch.setattr(DecodeGraphs, "_forward", lambda self, size: sizes.append(size) or forward(self, size))
    graphed = engine.runner.compute_logits(batch).clone()
    assert sizes == [4]
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)


def test_padding_rows_write_no_kv(make_engine):
    engine = make_engine(cudagraph_capture_sizes=[8])
    batch = decode_batch(engine, [6, 11, 3])
    before = engine.runner.kv_cache.clone()
    engine.runner.compute_logits(batch)
    changed = (engine.runner.kv_cache != before).flatten(4).any(-1)  # [layer, k/v, page, offset]
    page = engine.config.page_size
    expected = torch.zeros_like(changed)
    for seq in batch.seqs:
        pos = seq.num_computed_tokens
        expected[:, :, seq.pages[pos // page], pos % page] = True
    assert torch.equal(changed, expected)


@pytest.mark.slow
def test_batches_larger_than_the_largest_graph_run_eagerly(make_engine):
    engine = make_engine(cudagraph_capture_sizes=[1, 2], max_running=16)
    prompts = [[i + 1, i + 2, i + 3] for i in range(5)]
    with_graphs = engine.generate(prompts, GREEDY)
    eager = make_engine(enforce_eager=True).generate(prompts, GREEDY)
    assert [r["token_ids"] for r in with_graphs] == [r["token_ids"] for r in eager]


@pytest.mark.slow
def test_generation_through_graphs_equals_eager_as_the_batch_changes(make_engine):
    prompts = [[(5 * i + j) % 900 + 1 for j in range(3 + 4 * i)] for i in range(5)]
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True) for i in range(5)]
    graphed = make_engine(cudagraph_capture_sizes=[2, 8]).generate(prompts, params)  # rows change owner as seqs finish
    eager = make_engine(enforce_eager=True).generate(prompts, params)
    assert [r["token_ids"] for r in graphed] == [r["token_ids"] for r in eager]


@pytest.mark.slow
def test_a_one_token_prefill_chunk_that_samples_nothing_keeps_the_batch_off_the_decode_graphs(make_engine):
    # 3 decodes use 3 of the 4 tokens of budget; the new prompt gets a 1-token chunk that does not sample
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], list(range(20, 50))]
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)]
    params.append(SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True))
    kwargs = dict(max_batched_tokens=4, max_running=4)
    graphed = make_engine(cudagraph_capture_sizes=[4], **kwargs).generate(prompts, params)
    eager = make_engine(enforce_eager=True, **kwargs).generate(prompts, params)
    assert [r["token_ids"] for r in graphed] == [r["token_ids"] for r in eager]


def test_the_garbage_collector_is_off_while_capturing_and_back_after_a_failure():
    import gc

    from tsdev_runtime.engine.cuda_graphs import collector_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()  # a graph freed by the collector mid-capture would invalidate the capture
        raise RuntimeError("capture failed")
    assert gc.isenabled()
