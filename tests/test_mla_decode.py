"""The flash MLA decode kernel (kernels/tsdev_kernels/ops/mla_decode.py, launched by `mla.mla_decode_triton`) against
the torch reference under Triton's interpreter, on fresh random inputs: ragged lengths across page boundaries, several
splits (shares past a short sequence's end), head blocks of 16 and 64 over a head count that fills neither, the
latent columns in 1, 2 or 4 chunks, either orientation of the products (heads x rows, or rows x heads and latent
columns x heads: `transposed`), V3's widths (512 + 64), an e4m3 cache with a scale that is not 1, this step's rows
stored by the kernel (a padding slot writes nothing), and a negative control: the kernel without the online softmax's
rescale fails. Then its reload check, the TSDEV_MLA_DECODE switch that routes `mla_attention`'s decode rows to it,
and the CUDA tile's chunks (never under 16 latent columns).

Tolerance: float32 q and cache, IEEE products, softmax and sums in float32 in another order than the reference's: a
few float32 ulps of the output (2e-5, as tests/test_mla_kernels.py). bf16 runs on the GPU only (the interpreter's
bf16 products are wrong for `_mla_kernel` too): tests/test_mla_gpu.py's tolerance, `MLA_TOLERANCE`."""
import importlib.util
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import triton

from tsdev_kernels import checks
from tsdev_kernels.ops import mla
from tsdev_kernels.ops.attention import dequantize_kv, quantize_kv

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run in a process without the GPU (tests/test_kernels_interpreter_process.py)")

E4M3 = torch.float8_e4m3fn


def reference(q, cache, cu, lens, table, rows, slots, latent, kv_scale=1.0):
    cache = cache.clone()
    mla.store_latent_ref(rows, cache, slots, kv_scale)
    return mla.mla_attention_ref(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, kv_scale=kv_scale), cache


def flash(q, cache, cu, lens, table, rows, slots, order, latent, **tile):
    return mla.mla_decode_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, order=order,
                                 store=(rows, slots), **tile)


@pytest.mark.parametrize("kv_dtype", [None, E4M3])
@pytest.mark.parametrize("splits, heads, chunks", [(1, 16, 2), (3, 16, 1), (5, 64, 4), (2, 64, 2)])
def test_decode_matches_the_reference_over_ragged_lengths_splits_and_head_blocks(splits, heads, chunks, kv_dtype):
    g = torch.Generator().manual_seed(splits * heads + chunks)
    # 40 heads (head blocks of 16: the third 8/16 full; of 64: 40/64), latent 24 (chunks of a 32 block), rope 8 (of
    # 16); lengths 1 to 70 over pages of 4 in blocks of 16 rows; a one-token sequence leaves every split but one empty
    q, cache, cu, lens, table, rows, slots, order, _, latent = mla.mla_batch(
        [1] * 5, [0, 13, 37, 6, 69], 40, 24, 8, 4, torch.float32, "cpu", g, kv_dtype)
    slots[3] = -1  # a graph's padding row: writes nothing (its own output is unspecified)
    want, want_cache = reference(q, cache, cu, lens, table, rows, slots, latent)
    got = flash(q, cache, cu, lens, table, rows, slots, order, latent, num_splits=splits, heads=heads, block_n=16,
                chunks=chunks)
    assert torch.equal(cache.float(), want_cache.float())
    keep = torch.arange(5) != 3
    torch.testing.assert_close(got[keep], want[keep], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [None, E4M3])
def test_decode_at_v3s_widths_with_few_heads(kv_dtype):
    """Latent 512 + rope 64 as DeepSeek-V3 (BLOCK_L and BLOCK_R without padding), 4 heads, pages of 16, blocks of 32
    rows, two chunks of 256 columns."""
    g = torch.Generator().manual_seed(17)
    q, cache, cu, lens, table, rows, slots, order, _, latent = mla.mla_batch(
        [1] * 3, [5, 70, 33], 4, 512, 64, 16, torch.float32, "cpu", g, kv_dtype)
    want, want_cache = reference(q, cache, cu, lens, table, rows, slots, latent)
    got = flash(q, cache, cu, lens, table, rows, slots, order, latent, num_splits=2, block_n=32, chunks=2)
    assert torch.equal(cache.float(), want_cache.float())
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_an_e4m3_cache_with_a_scale_is_dequantized_by_it_and_the_rows_stored_quantized_by_it(splits):
    g = torch.Generator().manual_seed(23 + splits)
    scale = 0.37
    q, cache, cu, lens, table, rows, slots, order, _, latent = mla.mla_batch(
        [1] * 4, [2, 13, 37, 20], 6, 24, 8, 4, torch.float32, "cpu", g, E4M3)
    cache = quantize_kv(torch.randn(cache.shape, generator=g) * 3, scale, E4M3)
    rows = dequantize_kv(quantize_kv(torch.randn(rows.shape, generator=g) * 3, scale, E4M3), scale)  # on its grid
    want, want_cache = reference(q, cache, cu, lens, table, rows, slots, latent, scale)
    got = flash(q, cache, cu, lens, table, rows, slots, order, latent, num_splits=splits, kv_scale=scale,
                block_n=16)
    assert torch.equal(cache.float(), want_cache.float())
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    unscaled = flash(q, cache, cu, lens, table, rows, slots, order, latent, num_splits=splits, block_n=16)
    assert not torch.allclose(unscaled, want, atol=1e-2, rtol=1e-2)  # the scale matters at these values


def test_without_the_online_softmaxs_rescale_the_kernel_fails(tmp_path, monkeypatch):
    """The negative control: the same kernel, its accumulator no longer rescaled when a block raises the running
    maximum, is wrong on sequences of several blocks (so the tests above see the rescale)."""
    source = Path(mla.__file__).with_name("mla_decode.py").read_text()
    rescale = "acc[i] * alpha[:, None]"
    assert source.count(rescale) == 1
    path = tmp_path / "mla_decode_without_rescale.py"
    path.write_text(source.replace(rescale, "acc[i]"))
    spec = importlib.util.spec_from_file_location("mla_decode_without_rescale", path)
    edited = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(edited)
    g = torch.Generator().manual_seed(29)
    q, cache, cu, lens, table, rows, slots, order, _, latent = mla.mla_batch(
        [1] * 3, [40, 70, 55], 6, 24, 8, 4, torch.float32, "cpu", g)
    want, _ = reference(q, cache, cu, lens, table, rows, slots, latent)
    torch.testing.assert_close(flash(q, cache, cu, lens, table, rows, slots, order, latent, num_splits=1,
                                     block_n=16), want, atol=2e-5, rtol=2e-5)
    monkeypatch.setattr(mla, "_mla_decode_kernel", edited._mla_decode_kernel)
    got = flash(q, cache, cu, lens, table, rows, slots, order, latent, num_splits=1, block_n=16)
    assert not torch.allclose(got, want, atol=1e-2, rtol=1e-2)


def test_the_check_runs_at_a_latent_models_shapes_and_a_wrong_scale_fails():
    by_op = {c.op: c for c in checks.declared()}
    serving = checks.Serving(tokens=(3, 20), hidden=64, intermediate=128, dtype=torch.float32, q_heads=4,
                             latent_dim=32, rope_dim=8, max_context=60, device="cpu")
    check = by_op["mla_decode_flash"]
    assert check.kernels == ("_mla_decode_kernel", "_mla_merge_kernel")
    assert "tsdev_kernels.ops.mla_decode" in checks.modules_reached(check)  # an edit of the kernel reaches it
    assert check.shapes(serving) == [(3, 4, 32, 8, 16, 60), (20, 4, 32, 8, 16, 60)]
    assert checks.run(check, check.shapes(serving)[0], torch.float32, "cpu").ok
    fp8 = by_op["mla_decode_flash_fp8"]
    assert fp8.shapes(serving) == [] and checks.run(fp8, fp8.shapes(replace(serving, kv_fp8=True))[0],
                                                    torch.float32, "cpu").ok

    def wrong(q, cache, cu, lens, table, rows, slots, order, max_q_len, latent):
        return mla.mla_decode_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5 * 1.05, latent, order=order,
                                     store=(rows, slots))

    assert not checks.run(replace(check, kernel=wrong), (3, 4, 32, 8, 16, 60), torch.float32, "cpu").ok


@pytest.mark.parametrize("switch", ["tiles", "flash", "auto"])
def test_the_switch_routes_decode_steps_and_a_mixed_steps_decode_rows(monkeypatch, switch):
    """TSDEV_MLA_DECODE (read into mla.MLA_DECODE) picks the kernel of `mla_attention`'s decode rows: a decode step's,
    and a mixed step's leading one-row sequences; the prompts stay on the prefill tiles. auto, off a Hopper GPU (the
    Gluon kernel's), takes the Triton flash kernel."""
    from tsdev_kernels.ops.attention import split_order

    monkeypatch.setattr(mla, "use_triton", lambda x, family: True)  # the Triton paths, interpreted
    monkeypatch.setattr(mla, "MLA_DECODE", switch)
    launched = []
    for name in ("mla_decode_triton", "mla_attention_triton"):
        kernel = getattr(mla, name)
        monkeypatch.setattr(mla, name, lambda *a, kernel=kernel, name=name, **kw: launched.append(
            (name, a[7] if len(a) > 7 else kw.get("max_q_len", 1))) or kernel(*a, **kw))
    g = torch.Generator().manual_seed(31)
    for q_lens, cached in (([1, 1, 1], [9, 25, 4]), ([1, 1, 21, 18], [9, 25, 30, 0])):
        launched.clear()
        q, cache, cu, lens, table, rows, slots, _, max_q_len, latent = mla.mla_batch(
            q_lens, cached, 3, 32, 8, 4, torch.float32, "cpu", g)
        decodes, order = split_order(q_lens, [c + n for c, n in zip(cached, q_lens)])
        want, want_cache = reference(q, cache, cu, lens, table, rows, slots, latent)
        got = mla.mla_attention(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, max_q_len=max_q_len,
                                store=(rows, slots), order=torch.tensor(order), decodes=decodes)
        decode = "mla_attention_triton" if switch == "tiles" else "mla_decode_triton"
        assert launched[0] == (decode, 1) and launched[1:] == ([] if max_q_len == 1 else [("mla_attention_triton",
                                                                                           max_q_len)])
        assert torch.equal(cache, want_cache)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_gluon_asked_for_where_it_cannot_run_fails_saying_why_and_what_to_set(monkeypatch):
    monkeypatch.setattr(mla, "use_triton", lambda x, family: True)
    monkeypatch.setattr(mla, "MLA_DECODE", "gluon")
    q, cache, cu, lens, table, rows, slots, _, _, latent = mla.mla_batch(
        [1, 1], [9, 25], 3, 32, 8, 4, torch.float32, "cpu", torch.Generator().manual_seed(37))
    with pytest.raises(ValueError, match="TSDEV_MLA_DECODE=gluon.*Hopper.*flash"):
        mla.mla_attention(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, max_q_len=1, store=(rows, slots))
    with pytest.raises(ValueError, match="Hopper"):
        mla.mla_decode_gluon(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent)


def test_an_unknown_switch_value_fails_at_import_naming_the_variable():
    env = os.environ | {"TSDEV_MLA_DECODE": "fast"}
    result = subprocess.run([sys.executable, "-c", "import tsdev_kernels.ops.mla"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "TSDEV_MLA_DECODE='fast'" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "e4m3"])
def test_the_cuda_tile_never_cuts_the_latent_into_chunks_under_16_columns(quantized):
    """A tensor-core product takes K and N of 16 at least: a small model's latent keeps whole 16-column chunks (the
    bf16 tile's 4 chunks of a 32-column latent did not compile for sm_90), V3's keeps the timed tile."""
    for latent in (16, 24, 32, 64, 128, 512):
        tile = mla.flash_tile(quantized, latent)
        assert triton.next_power_of_2(latent) // tile["chunks"] >= 16, (latent, tile)
    assert mla.flash_tile(quantized, 512) == mla.CUDA_FLASH_TILES[quantized]
    assert mla.flash_tile(quantized, 32)["chunks"] == min(2, mla.CUDA_FLASH_TILES[quantized]["chunks"])
