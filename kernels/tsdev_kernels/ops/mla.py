"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, in the absorbed form.

Cache layout, per layer: [num_pages, page_size, 1, L + R], each token's latent (kv_lora_rank L values, after
kv_a_layernorm) then its rotated rope key (qk_rope_head_dim R values), shared by every head: 576 values per token and
layer for DeepSeek-V3 (a GQA model of its size would store 2 x 128 heads x 128). A slot is page * page_size + offset,
-1 a padding row that writes nothing, as in attention.py.

The absorbed form: head h's nope key is W_UK[h] @ latent and its value W_UV[h] @ latent (W_UK, W_UV: kv_b_proj's
rows of that head), so q_nope . k_nope = (W_UK[h]^T q_nope) . latent. The caller multiplies each head's q_nope into
the latent space first and passes q = [q_latent | q_pe] (L + R values per head); attention then runs as multi-query
attention with one key [latent | k_pe] and one value `latent` per token, and the caller multiplies the output (L
values per head) by W_UV[h]. The kernels never see W_UK or W_UV (`LatentAttention` in
runtime/tsdev_runtime/layers/attention.py applies them; it expands long prompts instead, docs/mla.md).

Triton (CUDA; the tests run it under the interpreter), one kernel for every step: a program owns a tile of (query row,
head) pairs, HEADS heads of QUERIES rows of one sequence, and one of `num_splits` shares of the keys its rows can see.
It streams that share's cache rows in blocks of BLOCK_N through the page table, the latent and the rope part loaded
apart (512 + 64 columns, not one block padded to 1024), with an online softmax in float32; every head of the tile
reads each cache row once. Decode steps (max_q_len == 1) take heads of one row per tile (16 off CUDA; on CUDA
`decode_tile`'s: every head of the row against half the latent columns) and cut each sequence into splits
(flash-decoding) so that batch 1 at a long context fills the GPU, and store this step's rows themselves (the programs
whose share holds a row's position); a second launch merges the splits by their log-sum-exp (a decode tile may also be
transposed, `mla_attention_triton`'s `transposed`: cache rows x heads, for the sweep). Prefill steps take 16 rows of
one head per tile, causal, the cached prefix first (row j of a query of q_len sits at position seq_len - q_len + j),
no splits. The grid depends on the batch size and head count only (graph-safe); `num_splits` and the page table's
width are not specialised on (module docstring of attention.py says why). The CUDA tiles are the H200 sweep's best
(`CUDA_DECODE_TILES`; docs/mla.md, docs/benchmarks.md).

A second decode kernel, in FlashMLA's structure (mla_decode.py: 64 heads of a row per program against every latent
column, q loaded once, blocks of 64 cached rows, the scores computed once per block; `mla_decode_triton`:
`mla_attention_triton`'s contract for decode, merged by the same `_mla_merge_kernel`), took 0.55-0.80x the decode
tiles' time on an H100; the same structure in Gluon (mla_decode_gluon.py: wgmma, both warpgroups sharing the scores
through shared memory; `mla_decode_gluon`) took 0.68-0.91x the Triton one's (benchmarks/mla_decode.py, docs/mla.md).
Which serves decode steps: TSDEV_MLA_DECODE (`decode_kernel`).
"""
import functools
import os

import torch
import triton
import triton.language as tl

from tsdev_kernels.checks import KernelCheck, nbytes
from tsdev_kernels.ops import sm_count, use_triton
from tsdev_kernels.ops.attention import (ATTENTION_TOLERANCE, FP8_KV_DTYPE, LOG2E, PagedSteps, _quantized,
                                         decode_step, dequantize_kv, keys_seen, mixed_step, quantize_kv)
from tsdev_kernels.ops.mla_decode import _mla_decode_kernel, _store_own_row
from tsdev_kernels.ops.mla_decode_gluon import BLOCK_N as GLUON_BLOCK_N
from tsdev_kernels.ops.mla_decode_gluon import HEADS as GLUON_HEADS
from tsdev_kernels.ops.mla_decode_gluon import NUM_WARPS as GLUON_WARPS
from tsdev_kernels.ops.mla_decode_gluon import _mla_decode_gluon_kernel

# Which kernel serves decode steps on CUDA (`decode_kernel`), read when this module is (re)loaded: "auto" (the default:
# the Gluon kernel where it fits and the model has 64 heads or more -- what was timed -- else the Triton flash kernel),
# "gluon" (mla_decode_gluon.py's; an error where it cannot run), "flash" (mla_decode.py's Triton kernel, FlashMLA's
# structure) or "tiles" (`_mla_kernel`'s decode tiles, slower than both at every shape timed on an H100).
MLA_DECODE = os.environ.get("TSDEV_MLA_DECODE", "auto")
MLA_DECODE_CHOICES = ("auto", "gluon", "flash", "tiles")
if MLA_DECODE not in MLA_DECODE_CHOICES:
    raise ValueError(f"TSDEV_MLA_DECODE={MLA_DECODE!r}: expected auto (the default: gluon where it runs, else flash), "
                     "gluon (mla_decode_gluon.py's kernel, Hopper only), flash (mla_decode.py's Triton kernel) or "
                     "tiles (the decode tiles of mla.py's _mla_kernel)")


def store_latent_ref(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0) -> None:
    """rows [T, 1, L + R] into cache [P, page, 1, L + R] at slot_mapping [T] (-1: nothing), quantized in an e4m3
    cache."""
    valid = slot_mapping >= 0
    cache.view(-1, *cache.shape[2:])[slot_mapping[valid]] = quantize_kv(rows[valid], scale, cache.dtype)


def mla_attention_ref(q: torch.Tensor, cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                      page_table: torch.Tensor, scale: float, latent_dim: int, out: torch.Tensor | None = None,
                      kv_scale: float = 1.0) -> torch.Tensor:
    """q [T, H, L + R] -> [T, H, L]: causal attention of each sequence's rows over its cached rows (keys: whole rows,
    values: their first L values), one sequence at a time in float32."""
    T, H, _ = q.shape
    out = q.new_zeros(T, H, latent_dim) if out is None else out.zero_()
    page_size = cache.shape[1]
    for i, (start, end, seq_len) in enumerate(zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(),
                                                  seq_lens.tolist())):
        q_len = end - start
        if q_len == 0:
            continue
        pages = page_table[i, : -(-seq_len // page_size)].long()
        rows = dequantize_kv(cache[pages].flatten(0, 1)[:seq_len, 0], kv_scale)  # [S, L + R]
        scores = torch.einsum("qhd,kd->hqk", q[start:end].float(), rows) * scale
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,kd->qhd", weights, rows[:, :latent_dim]).to(out.dtype)
    return out


# ---------------------------------------------------------------------------------------------------
# Triton


@triton.jit(do_not_specialize=["SLOTS"])  # attention.py's module docstring says why
def _store_latent_kernel(ROWS, CACHE, SLOTS, stride_rt, stride_cp, stride_cs, scale, WIDTH: tl.constexpr,
                         PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, QUANTIZED: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        row = tl.load(ROWS + t * stride_rt + cols, mask=cols < WIDTH)
        if QUANTIZED:
            row = _quantized(row, scale, CACHE)
        tl.store(CACHE + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs + cols, row,
                 mask=cols < WIDTH)


def store_latent_triton(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0):
    T, _, width = rows.shape
    if T == 0:
        return
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    _store_latent_kernel[(T,)](rows, cache, slot_mapping, rows.stride(0), cache.stride(0), cache.stride(1), scale,
                               WIDTH=width, PAGE_SIZE=cache.shape[1], BLOCK=triton.next_power_of_2(width),
                               QUANTIZED=cache.dtype == FP8_KV_DTYPE, num_warps=4)


@triton.jit(do_not_specialize=["stride_pt", "num_splits", "ORDER", "SLOTS"])  # attention.py's module docstring says why
def _mla_kernel(
    Q, CACHE, O, PART_O, PART_LSE, CU, SEQ_LENS, PAGE_TABLE, ORDER, ROWS, SLOTS,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_cs, stride_pt, stride_rt, H, num_splits,
    kv_scale, LATENT: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, QUERIES: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    STORE: tl.constexpr, ORDERED: tl.constexpr, PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
    COLUMNS: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    # axis 0: a block of heads and, when COLUMNS < BLOCK_L, which COLUMNS of the latent output this program sums
    # (every program computes the whole scores; fewer columns each leave room for more heads per tile)
    head_block = tl.program_id(0) // (BLOCK_L // COLUMNS)
    c0 = tl.program_id(0) % (BLOCK_L // COLUMNS) * COLUMNS
    m_block = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    b = tl.program_id(2)
    if ORDERED:
        b = tl.load(ORDER + b).to(tl.int32)
    q_start = tl.load(CU + b)
    q_len = tl.load(CU + b + 1) - q_start
    if m_block * QUERIES < q_len:  # the grid covers the longest query; shorter ones leave programs idle
        seq_len = tl.load(SEQ_LENS + b)
        r = tl.arange(0, QUERIES * HEADS)  # the tile's (query row, head) pairs, a row's heads side by side
        m = m_block * QUERIES + r // HEADS
        h = head_block * HEADS + r % HEADS
        live = (m < q_len) & (h < H)
        t = (q_start + m).to(tl.int64)
        lat = tl.arange(0, BLOCK_L)
        rot = tl.arange(0, BLOCK_R)
        q_row = Q + t[:, None] * stride_qt + h[:, None] * stride_qh
        q_lat = tl.load(q_row + lat[None, :], mask=live[:, None] & (lat < LATENT)[None, :], other=0.0)
        q_rot = tl.load(q_row + LATENT + rot[None, :], mask=live[:, None] & (rot < ROPE)[None, :], other=0.0)
        pos = seq_len - q_len + m  # each row's position: the cached prefix comes first
        end = tl.minimum(seq_len, seq_len - q_len + (m_block + 1) * QUERIES)  # causal: nothing past the last row
        chunk = tl.cdiv(tl.cdiv(end, num_splits), BLOCK_N) * BLOCK_N  # this split's share, in whole blocks
        start = split * chunk
        stop = tl.minimum(start + chunk, end)
        if STORE:  # decode: this step's row, stored by the programs whose share holds its position
            _store_own_row(CACHE, ROWS, SLOTS, q_start, seq_len, start, stop, stride_rt, stride_cp, stride_cs,
                           kv_scale, LATENT, ROPE, PAGE_SIZE, BLOCK_L, BLOCK_R, QUANTIZED)

        m_i = tl.full([QUERIES * HEADS], float("-inf"), tl.float32)
        l_i = tl.zeros([QUERIES * HEADS], tl.float32)
        if TRANSPOSED:  # the output transposed: latent columns down, (row, head) pairs across
            acc = tl.zeros([COLUMNS, QUERIES * HEADS], tl.float32)
        else:
            acc = tl.zeros([QUERIES * HEADS, COLUMNS], tl.float32)
        col = c0 + tl.arange(0, COLUMNS)  # the latent columns of the output this program sums
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < stop
            page = tl.load(PAGE_TABLE + b * stride_pt + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            cache_row = CACHE + (page * stride_cp + (n % PAGE_SIZE) * stride_cs)[:, None]
            k_lat = tl.load(cache_row + lat[None, :], mask=n_mask[:, None] & (lat < LATENT)[None, :], other=0.0)
            k_rot = tl.load(cache_row + LATENT + rot[None, :], mask=n_mask[:, None] & (rot < ROPE)[None, :],
                            other=0.0)
            if QUANTIZED:  # e4m3 rows to q's dtype, exactly; the scale is in scale_log2 and applied to acc
                k_lat = k_lat.to(Q.dtype.element_ty)
                k_rot = k_rot.to(Q.dtype.element_ty)
            if TRANSPOSED:  # keys down, pairs across: the cache rows are the tensor cores' M, the heads their N
                s = tl.dot(k_lat, tl.trans(q_lat), input_precision=PRECISION)
                s += tl.dot(k_rot, tl.trans(q_rot), input_precision=PRECISION)
                s = tl.where(n_mask[:, None] & (n[:, None] <= pos[None, :]), s * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=0))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[None, :])
                l_i = l_i * alpha + tl.sum(p, axis=0)
            else:
                s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
                s += tl.dot(q_rot, tl.trans(k_rot), input_precision=PRECISION)
                s = tl.where(n_mask[None, :] & (n[None, :] <= pos[:, None]), s * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
            if COLUMNS == BLOCK_L:  # the values are the rows' latent part, just loaded
                v = k_lat
            else:  # its COLUMNS (from L1: just read for the scores)
                v = tl.load(cache_row + col[None, :], mask=n_mask[:, None] & (col < LATENT)[None, :], other=0.0)
                if QUANTIZED:
                    v = v.to(Q.dtype.element_ty)
            if TRANSPOSED:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(v.dtype), input_precision=PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if QUANTIZED:
            acc = acc * kv_scale
        part = (b * H + h) * num_splits + split  # each (row, head) pair's partial row of a split
        out_row = t * stride_ot + h * stride_oh  # and its output row, unsplit
        if TRANSPOSED:  # the pairs along acc's second axis, the latent columns down
            part_2d, row_2d, l_2d, live_2d = part[None, :], out_row[None, :], l_i[None, :], live[None, :]
            column = col[:, None]
        else:
            part_2d, row_2d, l_2d, live_2d = part[:, None], out_row[:, None], l_i[:, None], live[:, None]
            column = col[None, :]
        out_mask = live_2d & (column < LATENT)
        if SPLIT:  # partial result + its log2-sum-exp; a share past the sequence's end has l_i == 0, writes -inf
            tl.store(PART_O + part_2d * LATENT + column, acc / tl.maximum(l_2d, 1e-30), mask=out_mask)
            tl.store(PART_LSE + part, tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf")),
                     mask=live)
        else:
            tl.store(O + row_2d + column, (acc / l_2d).to(O.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_merge_kernel(PART_O, PART_LSE, O, CU, stride_ot, stride_oh, H, num_splits, LATENT: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):
    """One program per (sequence, head, BLOCK_L latent columns) of a decode step: the splits' partial outputs weighted
    by their sums, every split's columns read at once (a [BLOCK_S, BLOCK_L] tile: a loop over the splits paid a
    memory latency per split, most of a batch-1 step's merge)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(CU + b)
    if tl.load(CU + b + 1) > row:  # a sequence with no row this step has nothing to merge
        s = tl.arange(0, BLOCK_S)
        lat = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
        first = (b * H + h) * num_splits
        lse = tl.load(PART_LSE + first + s, mask=s < num_splits, other=float("-inf"))
        weight = tl.exp2(lse - tl.max(lse, axis=0))  # an empty share (and a missing split): 0
        parts = tl.load(PART_O + (first + s).to(tl.int64)[:, None] * LATENT + lat[None, :],
                        mask=(s < num_splits)[:, None] & (lat < LATENT)[None, :], other=0.0)
        out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(O + row.to(tl.int64) * stride_ot + h * stride_oh + lat, out.to(O.dtype.element_ty),
                 mask=lat < LATENT)


MERGE_TILE = 4096  # float32 partials a merge program reads at once (splits x latent columns)


DECODE_HEADS, PREFILL_QUERIES = 16, 16  # the tiles off CUDA: heads of one decode row; rows of one prefill head
# KV rows per block and warps of a prefill tile on CUDA: at V3's shapes the largest that compile for sm_90 without
# register spills with a bf16 and with an e4m3 cache (4 warps spill with e4m3: 255 registers;
# tests/test_kernel_configs.py)
CUDA_TILE = dict(block_n=32, num_warps=8)
# A decode tile on CUDA, by cache dtype: every head of a row (up to 128) against half the latent columns, the best of
# `benchmarks/mla_decode.py --sweep` on the H200 at V3's shapes, context 4096 (2026-12-05; docs/benchmarks.md): at batch
# 64, 615 us with a bf16 cache (16 heads x 512 columns, 32 rows, had 1319 us; 32 rows spill at 128 heads) and 532 us
# with an e4m3 cache (2015 us); at batch 1, 28.6 and 28.3 us (40.1 and 51.8)
CUDA_DECODE_TILES = {False: dict(heads=128, columns=256, block_n=16, num_warps=8),
                     True: dict(heads=128, columns=256, block_n=32, num_warps=8)}


def decode_tile(heads: int, quantized: bool) -> dict[str, int]:
    """The decode tile on CUDA for a model with `heads` query heads and a bf16 (or e4m3: quantized) latent cache."""
    tile = CUDA_DECODE_TILES[quantized]
    return tile | dict(heads=min(tile["heads"], triton.next_power_of_2(heads)))


def mla_splits(batch: int, heads: int, device: torch.device) -> int:
    """KV splits per sequence of a decode step: about 4 programs per SM (at most 64), from shapes only (graph-safe);
    2 off CUDA (the interpreter tests)."""
    if device.type != "cuda":
        return 2
    programs = batch * triton.cdiv(heads, DECODE_HEADS)  # (a sweep's other tile sizes keep these splits)
    return max(1, min(64, triton.cdiv(4 * sm_count(device.index or 0), programs)))


def decode_batch(launcher: str, q: torch.Tensor, seq_lens: torch.Tensor, order: torch.Tensor | None,
                 out: torch.Tensor | None, latent_dim: int, max_q_len: int) -> tuple[int, torch.Tensor]:
    """A decode launcher's sequences and its output [T, H, latent_dim] (`out`, else new); ValueError for a step that
    is no decode step (max_q_len other than 1)."""
    if max_q_len != 1:
        raise ValueError(f"{launcher} runs decode steps (max_q_len 1), not max_q_len {max_q_len}")
    out = q.new_empty(*q.shape[:2], latent_dim) if out is None else out
    return (seq_lens.shape[0] if order is None else order.shape[0]), out


def stored_rows(q: torch.Tensor, cu_seqlens_q: torch.Tensor,
                store: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (rows, slot_mapping) a decode launch stores (their last dim contiguous), or placeholders it does not read
    (STORE off)."""
    rows, slots = store if store is not None else (q, cu_seqlens_q)
    return (rows if rows.stride(-1) == 1 else rows.contiguous()), slots


def split_partials(q: torch.Tensor, batch: int, num_splits: int, latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split decode launches' partial outputs [B, H, splits, latent] and log2-sum-exps [B, H, splits] (float32;
    unsplit, placeholders the kernels do not touch)."""
    heads, split = q.shape[1], num_splits > 1
    return (q.new_empty((batch, heads, num_splits, latent_dim) if split else (1,), dtype=torch.float32),
            q.new_empty((batch, heads, num_splits) if split else (1,), dtype=torch.float32))


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 batch: int, num_splits: int) -> None:
    """`_mla_merge_kernel`: each (sequence, head)'s splits into its output row, weighted by their log-sum-exps."""
    heads, latent_dim = out.shape[1], out.shape[2]
    block_s = triton.next_power_of_2(num_splits)
    block_l = min(triton.next_power_of_2(latent_dim), max(16, MERGE_TILE // block_s))
    _mla_merge_kernel[(batch, heads, triton.cdiv(latent_dim, block_l))](
        part_o, part_lse, out, cu_seqlens_q, out.stride(0), out.stride(1), heads, num_splits, LATENT=latent_dim,
        BLOCK_S=block_s, BLOCK_L=block_l, num_warps=4)


def mla_attention_triton(q: torch.Tensor, cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                         page_table: torch.Tensor, scale: float, latent_dim: int, max_q_len: int,
                         out: torch.Tensor | None = None, num_splits: int | None = None,
                         order: torch.Tensor | None = None, kv_scale: float = 1.0, block_n: int | None = None,
                         heads: int | None = None, num_warps: int | None = None, columns: int | None = None,
                         store: tuple[torch.Tensor, torch.Tensor] | None = None,
                         transposed: bool = False) -> torch.Tensor:
    """`mla_attention_ref` in one launch (prefill) or two (decode: the splits, then their merge). store = (rows,
    slot_mapping), decode only: this step's rows are written by the attention kernel itself (one launch fewer per
    layer). block_n, heads (a decode tile's), columns (of the latent output per program: a power of two; default
    all), num_warps and transposed (the tile's products as cache rows x heads, not heads x cache rows: the rows
    are the tensor cores' M, the heads their N): the configuration, for benchmarks/mla_decode.py's sweep; a decode
    step on CUDA given none of them takes `decode_tile`'s. An order shorter than the batch runs only the sequences
    it names."""
    B = seq_lens.shape[0] if order is None else order.shape[0]
    T, H, width = q.shape
    out = q.new_empty(T, H, latent_dim) if out is None else out
    if B == 0 or max_q_len == 0:
        return out
    decode = max_q_len == 1
    if num_splits is None:
        num_splits = mla_splits(B, H, q.device) if decode else 1
    if (num_splits > 1 or store is not None) and not decode:
        raise ValueError("splitting the keys and storing the rows in the kernel are for decode steps (max_q_len 1)")
    rows, slots = stored_rows(q, cu_seqlens_q, store)
    quantized = cache.dtype == FP8_KV_DTYPE
    if decode and q.is_cuda and heads is None and columns is None and block_n is None and num_warps is None:
        tile = decode_tile(H, quantized)
        heads, columns, block_n, num_warps = tile["heads"], tile["columns"], tile["block_n"], tile["num_warps"]
    queries, heads = (1, heads or DECODE_HEADS) if decode else (PREFILL_QUERIES, 1)
    split = num_splits > 1
    part_o, part_lse = split_partials(q, B, num_splits, latent_dim)
    block_l = triton.next_power_of_2(latent_dim)
    columns = min(columns or block_l, block_l)
    _mla_kernel[(triton.cdiv(H, heads) * (block_l // columns), triton.cdiv(max_q_len, queries) * num_splits, B)](
        q, cache, out, part_o, part_lse, cu_seqlens_q, seq_lens, page_table, order if order is not None else seq_lens,
        rows, slots, scale * LOG2E * (kv_scale if quantized else 1.0), q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), cache.stride(0), cache.stride(1), page_table.stride(0), rows.stride(0), H, num_splits, kv_scale,
        LATENT=latent_dim, ROPE=width - latent_dim, PAGE_SIZE=cache.shape[1], QUERIES=queries, HEADS=heads,
        BLOCK_L=block_l, BLOCK_R=max(16, triton.next_power_of_2(width - latent_dim)),
        BLOCK_N=block_n or (CUDA_TILE["block_n"] if q.is_cuda else 16), SPLIT=split, STORE=store is not None,
        ORDERED=order is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANTIZED=quantized,
        COLUMNS=columns, TRANSPOSED=transposed, num_warps=num_warps or (CUDA_TILE["num_warps"] if q.is_cuda else 1),
        num_stages=2,
    )
    if split:
        merge_splits(part_o, part_lse, out, cu_seqlens_q, B, num_splits)
    return out


# The flash decode kernel's tile on CUDA, by cache dtype (mla_decode.py): 64 heads (a warpgroup's rows), blocks of 64
# cached rows, the latent columns in `chunks` chunks, 8 warps. The fastest of benchmarks/mla_decode.py's tiles on an
# H100 (2026-12-07, 128 heads, context 4096, Triton 3.6; docs/mla.md): bf16 cache, 4 chunks: 20.6 / 314 / 1235 us at
# batch 1 / 64 / 256 (2 chunks 21.7 / 329 / 1286, 1 chunk 23.1 / 348 / 1365); e4m3, 1 chunk: 24.4 / 365 / 1429
# (4 chunks 24.8 / 404 / 1590). Blocks of 32 rows and 128 heads per program were slower at every batch. Compiled
# for sm_90 (Triton 3.9, tests/test_mla_decode_compile.py): 255 registers, 208 bytes spilled with bf16 (216 KiB of
# shared memory), 376 with e4m3 (172 KiB).
CUDA_FLASH_TILES = {False: dict(heads=64, block_n=64, chunks=4, num_warps=8),
                    True: dict(heads=64, block_n=64, chunks=1, num_warps=8)}
FLASH_MAX_SPLITS = 32  # at batch 1 each split writes 128 heads x 512 float32 (256 KiB) for the merge to read


def flash_splits(batch: int, heads: int, device: torch.device, tile_heads: int = 64) -> int:
    """KV splits per sequence of the flash decode kernel: about one program per SM (one program fills an SM's
    shared memory), at most FLASH_MAX_SPLITS, from shapes only (graph-safe); 2 off CUDA (the interpreter tests)."""
    if device.type != "cuda":
        return 2
    programs = batch * triton.cdiv(heads, tile_heads)
    return max(1, min(FLASH_MAX_SPLITS, sm_count(device.index or 0) // programs))


def flash_tile(quantized: bool, latent_dim: int, cuda: bool = True) -> dict:
    """The flash decode kernel's tile: `CUDA_FLASH_TILES`' on CUDA (off it a small one, for the interpreter), in no
    more chunks than leave each 16 latent columns -- a chunk is the K of the scores' products and the N of the
    output's, and the tensor cores take no fewer (a small model's latent: 32 columns in 4 chunks did not compile)."""
    tile = (CUDA_FLASH_TILES[quantized] if cuda else
            dict(heads=16, block_n=16, chunks=2, num_warps=4))
    return {**tile, "chunks": min(tile["chunks"], max(1, triton.next_power_of_2(latent_dim) // 16))}


def mla_decode_triton(q: torch.Tensor, cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                      page_table: torch.Tensor, scale: float, latent_dim: int, max_q_len: int = 1,
                      out: torch.Tensor | None = None, num_splits: int | None = None,
                      order: torch.Tensor | None = None, kv_scale: float = 1.0,
                      store: tuple[torch.Tensor, torch.Tensor] | None = None, heads: int | None = None,
                      block_n: int | None = None, chunks: int | None = None,
                      num_warps: int | None = None) -> torch.Tensor:
    """A decode step's `mla_attention_ref` by mla_decode.py's kernel (the splits, then `_mla_merge_kernel`):
    `mla_attention_triton`'s contract for max_q_len 1, storing this step's rows when store = (rows, slot_mapping).
    heads (per program: a power of two), block_n, chunks (of the latent columns) and num_warps: the tile, for
    benchmarks/mla_decode.py; left out, `flash_tile`'s."""
    B, out = decode_batch("mla_decode_triton", q, seq_lens, order, out, latent_dim, max_q_len)
    T, H, width = q.shape
    if B == 0:
        return out
    quantized = cache.dtype == FP8_KV_DTYPE
    tile = flash_tile(quantized, latent_dim, q.is_cuda)
    heads = min(heads or tile["heads"], max(16, triton.next_power_of_2(H)))
    num_splits = num_splits or flash_splits(B, H, q.device, heads)
    rows, slots = stored_rows(q, cu_seqlens_q, store)
    split = num_splits > 1
    part_o, part_lse = split_partials(q, B, num_splits, latent_dim)
    _mla_decode_kernel[(triton.cdiv(H, heads), num_splits, B)](
        q, cache, out, part_o, part_lse, cu_seqlens_q, seq_lens, page_table, order if order is not None else seq_lens,
        rows, slots, scale * LOG2E * (kv_scale if quantized else 1.0), q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), cache.stride(0), cache.stride(1), page_table.stride(0), rows.stride(0), H, num_splits, kv_scale,
        LATENT=latent_dim, ROPE=width - latent_dim, PAGE_SIZE=cache.shape[1], HEADS=heads,
        BLOCK_L=triton.next_power_of_2(latent_dim), BLOCK_R=max(16, triton.next_power_of_2(width - latent_dim)),
        CHUNKS=chunks or tile["chunks"], BLOCK_N=block_n or tile["block_n"], SPLIT=split, STORE=store is not None,
        ORDERED=order is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANTIZED=quantized,
        num_warps=num_warps or tile["num_warps"], num_stages=2,
    )
    if split:
        merge_splits(part_o, part_lse, out, cu_seqlens_q, B, num_splits)
    return out


GLUON_MAX_WIDTH = 576  # latent + rope: q, two stages of a block and P fill 224 of the H100's 227 KiB of shared memory


@functools.lru_cache(maxsize=16)
def on_hopper(device: torch.device | None = None) -> bool:
    """Whether `device` (default: the current CUDA device) is a Hopper GPU (sm_90: H100, H200)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9


def gluon_shape_misfit(dtype: torch.dtype, kv_dtype: torch.dtype, latent_dim: int, rope_dim: int) -> str | None:
    """Why mla_decode_gluon.py's kernel cannot take these dtypes and widths (None: it can): bf16 or fp16 queries over
    a cache of their dtype or e4m3, a latent and a rope part in powers of two (latent >= 256, rope >= 16) of at most
    GLUON_MAX_WIDTH together."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"its products take bf16 or fp16 queries, not {dtype}"
    if kv_dtype not in (dtype, FP8_KV_DTYPE):
        return f"a {kv_dtype} cache with {dtype} queries"
    if latent_dim & (latent_dim - 1) or rope_dim & (rope_dim - 1) or latent_dim < 256 or rope_dim < 16:
        return f"latent {latent_dim} and rope {rope_dim} must be powers of two (at least 256 and 16)"
    if latent_dim + rope_dim > GLUON_MAX_WIDTH:
        return f"latent + rope {latent_dim + rope_dim} is over {GLUON_MAX_WIDTH} (its blocks fill the shared memory)"
    return None


def gluon_misfit(q: torch.Tensor, cache: torch.Tensor, latent_dim: int) -> str | None:
    """Why mla_decode_gluon.py's kernel cannot serve this decode step (None: it can): it runs on Hopper (sm_90:
    wgmma), on `gluon_shape_misfit`'s dtypes and widths, with contiguous last dims."""
    if not q.is_cuda or not on_hopper(q.device):
        return "it runs on Hopper GPUs (sm_90: H100, H200) only"
    if why := gluon_shape_misfit(q.dtype, cache.dtype, latent_dim, q.shape[-1] - latent_dim):
        return why
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        return "q's and the cache's last dims must be contiguous"
    return None


def mla_decode_gluon(q: torch.Tensor, cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                     page_table: torch.Tensor, scale: float, latent_dim: int, max_q_len: int = 1,
                     out: torch.Tensor | None = None, num_splits: int | None = None,
                     order: torch.Tensor | None = None, kv_scale: float = 1.0,
                     store: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`mla_decode_triton`'s contract by mla_decode_gluon.py's kernel (one tile: 64 heads, blocks of 64 rows, 8 warps),
    the splits then `_mla_merge_kernel`. ValueError, saying why, where `gluon_misfit` finds it cannot run."""
    B, out = decode_batch("mla_decode_gluon", q, seq_lens, order, out, latent_dim, max_q_len)
    if why := gluon_misfit(q, cache, latent_dim):
        raise ValueError(f"mla_decode_gluon: {why}; TSDEV_MLA_DECODE=flash serves the Triton kernel instead")
    T, H, width = q.shape
    if B == 0:
        return out
    quantized = cache.dtype == FP8_KV_DTYPE
    num_splits = num_splits or flash_splits(B, H, q.device, GLUON_HEADS)
    rows, slots = stored_rows(q, cu_seqlens_q, store)
    split = num_splits > 1
    part_o, part_lse = split_partials(q, B, num_splits, latent_dim)
    _mla_decode_gluon_kernel[(triton.cdiv(H, GLUON_HEADS), num_splits, B)](
        q, cache, out, part_o, part_lse, cu_seqlens_q, seq_lens, page_table, order if order is not None else seq_lens,
        rows, slots, scale * LOG2E * (kv_scale if quantized else 1.0), q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), cache.stride(0), cache.stride(1), page_table.stride(0), rows.stride(0), H, num_splits,
        kv_scale, LATENT=latent_dim, ROPE=width - latent_dim, PAGE_SIZE=cache.shape[1], HEADS=GLUON_HEADS,
        BLOCK_N=GLUON_BLOCK_N, SPLIT=split, STORE=store is not None, ORDERED=order is not None, QUANTIZED=quantized,
        num_warps=GLUON_WARPS,
    )
    if split:
        merge_splits(part_o, part_lse, out, cu_seqlens_q, B, num_splits)
    return out


def decode_kernel(q: torch.Tensor, cache: torch.Tensor, latent_dim: int):
    """The launcher (one contract: `mla_decode_triton`'s) that serves this decode step on CUDA, as TSDEV_MLA_DECODE
    says (MLA_DECODE): auto takes the Gluon kernel where `gluon_misfit` finds nothing against it and the model has
    at least GLUON_HEADS heads (fewer leave most of each program's 64 rows empty), else the Triton flash kernel;
    gluon takes it or raises, saying why."""
    if MLA_DECODE == "tiles":
        return mla_attention_triton
    if MLA_DECODE == "flash":
        return mla_decode_triton
    why = gluon_misfit(q, cache, latent_dim)
    if MLA_DECODE == "gluon":
        if why:
            raise ValueError(f"TSDEV_MLA_DECODE=gluon: the Gluon MLA decode kernel cannot serve this model: {why}; "
                             "unset TSDEV_MLA_DECODE (auto: it serves where it can) or set it to flash")
        return mla_decode_gluon
    return mla_decode_gluon if why is None and q.shape[1] >= GLUON_HEADS else mla_decode_triton


# ---------------------------------------------------------------------------------------------------
# Public op


def store_latent(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0) -> None:
    """rows [T, 1, L + R] into the latent cache at slot_mapping (-1: nothing), quantized in an e4m3 cache."""
    (store_latent_triton if use_triton(rows, "mla") else store_latent_ref)(rows, cache, slot_mapping, scale)


def mla_attention(q: torch.Tensor, cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                  page_table: torch.Tensor, scale: float, latent_dim: int, *, max_q_len: int | None = None,
                  out: torch.Tensor | None = None, store: tuple[torch.Tensor, torch.Tensor] | None = None,
                  order: torch.Tensor | None = None, kv_scale: float = 1.0, decodes: int = 0) -> torch.Tensor:
    """Causal latent attention of a mixed batch over the paged latent cache, this step's rows stored first when
    `store` = (rows [T, 1, L + R], slot_mapping [T]) is given.

    q [T, H, L + R] (last dim contiguous): each head's q_nope multiplied into the latent space, then its rotated q_pe;
    cache [num_pages, page_size, 1, L + R]; cu_seqlens_q, seq_lens, page_table and order as `paged_attention`'s
    (attention.py). Returns [T, H, L] in q's dtype (into `out` when given), softmax in float32. max_q_len: a host int
    (1 takes the decode path); left out it costs a device->host sync. decodes: as attention.paged_attention's (a
    mixed step's leading one-row sequences run as a decode step of them: every head of a row in one tile, where the
    prefill tiles take 16 rows of one head and would read each decode row's cache once per head)."""
    triton_ok = use_triton(q, "mla")
    if triton_ok and max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if seq_lens.numel() else 0
    split = triton_ok and 0 < decodes < seq_lens.shape[0] and order is not None
    decode = decode_kernel(q, cache, latent_dim) if triton_ok and (max_q_len == 1 or split) else None
    if triton_ok and max_q_len == 1:  # the decode kernel stores this step's rows itself
        return decode(q, cache, cu_seqlens_q, seq_lens, page_table, scale, latent_dim, 1, out=out,
                      order=None if seq_lens.shape[0] == 1 else order, kv_scale=kv_scale, store=store)
    if split:  # the decode rows as a decode step of them (storing their rows), then the rest by their batch index
        out = decode(q, cache, cu_seqlens_q[: decodes + 1], seq_lens[:decodes], page_table[:decodes], scale,
                     latent_dim, 1, out=out, order=order[:decodes] if decodes > 1 else None, kv_scale=kv_scale,
                     store=store)
        order = order[decodes:]
        store = store and tuple(t[decodes:] for t in store)  # the decode path stored the first `decodes` rows
    if store is not None:
        rows, slot_mapping = store
        store_latent(rows, cache, slot_mapping, kv_scale)
    if not triton_ok:
        return mla_attention_ref(q, cache, cu_seqlens_q, seq_lens, page_table, scale, latent_dim, out=out,
                                 kv_scale=kv_scale)
    return mla_attention_triton(q, cache, cu_seqlens_q, seq_lens, page_table, scale, latent_dim, max_q_len, out=out,
                                order=None if seq_lens.shape[0] == 1 else order, kv_scale=kv_scale)


# ---------------------------------------------------------------------------------------------------
# Checks on reload (kernels/tsdev_kernels/checks.py): batches as serving builds them, pages in random order, mixed
# lengths, a prefill chunk behind a cached prefix, this step's rows stored by the op.

MLA_TOLERANCE = ATTENTION_TOLERANCE  # the same arithmetic: float32 softmax and sums, tf32 (or IEEE) products


def mla_batch(q_lens: list[int], cached: list[int], heads: int, latent: int, rope: int, page_size: int, dtype,
              device, generator, kv_dtype=None) -> tuple:
    """q, cache, cu_seqlens_q, seq_lens, page_table, rows, slot_mapping, order, max_q_len, L for a step
    (`PagedSteps`), the cache random (in `kv_dtype`, default `dtype`); q scaled as the model's (latent-space queries
    are sums over 128 nope features: a plain randn q would make every softmax one-hot)."""
    step = PagedSteps.draw(q_lens, cached, page_size, device, generator)
    width = latent + rope
    cache = quantize_kv(torch.randn(step.num_pages, page_size, 1, width, generator=generator, device=device), 1.0,
                        kv_dtype or dtype)
    tokens = sum(q_lens)
    q = (torch.randn(tokens, heads, width, generator=generator, device=device) * width ** -0.25).to(dtype)
    rows = torch.randn(tokens, 1, width, generator=generator, device=device).to(dtype)
    if kv_dtype == FP8_KV_DTYPE:  # on e4m3's grid, as attention.py's checks (the interpreter rounds otherwise)
        rows = quantize_kv(rows, 1.0, kv_dtype).to(dtype)
    return (q, cache, step.cu_seqlens_q, step.seq_lens, step.page_table, rows, step.slot_mapping, step.order,
            step.max_q_len, latent)


def _inputs(decode: bool, kv_dtype=None):
    def inputs(shape, dtype, device, generator):
        tokens, heads, latent, rope, page_size, context = shape
        q_lens, cached = (decode_step if decode else mixed_step)(tokens, context, generator, device)
        return mla_batch(q_lens, cached, heads, latent, rope, page_size, dtype, device, generator, kv_dtype)
    return inputs


def _reference(q, cache, cu, lens, table, rows, slots, order, max_q_len, latent):
    cache = cache.clone()
    store_latent_ref(rows, cache, slots)
    return mla_attention_ref(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent)


def _kernel(q, cache, cu, lens, table, rows, slots, order, max_q_len, latent):
    """In place, as serving runs it (storing this step's rows again writes the same values): decode stores them in
    its kernel, prefill before it."""
    if max_q_len == 1:
        return mla_attention_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, 1, order=order,
                                    store=(rows, slots))
    store_latent_triton(rows, cache, slots)
    return mla_attention_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, max_q_len, order=order)


def _flash_kernel(q, cache, cu, lens, table, rows, slots, order, max_q_len, latent):
    """The flash decode kernel as serving would run it (TSDEV_MLA_DECODE=flash): storing the step's rows itself."""
    return mla_decode_triton(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, order=order,
                             store=(rows, slots))


def _gluon_kernel(q, cache, cu, lens, table, rows, slots, order, max_q_len, latent):
    """The Gluon decode kernel as serving runs it (TSDEV_MLA_DECODE=auto on Hopper): storing the step's rows itself."""
    return mla_decode_gluon(q, cache, cu, lens, table, q.shape[-1] ** -0.5, latent, order=order,
                            store=(rows, slots))


def _cost(q, cache, cu, lens, table, rows, slots, order, max_q_len, latent):
    """q and the step's latent rows read, the rows stored, each sequence's latent rows read once (one head shared by
    all query heads), the output [T, H, latent] written, the metadata; QK^T over latent + rope and PV over the latent:
    2·(2·latent + rope) FLOPs per query head and (row, key) pair."""
    tokens, pairs = keys_seen(cu, lens)
    width, heads = cache.shape[-1], q.shape[1]
    return (nbytes(q, rows, cu, lens, table, slots, order) + (rows.numel() + tokens * width) * cache.element_size()
            + q.shape[0] * heads * latent * q.element_size(), 2 * pairs * heads * (2 * latent + width - latent))


def _shapes(decode: bool, fp8: bool = False):
    def shapes(s):
        if not s.latent_dim or fp8 != s.kv_fp8:
            return []
        rows = [t for t in s.tokens if t <= s.max_running] if decode else [t for t in s.tokens if t >= 4]
        return [(t, s.q_heads, s.latent_dim, s.rope_dim, s.page_size, s.max_context) for t in rows]
    return shapes


def _gluon_shapes(fp8: bool):
    """The decode shapes where the Gluon kernel runs: on a Hopper GPU (Triton's interpreter does not run Gluon), at
    the dtypes and widths it takes (`gluon_shape_misfit`)."""
    def shapes(s):
        if not (s.latent_dim and s.device.startswith("cuda") and on_hopper()):
            return []
        misfit = gluon_shape_misfit(s.dtype, FP8_KV_DTYPE if fp8 else s.dtype, s.latent_dim, s.rope_dim)
        return [] if misfit else _shapes(True, fp8)(s)
    return shapes


CHECKS = [
    KernelCheck(op=f"mla_{step}{suffix}", kernels=("_mla_kernel", "_mla_merge_kernel", "_store_latent_kernel"),
                shapes=_shapes(step == "decode", kv_dtype is not None),
                inputs=_inputs(step == "decode", kv_dtype), kernel=_kernel, reference=_reference,
                tolerance=MLA_TOLERANCE, cost=_cost)
    for step in ("decode", "prefill") for suffix, kv_dtype in (("", None), ("_fp8", FP8_KV_DTYPE))
] + [
    KernelCheck(op=f"mla_decode_flash{suffix}", kernels=("_mla_decode_kernel", "_mla_merge_kernel"),
                shapes=_shapes(True, kv_dtype is not None), inputs=_inputs(True, kv_dtype), kernel=_flash_kernel,
                reference=_reference, tolerance=MLA_TOLERANCE, cost=_cost)
    for suffix, kv_dtype in (("", None), ("_fp8", FP8_KV_DTYPE))
] + [
    KernelCheck(op=f"mla_decode_gluon{suffix}", kernels=("_mla_decode_gluon_kernel", "_mla_merge_kernel"),
                shapes=_gluon_shapes(kv_dtype is not None), inputs=_inputs(True, kv_dtype), kernel=_gluon_kernel,
                reference=_reference, tolerance=MLA_TOLERANCE, cost=_cost)
    for suffix, kv_dtype in (("", None), ("_fp8", FP8_KV_DTYPE))
]
