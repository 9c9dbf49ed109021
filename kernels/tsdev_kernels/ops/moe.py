"""Mixture-of-experts MLP (Qwen3-MoE's sparse block): each token runs its K chosen experts' SiLU-gated MLPs, weighted
by the router and summed.

Layout: x [T, H]; w13 [E, 2*I, H], each expert's gate rows then its up rows; w2 [E, H, I]; topk_weights [T, K]
float32; topk_ids [T, K] int32 or int64, every id in [0, E). The T*K (token, k) pairs are "slots", slot = t*K + k.

The Triton path, for more than GEMV_MAX_TOKENS tokens, is the alignment (one launch, three for many slots), two
GEMM launches and a sum, none of which syncs with the host; every size follows from (T*K, E, BLOCK_M), so CUDA graphs
capture it:
1. `moe_align`: counts each expert's slots, pads each count up to a multiple of BLOCK_M, and writes the slots
   sorted by expert (stable: in slot order within an expert; pad entries = T*K), each block's expert (-1 for the
   unused blocks at the end) and the number of padded slots used. One program when the slots fit one register tile
   with the experts (8192 // E: 64 slots at E = 128), else three launches over chunks of slots (count, prefix,
   place), so a long prefill's alignment runs on many SMs instead of one.
2. `_moe_gemm` with the fused activation: one program per (block of BLOCK_M sorted slots, BLOCK_N columns of I)
   gathers its slots' x rows (token = slot // K), multiplies them by the block's expert's gate tile and up tile (two
   float32 accumulators) and writes silu(gate) * up [T*K, I] (activation.py's `silu_and_mul_values`).
3. `_moe_gemm` again, over those rows and w2: times the slot's router weight, written per slot [T*K, H].
4. The sum over K in float32 (`view(T, K, H).sum(1)`), one rounding: deterministic, bit for bit run to run (no
   atomics).
Up to GEMV_MAX_TOKENS tokens (decode at batch 1) two launches do it all, with no alignment (`fused_moe_gemv_triton`): a
GEMV per (slot, features) for gate|up with the activation, and one per (token, outputs) that runs the token's K experts
over w2 and sums them in the kernel, in slot order, in float32.
FP8 experts (`--quantization fp8`): e4m3 weights with one float32 scale per (expert, output row); the numerics of
fp8.py's dense layers. The GEMV path is weight-only (the e4m3 rows converted exactly to float32, each sum
multiplied by its row's scale). The aligned GEMMs are W8A8 (`uses_w8a8`): each GEMM's input quantized per row
(x per token, the activation per slot: one launch each, `quantize_fp8_rows_triton`, dynamic scales) and the tiles
multiplied as e4m3 on the FP8 tensor cores, each float32 sum times its row's and its column's scale. Both round
where the bf16 path rounds.
A block-FP8 checkpoint's experts (128 x 128 blocks of scales per expert, `block=`): the aligned GEMMs at every token
count with SCALE_BLOCK_N, the activations quantized per token (or slot) and group of block_k columns, each K block's
product scaled and summed in float32 (`fp8_block_linear_ref`'s arithmetic; tests/test_fp8_block_gpu.py).
Rounding, on both paths: to x's dtype after each GEMM, after the SiLU, after silu * up, after the router weight
multiply, and after the float32 sum over K -- where transformers' Qwen3-MoE (its default grouped_mm experts)
rounds, given router weights already rounded to x's dtype as it rounds them (runtime/tsdev_runtime/moe/router.py).

Block sizes come from `moe_config`: a JSON file per (E, I, H, dtype, GPU) written by `tsdev tune` (the user's cache
first, then the files shipped in moe_configs/ for this GPU, then its sibling's: ops/__init__.py's `find_tuned`), else a
default by token count (no autotune: it fails under the interpreter and would benchmark inside a capture).
"""
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tsdev_kernels.checks import KernelCheck, Tolerance, nbytes
from tsdev_kernels.ops import (device_name, find_tuned, nearest, pdl, tuned_file_name, tuned_log,
                               use_triton, wait_for_previous)
from tsdev_kernels.ops.activation import silu_and_mul_values
from tsdev_kernels.ops.fp8 import quantize_fp8_rows, quantize_fp8_rows_triton
from tsdev_kernels.ops.fp8_block import (BLOCK, fp8_block_linear_ref, quantize_fp8_blocks, quantize_fp8_token_groups,
                                         quantize_fp8_token_groups_triton, quantize_tile)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "moe_configs"
TOKEN_BUCKETS = (1, 16, 64, 256, 1024)  # what `tsdev tune` measures


# --- alignment of slots to experts -----------------------------------------------------------------


def moe_align_sizes(num_slots: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(padded slots, blocks) that `moe_align` allocates for num_slots = T*K slots: enough for any routing. At most
    n = min(E, T*K) experts get a slot and each pads by under block_m, so the used blocks (the sum over experts of
    ceil(count / block_m)) are at most n + (T*K - n) // block_m."""
    n = min(num_experts, num_slots)
    blocks = n + (num_slots - n) // block_m
    return blocks * block_m, blocks


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align` in torch. Sync-free and capturable too (a stable sort, scatter_add, cumsum, searchsorted: no
    output size depends on values), but about ten launches where the kernels take one or three."""
    flat = topk_ids.reshape(-1).long()
    num_slots, device = flat.numel(), flat.device
    max_slots, max_blocks = moe_align_sizes(num_slots, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # slots by expert, in slot order within one
    by_expert = flat[order]
    rank = torch.arange(num_slots, device=device) - (counts.cumsum(0) - counts)[by_expert]  # within its expert
    sorted_ids = torch.full((max_slots,), num_slots, dtype=torch.int32, device=device)
    sorted_ids[(ends - padded)[by_expert] + rank] = order.int()
    starts = torch.arange(max_blocks, device=device) * block_m
    total = ends[-1:] if num_experts else torch.zeros(1, dtype=torch.long, device=device)
    expert_ids = torch.searchsorted(ends, starts, right=True)
    expert_ids = torch.where(starts < total, expert_ids, -1).int()
    return sorted_ids, expert_ids, total.int()


ALIGN_TILE = 8192  # int32 elements of the alignment kernels' register tiles ([slots, experts], [chunks, experts])


@triton.jit
def _chunk_hits(IDS, chunk, num_slots, experts, CHUNK: tl.constexpr):
    """(slot ids, in range, one-hot [CHUNK, E_PAD] of their experts) of one chunk of slots. Lanes past E never
    match an id, nor do the out-of-range slots (-1)."""
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = slots < num_slots
    ids = tl.load(IDS + slots, mask=ok, other=-1)
    return slots, ok, (ids[:, None] == experts[None, :]).to(tl.int32)


@triton.jit
def _scatter_chunk(SORTED, slots, ok, hit, base):
    """Each slot of a chunk to base[its expert] + the slots of its expert before it in the chunk (a scan)."""
    before = tl.sum(tl.cumsum(hit, axis=0) * hit, axis=1) - 1
    tl.store(SORTED + tl.sum(hit * base[None, :], axis=1) + before, slots, mask=ok)


@triton.jit
def _write_blocks(SORTED, EXPERT_IDS, NUM_PADDED, counts, num_slots, max_blocks, experts, BLOCK_M: tl.constexpr,
                  BLOCKS_CHUNK: tl.constexpr):
    """From the experts' counts: NUM_PADDED; each block's expert (how many experts end at or before its first
    entry), -1 past the used ones; the pad entries, past each block's real slots (all of an unused block), disjoint
    from the slots' own entries. Returns each expert's first entry."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(NUM_PADDED, total)
    rows = tl.arange(0, BLOCK_M)
    for b0 in range(0, max_blocks, BLOCKS_CHUNK):
        blocks = b0 + tl.arange(0, BLOCKS_CHUNK)
        b_ok = blocks < max_blocks
        first = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        used = first < total
        real = tl.sum(tl.where(experts[None, :] == expert[:, None], counts[None, :] + starts[None, :], 0), axis=1)
        real = tl.where(used, real - first, 0)  # of this block's entries
        tl.store(EXPERT_IDS + blocks, tl.where(used, expert, -1), mask=b_ok)
        tl.store(SORTED + first[:, None] + rows[None, :], tl.zeros([BLOCKS_CHUNK, BLOCK_M], dtype=tl.int32) + num_slots,
                 mask=(rows[None, :] >= real[:, None]) & b_ok[:, None])
    return starts


@triton.jit
def _moe_align_kernel(IDS, SORTED, EXPERT_IDS, NUM_PADDED, COUNTS, BASES, num_slots, num_chunks, max_blocks,
                      PHASE: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                      ROWS: tl.constexpr, BLOCKS_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """PHASE 0: everything, one program, one chunk of slots. Else three launches: 1, a program per chunk counts its
    slots per expert (COUNTS [chunks, E_PAD]); 2, one program sums them, writes the blocks and each chunk's first
    entry per expert (BASES, ROWS chunks at a time); 3, a program per chunk places its slots."""
    wait_for_previous(PDL)
    experts = tl.arange(0, E_PAD)
    chunk = tl.program_id(0)
    if PHASE == 0:
        slots, ok, hit = _chunk_hits(IDS, 0, num_slots, experts, CHUNK)
        starts = _write_blocks(SORTED, EXPERT_IDS, NUM_PADDED, tl.sum(hit, axis=0), num_slots, max_blocks, experts,
                               BLOCK_M, BLOCKS_CHUNK)
        _scatter_chunk(SORTED, slots, ok, hit, starts)
    elif PHASE == 1:
        _, _, hit = _chunk_hits(IDS, chunk, num_slots, experts, CHUNK)
        tl.store(COUNTS + chunk * E_PAD + experts, tl.sum(hit, axis=0))
    elif PHASE == 2:
        rows = tl.arange(0, ROWS)
        counts = tl.zeros([E_PAD], dtype=tl.int32)
        for c0 in range(0, num_chunks, ROWS):
            tile_ok = ((c0 + rows)[:, None] < num_chunks) & (experts[None, :] < E_PAD)
            counts += tl.sum(tl.load(COUNTS + (c0 + rows)[:, None] * E_PAD + experts[None, :], mask=tile_ok,
                                     other=0), axis=0)
        base = _write_blocks(SORTED, EXPERT_IDS, NUM_PADDED, counts, num_slots, max_blocks, experts, BLOCK_M,
                             BLOCKS_CHUNK)
        for c0 in range(0, num_chunks, ROWS):
            tile_ok = ((c0 + rows)[:, None] < num_chunks) & (experts[None, :] < E_PAD)
            offsets = (c0 + rows)[:, None] * E_PAD + experts[None, :]
            tile = tl.load(COUNTS + offsets, mask=tile_ok, other=0)
            tl.store(BASES + offsets, base[None, :] + tl.cumsum(tile, axis=0) - tile, mask=tile_ok)
            base += tl.sum(tile, axis=0)
    else:
        slots, ok, hit = _chunk_hits(IDS, chunk, num_slots, experts, CHUNK)
        _scatter_chunk(SORTED, slots, ok, hit, tl.load(BASES + chunk * E_PAD + experts))


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk: slots per program (a power of two), default as many as fit a register tile with the experts; one
    launch when all slots fit one chunk, three otherwise."""
    ids = topk_ids.reshape(-1)
    if ids.stride(0) != 1:
        ids = ids.contiguous()
    num_slots, device = ids.numel(), ids.device
    max_slots, max_blocks = moe_align_sizes(num_slots, num_experts, block_m)
    sorted_ids = torch.empty(max_slots, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(max(num_experts, 1))
    chunk = chunk or max(16, min(triton.next_power_of_2(max(num_slots, 1)), ALIGN_TILE // e_pad))
    num_chunks = triton.cdiv(num_slots, chunk)
    rows = max(16, min(triton.next_power_of_2(max(num_chunks, 1)), ALIGN_TILE // e_pad))
    blocks_chunk = max(16, min(triton.next_power_of_2(max(max_blocks, 1)), ALIGN_TILE // block_m))
    use_pdl = pdl(ids)
    if num_chunks > 1:
        counts, bases = torch.empty(2, num_chunks, e_pad, dtype=torch.int32, device=device)
    else:
        counts = bases = sorted_ids  # not read
    phases = [(0, 1)] if num_chunks <= 1 else [(1, num_chunks), (2, 1), (3, num_chunks)]
    for phase, programs in phases:
        _moe_align_kernel[(programs,)](ids, sorted_ids, expert_ids, num_padded, counts, bases, num_slots, num_chunks,
                                       max_blocks, PHASE=phase, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, ROWS=rows,
                                       BLOCKS_CHUNK=blocks_chunk, PDL=use_pdl, num_warps=8, launch_pdl=use_pdl)
    return sorted_ids, expert_ids, num_padded


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*K slots of topk_ids [T, K] (ids in [0, E)) by expert, each expert's run padded to a multiple of
    block_m. Returns, on topk_ids' device, without a host sync, sizes fixed by (T*K, E, block_m) (`moe_align_sizes`):
    * sorted_ids int32 [blocks * block_m]: slot ids (t*K + k), each expert's contiguous and in slot order, experts
      in order; pad entries (to the multiple of block_m, and everything past the used blocks) are T*K.
    * expert_ids int32 [blocks]: the expert of each block of block_m entries, -1 for unused blocks.
    * num_padded int32 [1]: the entries in used blocks (the sum over experts of their padded counts).
    An expert without a slot gets no block."""
    if use_triton(topk_ids, "moe"):
        return moe_align_triton(topk_ids, num_experts, block_m)
    return moe_align_ref(topk_ids, num_experts, block_m)


# --- the grouped GEMM ----------------------------------------------------------------------------


@triton.jit
def _dot(a, w, acc, F32_DOT: tl.constexpr, EXACT_FP8: tl.constexpr):
    """acc + a @ w.T, a [M, K] and w [N, K] tiles. EXACT_FP8 (e4m3 tiles, BLOCK_M >= 64, unless the configuration
    says `fp8_wgmma`): converted exactly to bf16 first -- at that size Triton multiplies e4m3 on Hopper's wgmma, whose
    reduced-precision sum gave 2e-2 relative error at 64 tokens against the W8A8 reference, even with
    `max_num_imprecise_acc` at the tile (BLOCK_M 16 runs mma.sync, exact sums)."""
    if F32_DOT:
        return tl.dot(a, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    if EXACT_FP8:
        return tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _moe_gemm(A, A_S, W, S, OUT, SORTED, EXPERT_IDS, TOPK_W, N, K, num_slots, a_div, stride_am, stride_as,
              stride_we, stride_wn, stride_se, stride_sb, stride_om, MUL_WEIGHT: tl.constexpr,
              HAS_SCALE: tl.constexpr, A_FP8: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, QUANTIZE_A: tl.constexpr,
              F32_DOT: tl.constexpr, FP8_WGMMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """OUT[slot, n] for the block's slots and BLOCK_N columns: A's row slot // a_div @ W[expert].T, float32 sums.
    MUL_WEIGHT: times TOPK_W[slot]. (`_moe_gated_gemm`: the same over gate and up rows, written as
    silu(gate) * up.)
    HAS_SCALE: W is e4m3 with a scale per (expert, row): each sum times S[expert, row]; A_FP8: A is e4m3 too, with a
    scale per row (A_S[slot // a_div]), the tiles multiplied as e4m3 (Hopper's FP8 tensor cores) and each sum times
    its row's scale; else W converted exactly to A's dtype for tl.dot. SCALE_BLOCK_N (a block-FP8 checkpoint's
    experts, BLOCK_K its block_k): A_S[row, k block] and S[expert, row block, k block] instead, each K block's e4m3
    product from zero times its two scales added to the float32 sum (at BLOCK_M >= 64 as bf16, `_dot`'s EXACT_FP8: one
    block's wgmma sum alone put 8e-3 relative error on the layer's output through the second GEMM's requantization).
    QUANTIZE_A (with SCALE_BLOCK_N): A holds the unquantized rows (A_S unread), each tile quantized per K block as
    fp8_block's token-group kernel does, bit for bit (`quantize_tile`): no launch of its own before each GEMM.
    FP8_WGMMA (the configuration's `fp8_wgmma`; benchmarks/fp8_moe_accuracy.py measures it against the unquantized
    layer): at BLOCK_M >= 64 the e4m3 tiles go to the FP8 wgmma as they are, each K block's product summed from zero
    and added to the float32 sum (the sum promoted every BLOCK_K products, DeepGEMM's scheme), per-row scales too.
    F32_DOT: the tiles go to tl.dot as float32 (IEEE), for float32 inputs and under the interpreter, whose bf16
    tl.dot returns garbage (~1e10); a bf16 or e4m3 product is exact in float32, so only the order of the sums
    differs."""
    wait_for_previous(PDL)
    expert = tl.load(EXPERT_IDS + tl.program_id(0))
    if expert < 0:  # past the used blocks
        return
    acc, _, slots, row_ok, cols, col_ok = _moe_tiles(
        A, A_S, W, S, SORTED, expert, N, K, num_slots, a_div, stride_am, stride_as, stride_we, stride_wn, stride_se,
        stride_sb, False, HAS_SCALE, A_FP8, SCALE_BLOCK_N, QUANTIZE_A, F32_DOT, FP8_WGMMA, BLOCK_M, BLOCK_N, BLOCK_K)
    _moe_store(OUT, TOPK_W, acc.to(OUT.dtype.element_ty).to(tl.float32), slots, row_ok, cols, col_ok, stride_om,
               MUL_WEIGHT)


@triton.jit
def _moe_gated_gemm(A, A_S, W, S, OUT, SORTED, EXPERT_IDS, TOPK_W, N, K, num_slots, a_div, stride_am, stride_as,
                    stride_we, stride_wn, stride_se, stride_sb, stride_om, MUL_WEIGHT: tl.constexpr,
                    HAS_SCALE: tl.constexpr, A_FP8: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
                    QUANTIZE_A: tl.constexpr, F32_DOT: tl.constexpr, FP8_WGMMA: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """`_moe_gemm` over W's rows n (gate) and N + n (up), written as silu(gate) * up: a kernel of its own, so that an
    edit of the activation's Triton code builds only these variants again, not the down projection's."""
    wait_for_previous(PDL)
    expert = tl.load(EXPERT_IDS + tl.program_id(0))
    if expert < 0:  # past the used blocks
        return
    dt = OUT.dtype.element_ty
    acc, acc_up, slots, row_ok, cols, col_ok = _moe_tiles(
        A, A_S, W, S, SORTED, expert, N, K, num_slots, a_div, stride_am, stride_as, stride_we, stride_wn, stride_se,
        stride_sb, True, HAS_SCALE, A_FP8, SCALE_BLOCK_N, QUANTIZE_A, F32_DOT, FP8_WGMMA, BLOCK_M, BLOCK_N, BLOCK_K)
    y = silu_and_mul_values(acc.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32), dt)
    _moe_store(OUT, TOPK_W, y, slots, row_ok, cols, col_ok, stride_om, MUL_WEIGHT)


@triton.jit
def _moe_tiles(A, A_S, W, S, SORTED, expert, N, K, num_slots, a_div, stride_am, stride_as, stride_we, stride_wn,
               stride_se, stride_sb, GATED: tl.constexpr, HAS_SCALE: tl.constexpr, A_FP8: tl.constexpr,
               SCALE_BLOCK_N: tl.constexpr, QUANTIZE_A: tl.constexpr, F32_DOT: tl.constexpr,
               FP8_WGMMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 sums of `_moe_gemm` (and of the up rows, GATED) for this program's block of slots and columns,
    scaled; with the slots, the columns and their masks."""
    slots = tl.load(SORTED + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = slots < num_slots  # pad entries are num_slots
    a_rows = A + (slots // a_div).to(tl.int64) * stride_am
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = W + expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    EXACT: tl.constexpr = A_FP8 and BLOCK_M >= 64 and not FP8_WGMMA
    PROMOTED: tl.constexpr = A_FP8 and BLOCK_M >= 64 and FP8_WGMMA and not SCALE_BLOCK_N  # a fresh sum per K block
    if SCALE_BLOCK_N:  # this tile's rows of weight-scale blocks (gate's; up's N // SCALE_BLOCK_N rows of blocks on)
        a_scale_rows = A_S + (slots // a_div).to(tl.int64) * stride_as
        w_scales = S + expert.to(tl.int64) * stride_se + (tl.program_id(1) * BLOCK_N // SCALE_BLOCK_N) * stride_sb
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_rows[:, None] + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANTIZE_A:
            a, a_s = quantize_tile(a, BLOCK_M, BLOCK_K, W.dtype.element_ty)
            a_s = a_s[:, None]
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + (k0 + ks)[None, :], mask=w_mask, other=0.0)
        if F32_DOT:
            a = a.to(tl.float32)
        if HAS_SCALE and not A_FP8:
            w = w.to(a.dtype)
        if SCALE_BLOCK_N:
            if not QUANTIZE_A:
                a_s = tl.load(a_scale_rows + k0 // BLOCK_K, mask=row_ok, other=0.0)[:, None]
            part = _dot(a, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), F32_DOT, EXACT)
            acc += part * a_s * tl.load(w_scales + k0 // BLOCK_K)
        elif PROMOTED:
            acc += _dot(a, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), F32_DOT, False)
        else:
            acc = _dot(a, w, acc, F32_DOT, EXACT)
        if GATED:
            u = tl.load(w_rows + N * stride_wn + (k0 + ks)[None, :], mask=w_mask, other=0.0)
            if HAS_SCALE and not A_FP8:
                u = u.to(a.dtype)
            if SCALE_BLOCK_N:
                part = _dot(a, u, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), F32_DOT, EXACT)
                acc_up += part * a_s * tl.load(w_scales + (N // SCALE_BLOCK_N) * stride_sb + k0 // BLOCK_K)
            elif PROMOTED:
                acc_up += _dot(a, u, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), F32_DOT, False)
            else:
                acc_up = _dot(a, u, acc_up, F32_DOT, EXACT)
    if A_FP8 and not SCALE_BLOCK_N:
        a_scales = tl.load(A_S + (slots // a_div).to(tl.int64) * stride_as, mask=row_ok, other=0.0)[:, None]
        acc *= a_scales
        if GATED:
            acc_up *= a_scales
    if HAS_SCALE and not SCALE_BLOCK_N:
        scales = S + expert.to(tl.int64) * stride_se + cols
        acc *= tl.load(scales, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(scales + N, mask=col_ok, other=0.0)[None, :]
    return acc, acc_up, slots, row_ok, cols, col_ok


@triton.jit
def _moe_store(OUT, TOPK_W, y, slots, row_ok, cols, col_ok, stride_om, MUL_WEIGHT: tl.constexpr):
    if MUL_WEIGHT:
        y = y * tl.load(TOPK_W + slots, mask=row_ok, other=0.0)[:, None]
    tl.store(OUT + slots[:, None].to(tl.int64) * stride_om + cols[None, :], y.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_up_gemv(X, W, S, OUT, IDS, N, K, top_k, stride_xm, stride_we, stride_wn, stride_se, stride_om,
                 HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """silu(gate) * up of one slot (program 0) for BLOCK_N of its expert's features (program 1): x's row
    slot // top_k against the expert's gate rows n and up rows N + n, multiplied elementwise and summed once after
    the loop in float32 (times S[expert, row] for e4m3 weights), rounded where `_moe_gemm` rounds."""
    wait_for_previous(PDL)
    slot = tl.program_id(0)
    expert = tl.load(IDS + slot).to(tl.int64)
    dt = OUT.dtype.element_ty
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    rows = W + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    x_row = X + (slot // top_k).to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = col_ok[:, None] & k_ok[None, :]
        acc += tl.load(rows + (k0 + ks)[None, :], mask=mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(rows + N * stride_wn + (k0 + ks)[None, :], mask=mask, other=0.0).to(tl.float32) * x
    gate, up = tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)
    if HAS_SCALE:
        scales = S + expert * stride_se + cols
        gate *= tl.load(scales, mask=col_ok, other=0.0)
        up *= tl.load(scales + N, mask=col_ok, other=0.0)
    y = silu_and_mul_values(gate.to(dt).to(tl.float32), up.to(dt).to(tl.float32), dt)
    tl.store(OUT + slot.to(tl.int64) * stride_om + cols, y.to(dt), mask=col_ok)


@triton.jit
def _moe_down_gemv(A, W, S, OUT, IDS, TOPK_W, N, K, stride_am, stride_we, stride_wn, stride_se, stride_om,
                   TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    """One token's (program 0) BLOCK_N output features (program 1): for each of its TOP_K slots in order, the slot's
    row of A against its expert's down rows (float32, rounded), times the router weight (rounded), added to a
    float32 sum rounded once at the end: the sum over k inside the kernel, deterministic, no per-slot buffer."""
    wait_for_previous(PDL)
    token = tl.program_id(0)
    dt = OUT.dtype.element_ty
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        expert = tl.load(IDS + slot).to(tl.int64)
        rows = W + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
        a_row = A + slot.to(tl.int64) * stride_am
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            a = tl.load(a_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :],
                           other=0.0).to(tl.float32) * a
        y = tl.sum(acc, axis=1)
        if HAS_SCALE:
            y *= tl.load(S + expert * stride_se + cols, mask=col_ok, other=0.0)
        y = y.to(dt).to(tl.float32) * tl.load(TOPK_W + slot)
        out += y.to(dt).to(tl.float32)
    tl.store(OUT + token.to(tl.int64) * stride_om + cols, out.to(dt), mask=col_ok)


# --- configurations ------------------------------------------------------------------------------


def default_moe_config(tokens: int) -> dict:
    """Untuned: BLOCK_M 16 (tl.dot's smallest) up to 32 tokens, where most experts get a slot or two; 64 above."""
    if tokens <= 32:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def moe_config_stem(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype,
                    block: tuple[int, int] | None = None) -> str:
    """The shape's part of a tuned file's name (vLLM's scheme): E=..,I=..,H=..,dtype=..[,block=..x..]."""
    blocks = f",block={block[0]}x{block[1]}" if block else ""
    return f"E={num_experts},I={intermediate},H={hidden},dtype={str(dtype).removeprefix('torch.')}{blocks}"


def moe_config_path(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype, device_name: str,
                    block: tuple[int, int] | None = None, folder: Path | None = None) -> Path:
    """The file of this shape's configs on device_name's GPU in `folder` (default the shipped CONFIG_DIR; `tsdev tune`
    writes the user's own under `cache_dir()/tuned/moe_configs`). block: a block-FP8 checkpoint's experts, their
    own file."""
    stem = moe_config_stem(num_experts, intermediate, hidden, dtype, block)
    return (folder or CONFIG_DIR) / tuned_file_name(stem, device_name)


def tune_command(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype,
                 block: tuple[int, int] | None = None) -> str:
    """The `tsdev tune` that writes this shape's file on this GPU (named in the line that says none serves)."""
    kind = "block-fp8" if block else "fp8" if dtype == torch.float8_e4m3fn else "bf16"
    return f"tsdev tune --moe {num_experts},{intermediate},{hidden} --kinds {kind}"


@functools.lru_cache
def _moe_table(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype, gpu: str,
               block: tuple[int, int] | None) -> dict | None:
    """The table serving this shape on `gpu` (`find_tuned`'s order; block-FP8 experts without their own: the per-row
    FP8 experts' of the shape), found once per process, and one line saying which file serves -- at the warm-up of
    a start, never per request."""
    stem = moe_config_stem(num_experts, intermediate, hidden, dtype, block)
    found = find_tuned("moe_configs", stem, gpu, CONFIG_DIR)
    if found:
        tuned_log.info("MoE %s on the %s: tuned configs from %s (%s)", stem, gpu, found.path, found.source)
        return found.table
    fallback = find_tuned("moe_configs", moe_config_stem(num_experts, intermediate, hidden, dtype), gpu,
                          CONFIG_DIR) if block else None
    tuned_log.warning("no tuned MoE config %s for the %s: using %s (slower). Write it on this GPU with: %s (add "
                      "--topk K for K experts per token)", stem, gpu,
                      f"the FP8 experts' configs from {fallback.path}" if fallback else "defaults",
                      tune_command(num_experts, intermediate, hidden, dtype, block))
    return fallback.table if fallback else None


def moe_config(num_experts: int, intermediate: int, hidden: int, dtype: torch.dtype, tokens: int,
               device: torch.device | str | None = None, block: tuple[int, int] | None = None) -> dict:
    """dict(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for T = tokens on `device` (default: the current
    CUDA device, if any): from the tuned table of this shape (`_moe_table`: the user's `tsdev tune` file, the shipped
    one for this GPU, its sibling's) the entry of the token bucket nearest to `tokens` (the smaller on a tie); without
    one the default, said once per shape. CPU: the default, silently."""
    name = device_name(device)
    if name is None:
        return default_moe_config(tokens)
    table = _moe_table(num_experts, intermediate, hidden, dtype, name, block)
    return dict(nearest(table, tokens)) if table else default_moe_config(tokens)


# --- the op --------------------------------------------------------------------------------------


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, masked: bool | None = None, *, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, w8a8: bool | None = None,
                  block: tuple[int, int] | None = None) -> torch.Tensor:
    """Per chosen expert: its slots' rows through the MLP (float32 GEMMs; the module docstring's rounding), each
    slot's result put in place (index_add into zeros), then the float32 sum over K. masked (default: while a CUDA
    graph is being captured, as under TSDEV_KERNELS=ref:moe): every expert over every slot instead, each slot
    keeping its own expert's result (no host sync, E times the work). With scales the weights are e4m3 and each
    GEMM's float32 result is multiplied by its (expert, row) scale before rounding; w8a8 (default: as the Triton
    path at this many tokens, `uses_w8a8`) quantizes each GEMM's input rows first (`quantize_fp8_rows`) and
    multiplies by their scales too. `block` (a block-FP8 checkpoint's experts): the scales are each expert's block
    multipliers ([E, rows / block_n, columns / block_k]) and each GEMM is `fp8_block_linear_ref`."""
    T, H = x.shape
    K, dt, E = topk_ids.shape[1], x.dtype, w13.shape[0]
    flat_ids, flat_w = topk_ids.reshape(-1).long(), topk_weights.reshape(-1).float()
    per_slot = torch.zeros(T * K, H, dtype=dt, device=x.device)
    if w8a8 is None:
        w8a8 = block is None and uses_w8a8(T, w13_scale)

    def project(rows: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, e: int) -> torch.Tensor:
        if block is not None:
            return fp8_block_linear_ref(rows, w[e], scale[e], block)
        if w8a8:
            q, row_scales = quantize_fp8_rows(rows)
            return (F.linear(q.float(), w[e].float()) * row_scales * scale[e]).to(dt)
        y = F.linear(rows.float(), w[e].float())
        return (y if scale is None else y * scale[e]).to(dt)

    def expert_mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = project(rows, w13, w13_scale, e).chunk(2, dim=-1)
        h = (F.silu(gate.float()).to(dt).float() * up.float()).to(dt)
        return project(h, w2, w2_scale, e).float()

    if masked is None:
        masked = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if masked:
        per_token = x.repeat_interleave(K, dim=0)
        for e in range(E):
            y = (expert_mlp(e, per_token) * flat_w[:, None]).to(dt)
            per_slot = torch.where((flat_ids == e)[:, None], y, per_slot)
    else:
        for e in flat_ids.unique().tolist():
            slots = (flat_ids == e).nonzero().squeeze(1)
            y = expert_mlp(e, x[slots // K]) * flat_w[slots, None]
            per_slot.index_add_(0, slots, y.to(dt))
    return per_slot.view(T, K, H).sum(1, dtype=torch.float32).to(dt)


GEMV_MAX_TOKENS = 1  # up to this many tokens the GEMV path (no alignment): each slot reads its expert's rows itself
# (BLOCK_N, BLOCK_K, num_warps) of the GEMV path's up and down kernels: the best of `benchmarks/moe_layer.py
# --sweep-gemv` at one token on the H200 for Qwen3-30B-A3B's layer (28.4 us against 35.1 us for linear.py's dense GEMV
# rule; at 4 tokens the best pair took 84.0 us, the aligned GEMMs 76.7 us: hence one token)
GEMV_CONFIGS = ((8, 1024, 4), (2, 1024, 4))


def uses_w8a8(tokens: int, w13_scale: torch.Tensor | None) -> bool:
    """FP8 experts past the GEMV path's tokens quantize their activations (the aligned GEMMs multiply e4m3 by e4m3)."""
    return w13_scale is not None and tokens > GEMV_MAX_TOKENS


def _quantized(t: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's input rows in e4m3 with their scales: one per row (group None: [rows]) or per group of `group` columns
    (a block-FP8 checkpoint's: [rows, groups]). The Triton kernels on CUDA; elsewhere torch's (Triton's interpreter
    casts some values to e4m3 a binade down, 125.2 to 64, where a GPU and torch give 128)."""
    if group is not None:
        return (quantize_fp8_token_groups_triton if t.is_cuda else quantize_fp8_token_groups)(t, group)
    if t.is_cuda:
        return quantize_fp8_rows_triton(t)
    q, scales = quantize_fp8_rows(t)
    return q, scales.squeeze(-1)


def _quantizes_in_gemm(x: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether block-FP8 experts' aligned GEMMs may quantize their own input tiles (`_moe_gemm`'s QUANTIZE_A, one
    launch fewer per GEMM, the same e4m3 values; where the tuned configuration says `quantize_inside`, which
    `tsdev tune` sets where it measured it faster): on CUDA. Elsewhere `_quantized` first: torch's quantization, whose
    e4m3 cast Triton's interpreter does not match."""
    return block is not None and x.is_cuda


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_moe_gemv_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                          w2_scale: torch.Tensor | None = None, configs: tuple | None = None) -> torch.Tensor:
    """The path for a few tokens (decode): two launches and no alignment. `_moe_up_gemv` writes each slot's
    silu(gate) * up, one program per (slot, a few features); `_moe_down_gemv` one program per (token, a few
    outputs) runs the token's K experts and sums them. A slot reads its expert's rows itself, so tokens that share
    an expert read it twice (from L2 when close in time): the aligned GEMMs win once tokens share experts often."""
    T, H = x.shape
    I, K = w13.shape[1] // 2, topk_ids.shape[1]
    x, w13, w2 = _last_dim_contiguous(x), _last_dim_contiguous(w13), _last_dim_contiguous(w2)
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    inter = torch.empty(T * K, I, dtype=x.dtype, device=x.device)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    fp8 = w13_scale is not None
    s13, s2 = (w13_scale, w2_scale) if fp8 else (weights, weights)  # not read without scales
    use_pdl = pdl(x)
    up, down = configs or GEMV_CONFIGS
    bn, bk, warps = up
    _moe_up_gemv[(T * K, triton.cdiv(I, bn))](
        x, w13, s13, inter, ids, I, H, K, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), inter.stride(0),
        HAS_SCALE=fp8, BLOCK_N=bn, BLOCK_K=bk, PDL=use_pdl, num_warps=warps, launch_pdl=use_pdl)
    bn, bk, warps = down
    _moe_down_gemv[(T, triton.cdiv(H, bn))](
        inter, w2, s2, out, ids, weights, H, I, inter.stride(0), w2.stride(0), w2.stride(1), s2.stride(0),
        out.stride(0), TOP_K=K, HAS_SCALE=fp8, BLOCK_N=bn, BLOCK_K=bk, PDL=use_pdl, num_warps=warps,
        launch_pdl=use_pdl)
    return out


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: dict | None = None, *, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The Triton path (module docstring): up to GEMV_MAX_TOKENS tokens `fused_moe_gemv_triton`, else the aligned
    grouped GEMMs; config (`moe_config`'s keys, default `moe_config`'s choice) forces the GEMMs. `block`: a block-FP8
    checkpoint's experts (`fused_moe`'s scales), always the aligned GEMMs, each input quantized per row and group of
    block_k columns, BLOCK_K block_k and BLOCK_N at most block_n."""
    T, H = x.shape
    if config is None and T <= GEMV_MAX_TOKENS and block is None:
        return fused_moe_gemv_triton(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale)
    E, I, K = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    cfg = dict(config or moe_config(E, I, H, w13.dtype, T, device=x.device, block=block))
    if block is not None:
        cfg["BLOCK_N"], cfg["BLOCK_K"] = min(cfg["BLOCK_N"], block[0]), block[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x, w13, w2 = _last_dim_contiguous(x), _last_dim_contiguous(w13), _last_dim_contiguous(w2)
    weights = topk_weights.reshape(-1).float().contiguous()
    fp8 = w13_scale is not None
    s13, s2 = (w13_scale, w2_scale) if fp8 else (weights, weights)  # not read without scales
    num_slots = T * K
    sorted_ids, expert_ids, _ = moe_align_triton(topk_ids, E, bm)
    blocks = expert_ids.numel()
    inter = torch.empty(num_slots, I, dtype=x.dtype, device=x.device)
    per_slot = torch.empty(num_slots, H, dtype=x.dtype, device=x.device)
    if blocks:
        use_pdl = pdl(x)
        launch = dict(HAS_SCALE=fp8, A_FP8=fp8, SCALE_BLOCK_N=block[0] if block else 0,
                      F32_DOT=x.dtype == torch.float32 or not x.is_cuda, FP8_WGMMA=bool(cfg.get("fp8_wgmma")),
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      PDL=use_pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=use_pdl)

        group = block[1] if block else None  # a block-FP8 checkpoint's activations: per group of block_k columns
        inside = _quantizes_in_gemm(x, block) and bool(cfg.get("quantize_inside"))

        def gemm(kernel, a, w, scale, out, n, k, a_div, **flags):
            # W8A8: each GEMM's input rows quantized, by the GEMM itself for block-FP8 experts on CUDA
            a, a_s = _quantized(a, group) if fp8 and not inside else (a, weights)
            kernel[(blocks, triton.cdiv(n, bn))](
                a, a_s, w, scale, out, sorted_ids, expert_ids, weights, n, k, num_slots, a_div, a.stride(0),
                a_s.stride(0), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1) if block else 0,
                out.stride(0), QUANTIZE_A=inside, **flags, **launch)
        gemm(_moe_gated_gemm, x, w13, s13, inter, I, H, K, MUL_WEIGHT=False)  # x per token
        gemm(_moe_gemm, inter, w2, s2, per_slot, H, I, 1, MUL_WEIGHT=True)  # the activation per slot
    return per_slot.view(T, K, H).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * MLP_{topk_ids[t, k]}(x[t]), MLP_e(v) = (silu(v @ gate_e.T) * (v @ up_e.T))
    @ w2[e].T with gate_e = w13[e, :I], up_e = w13[e, I:]. x [T, H]; w13 [E, 2*I, H]; w2 [E, H, I]; topk_weights
    [T, K] float32; topk_ids [T, K] int32/int64 in [0, E). FP8 experts: w13 and w2 in e4m3 with w13_scale [E, 2*I]
    and w2_scale [E, H] float32, one per (expert, output row): weight-only on the GEMV path, W8A8 with dynamic
    per-row activation scales on the aligned GEMMs (the module docstring). A block-FP8 checkpoint's experts: `block`
    with w13_scale [E, 2*I / block_n, ceil(H / block_k)] and w2_scale [E, ceil(H / block_n), I / block_k], the
    reference's w8a8-block arithmetic on the aligned GEMMs at every token count.
    Returns [T, H] in x's dtype, rounded as the module docstring says. Triton on CUDA (no host sync, capturable),
    the reference elsewhere."""
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    if use_triton(x, "moe"):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, **scales, block=block)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, **scales, block=block)


# ---------------------------------------------------------------------------------------------------
# Checks on reload (kernels/tsdev_kernels/checks.py): the served layer's width, top-k and token counts, at most
# CHECK_EXPERTS experts (the weights are drawn for each check; the kernels' specialisations do not depend on the count).

CHECK_EXPERTS = 16
MOE_TOLERANCE = {
    torch.bfloat16: Tolerance(1e-2, 2e-2, "bf16: two float32 GEMMs per slot summed in another order than the "
                              "reference's, its roundings (after each GEMM, the SiLU, the weighted slot) kept"),
    torch.float16: Tolerance(2e-3, 4e-3, "fp16, as bf16 with 3 more mantissa bits"),
    torch.float32: Tolerance(1e-4, 1e-4, "float32 throughout: the sums' order"),
}


def _moe_inputs(shape, dtype, device, generator):
    tokens, hidden, inter, experts, top_k = shape
    randn = lambda *size: torch.randn(*size, generator=generator, device=device)  # noqa: E731
    x = randn(tokens, hidden).to(dtype)
    w13 = (randn(experts, 2 * inter, hidden) / hidden ** 0.5).to(dtype)
    w2 = (randn(experts, hidden, inter) / inter ** 0.5).to(dtype)
    weights, ids = randn(tokens, experts).softmax(-1).topk(top_k, dim=-1)  # a router's choice on random logits
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


MOE_FP8_TOLERANCE = {**MOE_TOLERANCE, torch.float32: Tolerance(
    1e-3, 1e-3, "float32 output of e4m3 products (on Hopper FP8 wgmma sums in reduced precision)")}


def _fp8_moe_inputs(shape, dtype, device, generator):
    """The experts in e4m3 with a float32 scale per (expert, output row), as --quantization fp8 stores them."""
    x, w13, w2, weights, ids = _moe_inputs(shape, dtype, device, generator)
    (q13, s13), (q2, s2) = quantize_fp8_rows(w13), quantize_fp8_rows(w2)
    return x, q13, q2, weights, ids, s13.squeeze(-1), s2.squeeze(-1)


def _fp8_block_moe_inputs(shape, dtype, device, generator):
    """The experts in e4m3 with a scale per 128 x 128 block, as a block-FP8 checkpoint stores them."""
    x, w13, w2, weights, ids = _moe_inputs(shape, dtype, device, generator)
    (q13, s13), (q2, s2) = ([torch.stack(t) for t in zip(*map(quantize_fp8_blocks, w.float()))] for w in (w13, w2))
    return x, q13, q2, weights, ids, s13, s2


def _moe_cost(x, w13, w2, weights, ids, *scales):
    """The tokens, their routing and the experts they reach (each one's weights and scales read once) read, the
    output [T, H] written; per (token, expert) two GEMMs: 2·(2I·H + H·I) FLOPs."""
    touched = int(ids.unique().numel())
    per_expert = sum(t[0].numel() * t.element_size() for t in (w13, w2, *scales))
    tokens, hidden = x.shape
    inter = w2.shape[-1]
    return (nbytes(x, weights, ids, x) + touched * per_expert,
            2 * tokens * ids.shape[1] * (2 * inter * hidden + hidden * inter))


def _moe_shapes(s, served: bool) -> list[tuple[int, ...]]:
    return [(t, s.hidden, s.moe_intermediate, min(s.experts, CHECK_EXPERTS), s.top_k)
            for t in s.tokens] if s.experts and served else []


MOE_KERNELS = ("_moe_up_gemv", "_moe_down_gemv", "_moe_gemm", "_moe_gated_gemm", "_moe_align_kernel")
CHECKS = [
    KernelCheck(op="fused_moe", kernels=MOE_KERNELS, shapes=lambda s: _moe_shapes(s, not (s.fp8 or s.fp8_blocks)),
                inputs=_moe_inputs, kernel=fused_moe_triton,
                reference=lambda x, w13, w2, w, ids: fused_moe_ref(x, w13, w2, w, ids, masked=False),
                tolerance=MOE_TOLERANCE, cost=_moe_cost),
    KernelCheck(op="fused_moe_fp8", kernels=MOE_KERNELS, shapes=lambda s: _moe_shapes(s, s.fp8),
                inputs=_fp8_moe_inputs,
                kernel=lambda x, w13, w2, w, ids, s13, s2: fused_moe_triton(x, w13, w2, w, ids, w13_scale=s13,
                                                                            w2_scale=s2),
                reference=lambda x, w13, w2, w, ids, s13, s2: fused_moe_ref(x, w13, w2, w, ids, masked=False,
                                                                            w13_scale=s13, w2_scale=s2),
                tolerance=MOE_FP8_TOLERANCE, cost=_moe_cost, tensor_cores="fp8"),
    KernelCheck(op="fused_moe_fp8_block", kernels=MOE_KERNELS, shapes=lambda s: _moe_shapes(s, s.fp8_blocks),
                inputs=_fp8_block_moe_inputs,
                kernel=lambda x, w13, w2, w, ids, s13, s2: fused_moe_triton(x, w13, w2, w, ids, w13_scale=s13,
                                                                            w2_scale=s2, block=BLOCK),
                reference=lambda x, w13, w2, w, ids, s13, s2: fused_moe_ref(x, w13, w2, w, ids, masked=False,
                                                                            w13_scale=s13, w2_scale=s2, block=BLOCK),
                tolerance=MOE_FP8_TOLERANCE, cost=_moe_cost, tensor_cores="fp8"),
]
