"""Batches on real pages for the graph tests (CPU and GPU): prefill, mixed, prefix-cached, decode."""
from tsdev_runtime.engine.scheduler import ScheduledBatch
from tsdev_runtime.engine.sequence import SamplingParams, Sequence

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

# name -> (sequence length, tokens already in the cache) per sequence
CASES = {
    "single-5": [(5, 0)],
    "single-16": [(16, 0)],
    "single-100": [(100, 0)],
    "batched-8x8": [(8, 0)] * 8,
    "batched-uneven": [(3, 0), (41, 0), (17, 0), (1, 0)],
    "mixed-decodes-and-prefill": [(30, 29), (12, 11), (37, 0), (9, 8)],
    "prefix-cached": [(60, 33), (20, 0)],
    "prefix-cached-mixed": [(90, 64), (50, 49), (70, 0)],
}


def make_batch(engine, spec: list[tuple[int, int]], seed: int = 0) -> ScheduledBatch:
    """Sequences whose first `cached` tokens are already in the KV cache (computed eagerly), ready for a
    step that computes the rest."""
    seqs = []
    for i, (length, cached) in enumerate(spec):
        seq = Sequence(f"s{seed}-{i}", [(31 * seed + 13 * i + 7 * j) % 1000 + 1 for j in range(length)], GREEDY)
        assert engine.block_manager.allocate(seq, length)
        seqs.append(seq)
    prefixes = [(s, c) for s, (_, c) in zip(seqs, spec) if c]
    if prefixes:
        engine.runner.compute_logits(ScheduledBatch([s for s, _ in prefixes], [c for _, c in prefixes]),
                                     use_graphs=False)
        for seq, cached in prefixes:
            seq.num_computed_tokens = cached
    return ScheduledBatch(seqs, [length - cached for length, cached in spec])


def written_slots(engine, batch: ScheduledBatch) -> set[tuple[int, int]]:
    """(page, offset) of every KV slot this batch's step writes."""
    page = engine.config.page_size
    return {(seq.pages[p // page], p % page) for seq, n in zip(batch.seqs, batch.num_tokens)
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n)}


def decode_batch(engine, lengths: list[int]) -> ScheduledBatch:
    """Sequences with all but their last token in the cache, each decoding one token."""
    return make_batch(engine, [(n, n - 1) for n in lengths])
