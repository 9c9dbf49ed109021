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


def test_the_device_page_table_follows_the_rows_through_appends_swaps_and_shrinks():
    """Steps of a changing batch (pages appended, rows taking other sequences, the batch shrinking, steps that change
    nothing): after each, the page table the graphs read holds every row's pages; padding rows read the pad page."""
    pad = 7
    graphs = DecodeGraphs(torch.nn.Identity(), [1, 2, 4, 8], 16, 3, pad, torch.device("cpu"))
    forwarded = []
    graphs._forward = lambda size: forwarded.append(graphs.page_table[:size].clone())
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(100, 200, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(12)]
    batch = []
    for step in range(40):
        if step % 5 != 4:  # every fifth step changes nothing
            for pages in seqs:
                if torch.rand(1, generator=gen) < 0.3 and len(pages) < 16:
                    pages.append(int(torch.randint(200, 300, (1,), generator=gen)))
            chosen = torch.randperm(len(seqs), generator=gen)[: int(torch.randint(1, 9, (1,), generator=gen))]
            batch = [seqs[i] for i in chosen.tolist()]
        n = len(batch)
        graphs.run([1] * n, [0] * n, [0] * n, [len(p) * 16 for p in batch], batch)
        table, size = forwarded[-1], graphs.size_for(n)
        for row, pages in enumerate(batch):
            assert table[row, : len(pages)].tolist() == pages, (step, row)
        assert all(table[row, 0] == pad for row in range(n, size))


def test_pending_tokens_land_in_their_rows_consecutive_or_scattered():
    from tsdev_runtime.engine.model_runner import PendingTokens
    tokens = torch.randint(0, 1000, (6,))
    for rows, sources in (([0, 1, 2], [3, 4, 5]), ([1, 2], [0, 1]), ([0, 2, 5], [4, 0, 1]), ([2, 3], [5, 1])):
        ids = torch.randint(0, 1000, (7,))
        expected = ids.clone()
        expected[rows] = tokens[sources]
        PendingTokens(rows, sources, tokens).write(ids)
        assert torch.equal(ids, expected)
