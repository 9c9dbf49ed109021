"""The MLA kernels (kernels/tsdev_kernels/ops/mla.py) against their torch reference under Triton's interpreter, on
fresh random inputs: pages in random order, mixed lengths, a prefill chunk behind a cached prefix beside decode rows,
head counts and latent widths that are not multiples of the tiles, padding slots, KV splits past a short sequence's
end, an e4m3 cache; and their reload checks, which a wrong scale fails. The same kernels on CUDA:
tests/test_mla_gpu.py."""
import os
from dataclasses import replace

import pytest
import torch

from tsdev_kernels import checks
from tsdev_kernels.ops import mla

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run in a process without the GPU (tests/test_kernels_interpreter_process.py)")


def reference(q, cache, cu, lens, table, rows, slots, latent):
    cache = cache.clone()
    mla.store_latent_ref(rows, cache, slots)
    return mla.mla_attention_ref(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent), cache


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_decode_matches_the_reference_with_and_without_splits(splits, kv_dtype):
    g = torch.Generator().manual_seed(7 + splits)
    # 6 heads (a tile of 16 half empty), latent 24 of a 32 block, rope 8; a sequence of 1 token leaves splits empty
    q, cache, cu, lens, table, rows, slots, order, _, latent = mla.mla_batch(
        [1] * 4, [0, 13, 37, 6], 6, 24, 8, 4, torch.float32, "cpu", g, kv_dtype)
    want, want_cache = reference(q, cache, cu, lens, table, rows, slots, latent)
    mla.store_latent_triton(rows, cache, slots)
    got = mla.mla_attention_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, 1, num_splits=splits,
                                   order=order)
    assert torch.equal(cache.float(), want_cache.float())
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_decode_stores_the_steps_rows_itself_and_a_padding_slot_writes_nothing(kv_dtype):
    g = torch.Generator().manual_seed(11)
    q, cache, cu, lens, table, rows, slots, order, _, latent = mla.mla_batch(
        [1] * 5, [0, 13, 37, 6, 20], 6, 24, 8, 4, torch.float32, "cpu", g, kv_dtype)
    slots[3] = -1  # a graph's padding row
    want, want_cache = reference(q, cache, cu, lens, table, rows, slots, latent)
    got = mla.mla_attention_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, 1, num_splits=3,
                                   order=order, store=(rows, slots))
    assert torch.equal(cache.float(), want_cache.float())
    keep = torch.arange(5) != 3  # the padding row's own output is unspecified (its row never stored)
    torch.testing.assert_close(got[keep], want[keep], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads, columns", [(32, 8), (16, 16)])
def test_decode_tiles_that_sum_part_of_the_latent_columns_match_the_reference(heads, columns):
    """The sweep's tiles: more heads per program, each summing `columns` of the latent output (8 or 16 of 32)."""
    g = torch.Generator().manual_seed(heads + columns)
    q, cache, cu, lens, table, rows, slots, order, _, latent = mla.mla_batch(
        [1] * 3, [5, 30, 11], 40, 24, 8, 4, torch.float32, "cpu", g, torch.float8_e4m3fn)
    want, want_cache = reference(q, cache, cu, lens, table, rows, slots, latent)
    got = mla.mla_attention_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, 1, num_splits=2,
                                   order=order, store=(rows, slots), heads=heads, columns=columns)
    assert torch.equal(cache.float(), want_cache.float())
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("splits, heads, columns", [(1, 16, 32), (3, 32, 32), (2, 16, 16)])
def test_transposed_decode_tiles_match_the_reference(splits, heads, columns, kv_dtype):
    """The sweep's transposed tiles (cache rows x heads, the output as latent columns x heads), split and unsplit."""
    g = torch.Generator().manual_seed(splits * heads + columns)
    q, cache, cu, lens, table, rows, slots, order, _, latent = mla.mla_batch(
        [1] * 4, [5, 30, 0, 11], 40, 24, 8, 4, torch.float32, "cpu", g, kv_dtype)
    want, want_cache = reference(q, cache, cu, lens, table, rows, slots, latent)
    got = mla.mla_attention_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, 1, num_splits=splits,
                                   order=order, store=(rows, slots), heads=heads, columns=columns, transposed=True)
    assert torch.equal(cache.float(), want_cache.float())
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_prefill_of_a_mixed_step_matches_the_reference_and_padding_slots_write_nothing(transposed):
    g = torch.Generator().manual_seed(3)
    # a 21-row chunk behind 30 cached tokens, a whole 18-token prompt, two decode rows
    q, cache, cu, lens, table, rows, slots, order, max_q_len, latent = mla.mla_batch(
        [21, 18, 1, 1], [30, 0, 9, 25], 3, 32, 8, 4, torch.float32, "cpu", g)
    slots[5] = -1  # a padding row of a graph: its row must not reach the cache
    want, want_cache = reference(q, cache, cu, lens, table, rows, slots, latent)
    before = cache.clone()
    mla.store_latent_triton(rows, cache, slots)
    assert torch.equal(cache, want_cache) and not torch.equal(cache, before)
    got = mla.mla_attention_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, max_q_len, order=order,
                                   transposed=transposed)  # (transposed: the causal mask across, keys down)
    keep = torch.ones(len(q), dtype=torch.bool)
    keep[5] = False  # the padding row's own output is unspecified (its key never stored)
    torch.testing.assert_close(got[keep], want[keep], atol=2e-5, rtol=2e-5)


def test_the_public_op_stores_the_rows_then_attends_on_any_device():
    g = torch.Generator().manual_seed(4)
    q, cache, cu, lens, table, rows, slots, order, max_q_len, latent = mla.mla_batch(
        [5, 1], [3, 11], 2, 16, 8, 4, torch.float32, "cpu", g)
    want, _ = reference(q, cache, cu, lens, table, rows, slots, latent)
    got = mla.mla_attention(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, max_q_len=max_q_len,
                            store=(rows, slots), order=order)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_a_mixed_step_runs_its_decode_rows_as_a_decode_step_and_the_rest_on_the_prefill_tiles(monkeypatch):
    """The leading one-row sequences (`decodes`, `split_order`'s order) on the decode path, which stores their rows,
    then the other rows stored and the prompts' chunks on the prefill tiles: together the reference, the cache as the
    reference stores it. With `_mla_kernel`'s decode tiles (TSDEV_MLA_DECODE=tiles); tests/test_mla_decode.py routes
    the same step to the flash kernel."""
    from tsdev_kernels.ops.attention import split_order

    monkeypatch.setattr(mla, "use_triton", lambda x, family: True)  # the Triton paths, interpreted
    monkeypatch.setattr(mla, "MLA_DECODE", "tiles")
    g = torch.Generator().manual_seed(5)
    q_lens, cached = [1, 1, 1, 21, 1, 18], [9, 25, 4, 30, 6, 0]
    q, cache, cu, lens, table, rows, slots, _, max_q_len, latent = mla.mla_batch(
        q_lens, cached, 3, 32, 8, 4, torch.float32, "cpu", g)
    decodes, order = split_order(q_lens, [c + n for c, n in zip(cached, q_lens)])
    assert decodes == 3
    want, want_cache = reference(q, cache, cu, lens, table, rows, slots, latent)
    launched = []
    kernel = mla.mla_attention_triton
    monkeypatch.setattr(mla, "mla_attention_triton", lambda *a, **kw: launched.append(
        (kw["order"].tolist(), kw.get("store") is not None)) or kernel(*a, **kw))
    got = mla.mla_attention(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, max_q_len=max_q_len,
                            store=(rows, slots), order=torch.tensor(order), decodes=decodes)
    assert launched == [(order[:3], True), (order[3:], False)]
    assert torch.equal(cache, want_cache)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_the_checks_run_where_the_model_keeps_a_latent_cache_and_a_wrong_scale_fails():
    by_op = {c.op: c for c in checks.declared()}
    serving = checks.Serving(tokens=(3, 20), hidden=64, intermediate=128, dtype=torch.float32, q_heads=4,
                             max_context=60, device="cpu")
    assert all(by_op[op].shapes(serving) == [] for op in ("mla_decode", "mla_prefill"))  # a GQA model: none
    latent = replace(serving, latent_dim=32, rope_dim=8)
    assert by_op["paged_decode"].shapes(latent) == [] and by_op["mla_decode"].shapes(latent) == [
        (3, 4, 32, 8, 16, 60), (20, 4, 32, 8, 16, 60)]
    for op in ("mla_decode", "mla_prefill"):
        assert checks.run(by_op[op], by_op[op].shapes(latent)[0], torch.float32, "cpu").ok
    fp8 = replace(latent, kv_fp8=True)
    assert checks.run(by_op["mla_decode_fp8"], by_op["mla_decode_fp8"].shapes(fp8)[0], torch.float32, "cpu").ok

    def wrong(q, cache, cu, lens, table, rows, slots, order, max_q_len, latent):
        mla.store_latent_triton(rows, cache, slots)
        return mla.mla_attention_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5 * 1.05, latent, max_q_len)

    check = by_op["mla_decode"]
    assert not checks.run(replace(check, kernel=wrong), (3, 4, 32, 8, 16, 60), torch.float32, "cpu").ok


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_the_expanded_and_the_absorbed_forms_of_latent_attention_agree(kv_dtype):
    """LatentAttention's two forms on one step of fresh random inputs (prompts behind cached prefixes, pages in random
    order; a bf16 or e4m3 cache): W_UK / W_UV applied to the query and output, or to every cached row."""
    from tsdev_runtime.context import Context, step_context
    from tsdev_runtime.layers.attention import LatentAttention

    g = torch.Generator().manual_seed(21)
    heads, latent, rope, nope, v_dim = 3, 32, 8, 16, 12
    q_lens, cached = [9, 6], [14, 0]
    _, cache, cu, lens, table, rows, slots, order, max_q_len, _ = mla.mla_batch(
        q_lens, cached, heads, latent, rope, 4, torch.float32, "cpu", g, kv_dtype)
    w_uk, w_uv = torch.randn(heads, nope, latent, generator=g) * 0.2, torch.randn(heads, latent, v_dim, generator=g)
    attention = LatentAttention(heads, latent, rope, nope, v_dim, (nope + rope) ** -0.5, w_uk, w_uv)
    q = torch.randn(sum(q_lens), heads, nope + rope, generator=g)
    outputs = []
    for min_rows in (10**6, 1):  # absorbed, then expanded
        attention.bind(cache.clone()[None])
        attention.EXPANDED_MIN_ROWS = min_rows
        context = Context(cu, lens, table, slots, cu[1:] - 1, max_q_len, order, q_lens,
                          [q + c for q, c in zip(q_lens, cached)])
        with step_context(context):
            outputs.append(attention.attend(q, rows, rows[..., :latent]))
    assert outputs[0].shape == (sum(q_lens), heads, v_dim) and outputs[0].abs().max() > 0.1
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)
