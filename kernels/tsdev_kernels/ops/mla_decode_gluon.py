"""MLA decode in Gluon for Hopper (sm_90), FlashMLA's structure: the kernel that serves decode steps of a bf16 or fp16
model with DeepSeek's latent shapes on an H100 or H200 (mla.py's `decode_kernel` picks it; its launcher,
`mla_decode_gluon`, is in mla.py beside `mla_decode_triton`, whose launch contract, partial outputs, log2-sum-exp for
`_mla_merge_kernel` and own-row store it shares). Triton's interpreter does not run Gluon: off a GPU the Triton
kernel (mla_decode.py) serves; tests/test_mla_gpu.py holds this one to the reference.

Grid: (head blocks of 64, splits, sequences); 8 warps (two warpgroups). A program owns 64 query heads of one
sequence's row and one share of its cached rows (whole blocks of 64), and all 512 latent output columns.

Shared memory (bf16 cache): q latent [64, 512] + q rope [64, 64] (72 KiB, loaded once), two stages of a block's
latent [64, 512] + rope [64, 64] (2 x 72 KiB), P [64, 64] (8 KiB): 224 KiB. An e4m3 cache: two e4m3 stages
(2 x 36 KiB) that cp.async fills, and one bf16 block (72 KiB) the warps convert each stage into.

Per block of 64 cached rows (stage i % 2, its copy issued one block ahead with cp.async, 16 bytes a copy):
    S = q_lat . K_lat^T + q_rope . K_rope^T          wgmma [64 heads, 64 rows]; warps laid 4 x 2: each warpgroup
                                                     computes 32 of the 64 columns (no score computed twice)
    online softmax (float32, base 2)                 row max / sum across the two warpgroups (the compiler's
                                                     reduction through shared memory)
    P (bf16) -> shared memory
    O = O * alpha + P . K_lat                        wgmma [64, 512]: warpgroup w sums columns 256w..256w+255
This is FlashMLA's split of the P . V work (each warpgroup half of the output columns); the score work is split by
columns rather than by alternating blocks between the warpgroups, so both warpgroups run in lockstep (no warp
specialization). The [64, 512] float32 accumulator is 128 registers a thread. On an H100 (Triton 3.6, V3's shapes,
context 4096): 213 / 852 us at batch 64 / 256 with a bf16 cache (47 % of the KV-read floor; the Triton kernel 314 /
1234), 333 / 1296 with e4m3 (docs/mla.md).

The step's own row is stored first (before any block is copied) by the programs whose share holds its position, as
`_store_own_row` does (same values from every such program; each reads back its own write after a CTA barrier).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

# Triton 3.9's names; 3.6 (the GPU machines') has the others
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared

HEADS = 64  # a warpgroup's rows: the wgmma M
BLOCK_N = 64  # cached rows per block
NUM_WARPS = 8


@gluon.jit
def _store_own_row_gluon(CACHE, ROWS, SLOTS, t, seq_len, start, stop, stride_rt, stride_cp, stride_cs, kv_scale,
                         LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
                         QUANTIZED: gl.constexpr):
    """`_store_own_row` (mla_decode.py) in Gluon: row t of ROWS (quantized as `_quantized` does in an e4m3 cache)
    into its slot, by every program whose share [start, stop) holds position seq_len - 1; slot -1 writes nothing.
    The caller's CTA barrier orders the writes before the block copies read them back."""
    if (seq_len - 1 >= start) & (seq_len - 1 < stop):
        slot = gl.load(SLOTS + t).to(gl.int64)
        if slot >= 0:
            nw: gl.constexpr = gl.num_warps()
            lat_l: gl.constexpr = gl.BlockedLayout([LATENT // (32 * nw)], [32], [nw], [0])
            rot_l: gl.constexpr = gl.BlockedLayout([1], [32], [nw], [0])
            lat = gl.arange(0, LATENT, layout=lat_l)
            rot = gl.arange(0, ROPE, layout=rot_l)
            dst = CACHE + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs
            src = ROWS + t.to(gl.int64) * stride_rt
            new_lat = gl.load(src + lat)
            new_rot = gl.load(src + LATENT + rot)
            if QUANTIZED:
                new_lat = gl.minimum(gl.maximum(new_lat.to(gl.float32) / kv_scale, -448.0), 448.0)
                new_lat = new_lat.to(CACHE.dtype.element_ty)
                new_rot = gl.minimum(gl.maximum(new_rot.to(gl.float32) / kv_scale, -448.0), 448.0)
                new_rot = new_rot.to(CACHE.dtype.element_ty)
            gl.store(dst + lat, new_lat)
            gl.store(dst + LATENT + rot, new_rot)


@gluon.jit
def _issue_block(CACHE, PAGE_TABLE, b, stride_pt, stride_cp, stride_cs, n0, stop, lat_dst, rot_dst,
                 LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                 LAT_LAYOUT: gl.constexpr, ROT_LAYOUT: gl.constexpr):
    """cp.async of cached rows [n0, n0 + BLOCK_N) (rows at or past `stop` zero-filled) into lat_dst [BLOCK_N, LATENT]
    and rot_dst [BLOCK_N, ROPE], through the page table; not committed."""
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAT_LAYOUT))
    live = n < stop
    page = gl.load(PAGE_TABLE + b * stride_pt + n // PAGE_SIZE, mask=live, other=0).to(gl.int64)
    row = CACHE + page * stride_cp + (n % PAGE_SIZE).to(gl.int64) * stride_cs
    col = gl.arange(0, LATENT, layout=gl.SliceLayout(0, LAT_LAYOUT))
    async_load(lat_dst, row[:, None] + col[None, :], mask=live[:, None] & (col < LATENT)[None, :])
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROT_LAYOUT))
    live = n < stop
    page = gl.load(PAGE_TABLE + b * stride_pt + n // PAGE_SIZE, mask=live, other=0).to(gl.int64)
    row = CACHE + page * stride_cp + (n % PAGE_SIZE).to(gl.int64) * stride_cs + LATENT
    col = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROT_LAYOUT))
    async_load(rot_dst, row[:, None] + col[None, :], mask=live[:, None] & (col < ROPE)[None, :])


@gluon.jit
def _to_dot_dtype(src, dst, ROWS: gl.constexpr, COLS: gl.constexpr, CHUNK_ROWS: gl.constexpr,
                  LAYOUT: gl.constexpr):
    """An e4m3 block in shared memory into q's dtype in shared memory (exact), CHUNK_ROWS rows at a time."""
    for r in gl.static_range(0, ROWS, CHUNK_ROWS):
        x = src.slice(r, CHUNK_ROWS, dim=0).load(LAYOUT)
        dst.slice(r, CHUNK_ROWS, dim=0).store(x.to(dst.dtype))


@gluon.jit(do_not_specialize=["stride_pt", "num_splits", "ORDER", "SLOTS"])
def _mla_decode_gluon_kernel(
    Q, CACHE, O, PART_O, PART_LSE, CU, SEQ_LENS, PAGE_TABLE, ORDER, ROWS, SLOTS,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_cs, stride_pt, stride_rt, H, num_splits,
    kv_scale, LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr, HEADS: gl.constexpr,
    BLOCK_N: gl.constexpr, SPLIT: gl.constexpr, STORE: gl.constexpr, ORDERED: gl.constexpr,
    QUANTIZED: gl.constexpr,
):
    gl.static_assert(gl.num_warps() == 8, "two warpgroups")
    gl.static_assert(HEADS == 64, "a warpgroup's rows")
    dt: gl.constexpr = Q.dtype.element_ty  # the products' dtype (bf16); an e4m3 cache's rows become it
    head_block = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    if ORDERED:
        b = gl.load(ORDER + b).to(gl.int32)
    t = gl.load(CU + b)  # the sequence's one row this step
    if gl.load(CU + b + 1) > t:  # a sequence with no row this step leaves its programs idle
        seq_len = gl.load(SEQ_LENS + b)
        share = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N  # each split's rows, in whole blocks
        start = split * share
        stop = gl.minimum(start + share, seq_len)
        if STORE:
            _store_own_row_gluon(CACHE, ROWS, SLOTS, t, seq_len, start, stop, stride_rt, stride_cp, stride_cs,
                                 kv_scale, LATENT, ROPE, PAGE_SIZE, QUANTIZED)
            cta_barrier()  # every thread's copies below read the row back

        # register layouts: the copies (16 bytes a thread along a row), the two products' accumulators
        VEC: gl.constexpr = 128 // CACHE.dtype.element_ty.primitive_bitwidth
        lat_copy: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [8, 1], [1, 0])
        rot_copy: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (ROPE // VEC), ROPE // VEC], [8, 1], [1, 0])
        q_lat_copy: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        q_rot_copy: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (ROPE // 8), ROPE // 8], [8, 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, LATENT // 2, 16])
        lat_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], dt)
        rot_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dt)
        p_smem_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_N], dt)

        q_lat = gl.allocate_shared_memory(dt, [HEADS, LATENT], lat_smem)
        q_rot = gl.allocate_shared_memory(dt, [HEADS, ROPE], rot_smem)
        p_buf = gl.allocate_shared_memory(dt, [HEADS, BLOCK_N], p_smem_l)
        if QUANTIZED:  # cp.async fills e4m3 stages; the warps convert the current one into a bf16 block
            f8_lat_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT], CACHE.dtype.element_ty)
            f8_rot_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], CACHE.dtype.element_ty)
            st_lat = gl.allocate_shared_memory(CACHE.dtype.element_ty, [2, BLOCK_N, LATENT], f8_lat_l)
            st_rot = gl.allocate_shared_memory(CACHE.dtype.element_ty, [2, BLOCK_N, ROPE], f8_rot_l)
            k_lat1 = gl.allocate_shared_memory(dt, [BLOCK_N, LATENT], lat_smem)
            k_rot1 = gl.allocate_shared_memory(dt, [BLOCK_N, ROPE], rot_smem)
        else:  # cp.async fills the blocks the products read
            st_lat = gl.allocate_shared_memory(dt, [2, BLOCK_N, LATENT], lat_smem)
            st_rot = gl.allocate_shared_memory(dt, [2, BLOCK_N, ROPE], rot_smem)

        # q's 64 heads, once (heads past H zero-filled), in the first copy group with the first block
        h = head_block * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, q_lat_copy))
        q_row = Q + t.to(gl.int64) * stride_qt + h.to(gl.int64) * stride_qh
        c = gl.arange(0, LATENT, layout=gl.SliceLayout(0, q_lat_copy))
        async_load(q_lat, q_row[:, None] + c[None, :], mask=(h < H)[:, None] & (c < LATENT)[None, :])
        h = head_block * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, q_rot_copy))
        q_row = Q + t.to(gl.int64) * stride_qt + h.to(gl.int64) * stride_qh + LATENT
        c = gl.arange(0, ROPE, layout=gl.SliceLayout(0, q_rot_copy))
        async_load(q_rot, q_row[:, None] + c[None, :], mask=(h < H)[:, None] & (c < ROPE)[None, :])
        _issue_block(CACHE, PAGE_TABLE, b, stride_pt, stride_cp, stride_cs, start, stop, st_lat.index(0),
                     st_rot.index(0), LATENT, ROPE, PAGE_SIZE, BLOCK_N, lat_copy, rot_copy)
        cp.commit_group()

        m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HEADS], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([HEADS, LATENT], gl.float32, layout=o_layout)
        s_zero = gl.zeros([HEADS, BLOCK_N], gl.float32, layout=s_layout)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        blocks = gl.cdiv(gl.maximum(stop - start, 0), BLOCK_N)
        for i in range(blocks):
            stage = i % 2
            n0 = start + i * BLOCK_N
            cp.wait_group(0)  # this thread's copies of block i (and q) have landed
            fence_async_shared()  # ... and are ordered before the products' (async proxy) reads
            cta_barrier()  # every thread's; and every warp is done with block i - 1 (its stage and P)
            # the next block into the other stage (past the share: every row masked, nothing read)
            _issue_block(CACHE, PAGE_TABLE, b, stride_pt, stride_cp, stride_cs, n0 + BLOCK_N, stop,
                         st_lat.index(1 - stage), st_rot.index(1 - stage), LATENT, ROPE, PAGE_SIZE, BLOCK_N,
                         lat_copy, rot_copy)
            cp.commit_group()
            if QUANTIZED:
                conv_l: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [8, 1], [1, 0])
                conv_r: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (ROPE // 16), ROPE // 16], [8, 1], [1, 0])
                _to_dot_dtype(st_lat.index(stage), k_lat1, BLOCK_N, LATENT, 16, conv_l)
                _to_dot_dtype(st_rot.index(stage), k_rot1, BLOCK_N, ROPE, BLOCK_N, conv_r)
                fence_async_shared()
                cta_barrier()
                k_lat = k_lat1
                k_rot = k_rot1
            else:
                k_lat = st_lat.index(stage)
                k_rot = st_rot.index(stage)

            s = warpgroup_mma(q_lat, k_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_rot, k_rot.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            s = gl.where(((n0 + cols) < stop)[None, :], s * scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            p_buf.store(p.to(dt))
            fence_async_shared()
            cta_barrier()  # both warpgroups' halves of P
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc = warpgroup_mma(p_buf, k_lat, acc)
        cp.wait_group(0)  # (the last, empty copy group)

        scale = kv_scale if QUANTIZED else 1.0  # an e4m3 cache's values times its scale
        h = head_block * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, o_layout))
        col = gl.arange(0, LATENT, layout=gl.SliceLayout(0, o_layout))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        mask = (h < H)[:, None] & (col < LATENT)[None, :]
        part = (b * H + h) * num_splits + split  # each head's partial row of a split
        if SPLIT:  # a share past the sequence's end has l_i == 0: its partial is 0, its log-sum-exp -inf
            gl.store(PART_O + part.to(gl.int64)[:, None] * LATENT + col[None, :],
                     acc * (scale / gl.maximum(l_o, 1e-30))[:, None], mask=mask)
            hs = head_block * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, s_layout))
            parts = (b * H + hs) * num_splits + split
            gl.store(PART_LSE + parts, gl.where(l_i > 0, m_i + gl.log2(gl.maximum(l_i, 1e-30)), float("-inf")),
                     mask=hs < H)
        else:
            gl.store(O + t.to(gl.int64) * stride_ot + h.to(gl.int64)[:, None] * stride_oh + col[None, :],
                     (acc * (scale / l_o)[:, None]).to(O.dtype.element_ty), mask=mask)
