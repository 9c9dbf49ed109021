"""MLA decode in FlashMLA's structure: the kernel. Its launcher (`mla_decode_triton`), tiles, splits and check are in
mla.py, beside the kernel it may replace (`_mla_kernel`) and the merge both use (`_mla_merge_kernel`).

Grid: (head blocks, splits, sequences). A program owns HEADS query heads of one sequence's row and one of
`num_splits` shares of the sequence's cached rows (whole blocks of BLOCK_N), and every latent column of the output:

    q_lat[0..CHUNKS), q_rope     loaded once, [HEADS, CHUNK] each (Triton keeps them in shared memory)
    for each block of BLOCK_N cached rows of the share (paged; this step's row stored first, as `_mla_kernel` does):
        S = q_rope . k_rope^T + sum over chunks c of q_lat[c] . k_lat[c]^T      [HEADS, BLOCK_N]: once per block
        online softmax of S (float32, base 2)
        for each chunk c:  acc[c] = acc[c] * alpha + P . k_lat[c]                  [HEADS, CHUNK] float32
    write acc / l (or, split, the partial and its log2-sum-exp for `_mla_merge_kernel`)

The latent part of a block is loaded once, in CHUNKS column chunks of BLOCK_L / CHUNKS, and serves both products
(the value is the key's latent part); P stays in registers across the chunks' products. An e4m3 cache's rows become
q's dtype in registers; its scale multiplies the scores (folded into scale_log2) and the output.

On Hopper (8 warps, two warpgroups; the TTGIR compiled for sm_90 without a GPU): q and the blocks live in shared
memory (64 heads x 576 + two stages of 64 rows x 576 in bf16: 216 KiB), the scores' product is HGMMA 64x32 on
both warpgroups (Triton lays the warps of a product whose result feeds another 8 x 1, and 64 heads fill one
warpgroup's rows: each warpgroup computes the whole S), and each P . V product is laid 4 x 2: each warpgroup sums
half of each chunk's columns, 256 of the 512 as FlashMLA's two warpgroups. So each warpgroup does 64 x (576 + 256)
products per cached row where 64 x (288 + 256) would do (FlashMLA's warpgroups share P through shared memory: no
Triton layout says that). 128 heads in one program do not fit: q alone is 144 KiB of shared memory and the
[128, 512] float32 accumulator the whole register file (HEADS is a constexpr: benchmarks/mla_decode.py times it).

Computing both products the other way round (S^T = K . q^T, then O^T += V^T . P^T: FlashMLA's split of the work
without a layout Triton lacks) was tried and dropped: on an H100 (2026-12-07, V3's shapes, Triton 3.6) it took
1.8-3.4x the time of this orientation (benchmarks/mla_decode.py; the Gluon kernel, mla_decode_gluon.py, shares the
scores between the warpgroups instead).
"""
import triton
import triton.language as tl

from tsdev_kernels.ops.attention import _quantized


@triton.jit
def _store_own_row(CACHE, ROWS, SLOTS, t, seq_len, start, stop, stride_rt, stride_cp, stride_cs, kv_scale,
                   LATENT: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_L: tl.constexpr,
                   BLOCK_R: tl.constexpr, QUANTIZED: tl.constexpr):
    """A decode step's row `t` (ROWS, quantized by kv_scale in an e4m3 cache) into its cache slot, by every program
    whose share [start, stop) of the sequence holds its position (seq_len - 1): each writes the same values and reads
    back its own write, so no order between programs is needed. Slot -1 (a graph's padding row) writes nothing.
    `_mla_kernel`'s decode tiles (mla.py) and this module's kernel both store their step's rows so."""
    if (seq_len - 1 >= start) & (seq_len - 1 < stop):
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot >= 0:
            lat = tl.arange(0, BLOCK_L)
            rot = tl.arange(0, BLOCK_R)
            dst = CACHE + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs
            new_lat = tl.load(ROWS + t * stride_rt + lat, mask=lat < LATENT)
            new_rot = tl.load(ROWS + t * stride_rt + LATENT + rot, mask=rot < ROPE)
            if QUANTIZED:
                new_lat, new_rot = _quantized(new_lat, kv_scale, CACHE), _quantized(new_rot, kv_scale, CACHE)
            tl.store(dst + lat, new_lat, mask=lat < LATENT)
            tl.store(dst + LATENT + rot, new_rot, mask=rot < ROPE)
    tl.debug_barrier()  # every thread of the program reads it back


@triton.jit(do_not_specialize=["stride_pt", "num_splits", "ORDER", "SLOTS"])  # attention.py's module docstring says why
def _mla_decode_kernel(
    Q, CACHE, O, PART_O, PART_LSE, CU, SEQ_LENS, PAGE_TABLE, ORDER, ROWS, SLOTS,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_cs, stride_pt, stride_rt, H, num_splits,
    kv_scale, LATENT: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, HEADS: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    STORE: tl.constexpr, ORDERED: tl.constexpr, PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
):
    CHUNK: tl.constexpr = BLOCK_L // CHUNKS
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    if ORDERED:
        b = tl.load(ORDER + b).to(tl.int32)
    t = tl.load(CU + b)  # the sequence's one row this step
    if tl.load(CU + b + 1) > t:  # a sequence with no row this step leaves its programs idle
        seq_len = tl.load(SEQ_LENS + b)
        h = head_block * HEADS + tl.arange(0, HEADS)
        c = tl.arange(0, CHUNK)
        rot = tl.arange(0, BLOCK_R)
        q_row = Q + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh
        q_lat = ()
        for i in tl.static_range(CHUNKS):
            q_lat += (tl.load(q_row + i * CHUNK + c[None, :], mask=(h < H)[:, None] & (i * CHUNK + c < LATENT)[None, :],
                              other=0.0),)
        q_rot = tl.load(q_row + LATENT + rot[None, :], mask=(h < H)[:, None] & (rot < ROPE)[None, :], other=0.0)
        share = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N  # each split's rows, in whole blocks
        start = split * share
        stop = tl.minimum(start + share, seq_len)
        if STORE:
            _store_own_row(CACHE, ROWS, SLOTS, t, seq_len, start, stop, stride_rt, stride_cp, stride_cs, kv_scale,
                           LATENT, ROPE, PAGE_SIZE, BLOCK_L, BLOCK_R, QUANTIZED)

        m_i = tl.full([HEADS], float("-inf"), tl.float32)
        l_i = tl.zeros([HEADS], tl.float32)
        acc = (tl.zeros([HEADS, CHUNK], tl.float32),) * CHUNKS
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < stop
            page = tl.load(PAGE_TABLE + b * stride_pt + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            row = CACHE + (page * stride_cp + (n % PAGE_SIZE) * stride_cs)[:, None]
            k_rot = tl.load(row + LATENT + rot[None, :], mask=n_mask[:, None] & (rot < ROPE)[None, :], other=0.0)
            k_rot = k_rot.to(Q.dtype.element_ty)
            s = tl.dot(q_rot, tl.trans(k_rot), input_precision=PRECISION)
            k_lat = ()  # the block's latent part, chunk by chunk: keys for S, then values for P . V
            for i in tl.static_range(CHUNKS):
                k = tl.load(row + i * CHUNK + c[None, :], mask=n_mask[:, None] & (i * CHUNK + c < LATENT)[None, :],
                            other=0.0).to(Q.dtype.element_ty)  # (an e4m3 row to q's dtype, exactly)
                s = tl.dot(q_lat[i], tl.trans(k), s, input_precision=PRECISION)
                k_lat += (k,)
            s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p = p.to(Q.dtype.element_ty)
            summed = ()
            for i in tl.static_range(CHUNKS):
                summed += (tl.dot(p, k_lat[i], acc[i] * alpha[:, None], input_precision=PRECISION),)
            acc = summed
            m_i = m_new
        scale = kv_scale if QUANTIZED else 1.0  # an e4m3 cache's values times its scale
        part = (b * H + h) * num_splits + split  # each head's partial row of a split
        for i in tl.static_range(CHUNKS):
            col = i * CHUNK + c
            mask = (h < H)[:, None] & (col < LATENT)[None, :]
            if SPLIT:  # a share past the sequence's end has l_i == 0: its partial is 0, its log-sum-exp -inf
                tl.store(PART_O + part[:, None] * LATENT + col[None, :],
                         acc[i] * (scale / tl.maximum(l_i, 1e-30))[:, None], mask=mask)
            else:
                tl.store(O + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + col[None, :],
                         (acc[i] * (scale / l_i)[:, None]).to(O.dtype.element_ty), mask=mask)
        if SPLIT:
            tl.store(PART_LSE + part, tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf")),
                     mask=h < H)
