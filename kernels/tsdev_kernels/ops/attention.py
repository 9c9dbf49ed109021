"""Paged attention: the KV cache lives in fixed-size pages; each sequence has a page table.

Cache layout, per layer: k_cache and v_cache of shape [num_pages, page_size, num_kv_heads, head_dim].
A token's slot is page * page_size + offset; slot -1 marks a padding row that writes nothing.

One call serves a whole mixed batch: sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
(a prefill chunk or a single decode token), which are the last q_len of its seq_lens[i] tokens;
it attends causally to all of them, read through its page table (cached prefix included).

Triton paths (CUDA), picked from host ints so no step waits on the GPU:
* decode (max_q_len == 1): one program per (sequence, KV head, split). The query heads that share a
  KV head are packed into one tile, so each K/V row is read once for the whole group (GQA). Each
  sequence's KV length is cut into `num_splits` chunks (flash-decoding) so that batch 1 at a long
  context still fills the GPU; the last split of each (sequence, KV head) to finish merges the chunks by
  their log-sum-exp (an atomic arrival count; no second kernel to launch). The
  grid depends only on the batch size and head counts, so a CUDA graph captured once replays
  correctly for any seq_lens and page tables.
* prefill (max_q_len > 1): one program per (block of query rows, sequence, query head), streaming
  the sequence's pages in KV blocks with an online softmax and the causal mask offset by the cached
  prefix (query row j of a sequence sits at position seq_len - q_len + j).
K/V rows are gathered token by token through the page table, so any page size works.
Both kernels take an optional `order` of the sequences, longest first (`longest_first`): programs start in
grid order, so the shortest start last instead of a long one holding the GPU at the end of the launch.

Configurations follow the model's shapes (head_dim, KV heads per rank) and the SM count, never seq_lens:
* decode (`decode_splits`, `decode_block_n`): splits for ~4 programs per SM, at most 64 (128 with few KV
  heads); KV blocks of 32 rows (64 up to two splits) at head_dim 128, measured on the H200 with Qwen3-0.6B
  (`benchmarks/kernels_bench.py --sweep`), as many bytes per block at other head_dims. 4 warps, 3 stages.
* prefill (`prefill_blocks`): 64 x 64 tiles with 4 warps at head_dim 128 (measured likewise), 64 x 128
  at head_dim <= 64 (the same bytes per K/V block).
Every configuration the served shapes reach (Qwen3-0.6B; Llama-3.2-1B and Qwen2.5-1.5B, also at --tp 2)
compiles for sm_90 without register spills (tests/test_kernel_configs.py). Neither kernel specialises the
page table's width (`stride_pt`, the step's longest sequence in pages), nor decode its split count: Triton
would make one binary each of == 1, a multiple of 16 and other values, and eager steps (a 100-token prompt,
a batch size no graph has) would compile new ones while serving. Nor do the store and the prefill kernel
specialise the alignment of the slots and the order they read: a mixed step hands them the rows after its
decodes (`paged_attention`'s `decodes`), whose int64 slices start 16-byte aligned or not as that count is even or
odd. So the warm-up and the graph captures compile every binary a step can launch.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tsdev_kernels.checks import KernelCheck, Tolerance, nbytes
from tsdev_kernels.ops import pdl, sm_count, split_arrivals, use_triton, wait_for_previous

LOG2E = 1.4426950408889634
FP8_KV_DTYPE, FP8_MAX = torch.float8_e4m3fn, 448.0  # an fp8 KV cache (--kv-cache-dtype fp8): e4m3, +-448


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: unchanged in a cache of x's dtype; in an e4m3 cache, x / scale in float32,
    clamped to +-448 and rounded to nearest even (the kernels' store does the same)."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 values of cached rows (an e4m3 cache's times its scale)."""
    return x.float() * scale if x.dtype == FP8_KV_DTYPE else x.float()


def store_kvcache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """k, v: [T, Hk, D]; writes row t into slot slot_mapping[t] unless it is -1 (quantized in an e4m3 cache)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = quantize_kv(k[valid], kv_scales[0], k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = quantize_kv(v[valid], kv_scales[1], v_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. One sequence at a time, in float32 (an e4m3 cache's rows times its scales)."""
    out = torch.zeros_like(q) if out is None else out.zero_()
    page_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for i, (start, end, seq_len) in enumerate(zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(),
                                                  seq_lens.tolist())):
        q_len = end - start
        if q_len == 0:
            continue
        pages = page_table[i, : (seq_len + page_size - 1) // page_size].long()
        k = dequantize_kv(k_cache[pages].flatten(0, 1)[:seq_len], kv_scales[0]).repeat_interleave(group, dim=1)
        v = dequantize_kv(v_cache[pages].flatten(0, 1)[:seq_len], kv_scales[1]).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------------
# KV-cache store


@triton.jit(do_not_specialize=["SLOTS"])  # see the module docstring
def _store_kvcache_kernel(
    K, V, K_CACHE, V_CACHE, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cp, stride_cs, stride_ch,
    Hk, D, k_scale, v_scale, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr, QUANTIZED: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:  # -1: a padding row, writes nothing
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < Hk) & (cols < D)
        dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs + heads * stride_ch + cols
        k = tl.load(K + t * stride_kt + heads * stride_kh + cols, mask=mask)
        v = tl.load(V + t * stride_vt + heads * stride_vh + cols, mask=mask)
        if QUANTIZED:
            k, v = _quantized(k, k_scale, K_CACHE), _quantized(v, v_scale, V_CACHE)
        tl.store(K_CACHE + dst, k, mask=mask)
        tl.store(V_CACHE + dst, v, mask=mask)


@triton.jit
def _quantized(x, scale, CACHE):
    """x as an e4m3 cache stores it (`quantize_kv`)."""
    return tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0).to(CACHE.dtype.element_ty)


def store_kvcache_triton(k, v, k_cache, v_cache, slot_mapping, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    T, Hk, D = k.shape
    if T == 0:
        return
    use_pdl = pdl(k)
    _store_kvcache_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), Hk, D, *kv_scales,
        PAGE_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(Hk), BLOCK_D=triton.next_power_of_2(D),
        PDL=use_pdl, QUANTIZED=k_cache.dtype == FP8_KV_DTYPE, num_warps=4, launch_pdl=use_pdl,
    )


# ---------------------------------------------------------------------------------------------------
# Decode: one query row per sequence, KV split across programs, then merged


@triton.jit
def _kept_in_registers(x):
    """`x` (16-bit) unchanged, through an instruction the compiler may not move (`is_pure=False`). Decode attention
    over an e4m3 pool converts V to float16 in registers before the P @ V dot; left alone, Triton moves the
    conversion after the shared-memory copy of the dot operand, where an 8-bit operand along the reduced axis (V's
    rows) has no `ldmatrix` transpose and is read a byte at a time (64 `LDS.U8` a thread per 64-row block on sm_90;
    benchmarks/fp8_kv_variants.py on the H200: 21-25 % of the kernel's time)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit(do_not_specialize=["stride_pt", "num_splits"])  # see the module docstring
def _decode_kernel(
    Q, K_CACHE, V_CACHE, O, PART_O, PART_LSE, ARRIVED, CU, SEQ_LENS, PAGE_TABLE, K_NEW, V_NEW, SLOTS, ORDER,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_cs, stride_ch, stride_pt,
    stride_kt, stride_kh, stride_vt, stride_vh, Hq, Hk, num_splits, k_scale, v_scale,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT: tl.constexpr, STORE: tl.constexpr, ORDERED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    QUANTIZED: tl.constexpr, DOT: tl.constexpr, V_IN_REGISTERS: tl.constexpr,
):
    wait_for_previous(PDL)
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)  # programs start in this order: one sequence's heads and splits, then the next
    if ORDERED:
        b = tl.load(ORDER + b).to(tl.int32)
    row = tl.load(CU + b)
    q_len = tl.load(CU + b + 1) - row  # 1, or 0 for a sequence with no row this step
    seq_len = tl.load(SEQ_LENS + b)
    # this split's share of the sequence, in whole KV blocks (seq_len is read here, not baked into the grid)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    if STORE:  # this step's key and value go to the cache from the split whose share holds their position
        if (q_len > 0) & (seq_len - 1 >= start) & (seq_len - 1 < end):
            slot = tl.load(SLOTS + row).to(tl.int64)
            if slot >= 0:  # -1: a padding row, writes nothing
                dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs + kv_head * stride_ch + d
                k_new = tl.load(K_NEW + row * stride_kt + kv_head * stride_kh + d, mask=d < HEAD_DIM)
                v_new = tl.load(V_NEW + row * stride_vt + kv_head * stride_vh + d, mask=d < HEAD_DIM)
                if QUANTIZED:
                    k_new, v_new = _quantized(k_new, k_scale, K_CACHE), _quantized(v_new, v_scale, V_CACHE)
                tl.store(K_CACHE + dst, k_new, mask=d < HEAD_DIM)
                tl.store(V_CACHE + dst, v_new, mask=d < HEAD_DIM)
        tl.debug_barrier()  # every thread of this program reads them back below
    heads = kv_head * GROUP + h  # the query heads that read this KV head, one tile
    hd_mask = (h < GROUP * q_len)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hd_mask, other=0.0)
    if QUANTIZED:  # the dots run in DOT (`fp8_dot_dtype`), q clamped to its range
        if DOT == tl.float16:
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0)
        q = q.to(DOT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(PAGE_TABLE + b * stride_pt + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = page * stride_cp + (n % PAGE_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(K_CACHE + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANTIZED:  # e4m3 to DOT in registers, exactly; the scale is in scale_log2
            k = k.to(DOT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V_CACHE + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANTIZED:
            v = v.to(DOT)
            if V_IN_REGISTERS:  # compiled (not Triton's interpreter), 16-bit dots
                v = _kept_in_registers(v)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if QUANTIZED:
        acc = acc * v_scale

    if SPLIT:  # partial result + its log2-sum-exp; an empty split has l_i == 0 and writes -inf
        part = (b * Hq + heads) * num_splits + split
        tl.store(PART_O + part[:, None] * HEAD_DIM + d[None, :], acc / tl.maximum(l_i, 1e-30)[:, None], mask=hd_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(PART_LSE + part, lse, mask=h < GROUP * q_len)
        # the last split of this (sequence, KV head) to arrive merges them all: every thread's partial is
        # stored before the count is raised, and read after it (CUTLASS's split-K semaphore order)
        tl.debug_barrier()
        arrived = tl.atomic_add(ARRIVED + b * Hk + kv_head, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            tl.debug_barrier()
            tl.store(ARRIVED + b * Hk + kv_head, 0)  # zero again for the next launch
            if q_len > 0:
                sp = tl.arange(0, BLOCK_S)
                filled = sp < tl.cdiv(seq_len, chunk)  # the splits past the sequence's end hold nothing
                for g in tl.static_range(GROUP):
                    parts = (b * Hq + kv_head * GROUP + g) * num_splits + sp
                    lses = tl.load(PART_LSE + parts, mask=filled, other=float("-inf"), cache_modifier=".cg")
                    w = tl.exp2(lses - tl.max(lses, axis=0))
                    o = tl.load(PART_O + parts[:, None] * HEAD_DIM + d[None, :],
                                mask=filled[:, None] & (d < HEAD_DIM)[None, :], other=0.0, cache_modifier=".cg")
                    merged = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
                    tl.store(O + row * stride_ot + (kv_head * GROUP + g) * stride_oh + d,
                             merged.to(O.dtype.element_ty), mask=d < HEAD_DIM)
    else:
        out = acc / l_i[:, None]
        tl.store(O + row * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=hd_mask)


def decode_splits(batch: int, num_kv_heads: int, sms: int) -> int:
    """KV splits per sequence on a GPU of `sms` SMs: enough programs for ~4 per SM. Depends on shapes only
    (graph-safe), never on seq_lens, so a captured graph and an eager step on the same batch run the same
    arithmetic. At most 64 (on Qwen3-0.6B at batch 1, 4096 tokens of context, the best of the H200 sweep:
    1-64 splits), or 128 where 64 would leave fewer than 2 programs per SM (few KV heads: Qwen2.5-1.5B's 2,
    one per rank under tensor parallelism); the last split's merge tile, BLOCK_S x head_dim float32, compiles
    for sm_90 without spills at 128 x 128 and 128 x 64."""
    cap = 128 if batch * num_kv_heads * 64 < 2 * sms else 64
    return max(1, min(cap, triton.cdiv(4 * sms, batch * num_kv_heads)))


def decode_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """`decode_splits` for `device`'s SM count; 2 off CUDA (the interpreter tests)."""
    if device.type != "cuda":
        return 2
    return decode_splits(batch, num_kv_heads, sm_count(device.index or 0))


def decode_block_n(num_splits: int, head_dim: int, kv_bytes: int = 2) -> int:
    """KV rows per block of the decode kernel: measured on the H200 at head_dim 128 (Qwen3-0.6B), 32 with more
    than two splits, else 64 (each program then walks a whole sequence or half: at batch 256 and 512 tokens,
    131 vs 139 us with 3 stages); at other head_dims and in an e4m3 pool (`kv_bytes` 1) the same bytes per K/V
    block (head_dim 64: 64 / 128 rows; e4m3 at 128: 64 / 128, the best of 16-128 rows at B = 64, 139 and 256 in
    benchmarks/fp8_kv.py, 3-9 % faster than 64 / 32)."""
    rows = (32 if num_splits > 2 else 64) * 128 // triton.next_power_of_2(head_dim)
    return max(16, rows * 2 if kv_bytes == 1 else rows)  # (a float32 pool: the rows of bf16's, as before)


def prefill_blocks(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the prefill kernel on CUDA (4 warps): 64 x 64 at head_dim 128, measured on the H200
    (within 5 % of the best of 12 configurations in every case swept); at head_dim <= 64 KV blocks of 128 rows and
    above 128 (DeepSeek's expanded heads, 192 wide in a 256 block) of 32, the same bytes per K/V block (not
    measured; each compiles for sm_90 without spills, where 64 x 64 spills at 192)."""
    return 64, 64 * 128 // min(256, max(64, triton.next_power_of_2(head_dim)))


def longest_first(seq_lens: list[int], size: int | None = None) -> list[int]:
    """The attention kernels' `order`: sequence indices by KV length, longest first, then the padding rows up to
    `size`. Programs start in grid order and take as long as their sequence: started longest first, the short
    ones fill the end of the launch instead of a long one keeping most SMs idle while it finishes."""
    n = len(seq_lens)
    return sorted(range(n), key=seq_lens.__getitem__, reverse=True) + list(range(n, size or n))


def paged_decode_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, scale,
                        num_splits: int | None = None, block_n: int | None = None, out=None,
                        store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        num_warps: int = 4, num_stages: int = 3, order: torch.Tensor | None = None,
                        kv_scales: tuple[float, float] = (1.0, 1.0),
                        fp8_dot: torch.dtype | None = None) -> torch.Tensor:
    """Decode attention; with store = (k, v, slot_mapping) this step's keys and values are written into the cache
    first, by the kernel itself (each by the split that reads its position back). order [B] (a permutation of
    the sequences, longest first): the order their programs start in, so the last to start are the shortest
    (`longest_first`). kv_scales: an e4m3 cache's (k, v) scales. fp8_dot: the dtype an e4m3 cache's rows, q and
    the softmax weights meet in (default `fp8_dot_dtype`)."""
    B = seq_lens.shape[0]
    T, Hq, D = q.shape
    Hk = k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if B == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(B, Hk, q.device)
    split = num_splits > 1
    if block_n is None:
        block_n = decode_block_n(num_splits, D, k_cache.element_size()) if q.is_cuda else 16
    part_o = torch.empty((B, Hq, num_splits, D) if split else (1,), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, Hq, num_splits) if split else (1,), dtype=torch.float32, device=q.device)
    group = Hq // Hk
    use_pdl, quantized, dot = pdl(q), k_cache.dtype == FP8_KV_DTYPE, fp8_dot or fp8_dot_dtype(q.dtype)
    if fp8_dot is not None and not quantized:
        raise ValueError(f"fp8_dot applies to an e4m3 KV cache; this one is {k_cache.dtype}")
    k, v, slots = store if store is not None else (q, q, cu_seqlens_q)
    _decode_kernel[(Hk, num_splits, B)](
        q, k_cache, v_cache, out, part_o, part_lse, split_arrivals(q.device, B * Hk) if split else part_lse,
        cu_seqlens_q, seq_lens, page_table, k, v, slots, order if order is not None else seq_lens,
        scale * LOG2E * (kv_scales[0] if quantized else 1.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), page_table.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1), Hq, Hk, num_splits,
        *kv_scales,
        GROUP=group, PAGE_SIZE=k_cache.shape[1], HEAD_DIM=D,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=triton.next_power_of_2(D), BLOCK_N=block_n,
        BLOCK_S=triton.next_power_of_2(num_splits), SPLIT=split, STORE=store is not None, ORDERED=order is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=use_pdl, QUANTIZED=quantized,
        DOT=_TL_DTYPES[dot], V_IN_REGISTERS=quantized and q.is_cuda and dot != torch.float32,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=use_pdl,
    )
    return out


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def fp8_dot_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """What decode attention over an e4m3 cache converts its rows to for the tensor-core dots: float16 for a 16-bit
    q (e4m3 -> f16 is one instruction per pair of elements, to bf16 several; q and the softmax weights, in [0, 1],
    keep more mantissa in it), float32 for a float32 q."""
    return torch.float32 if q_dtype == torch.float32 else torch.float16


# ---------------------------------------------------------------------------------------------------
# Prefill: ragged query blocks over each sequence's pages, causal, cached prefix included


@triton.jit(do_not_specialize=["stride_pt", "ORDER"])  # see the module docstring
def _prefill_kernel(
    Q, K_CACHE, V_CACHE, O, CU, SEQ_LENS, PAGE_TABLE, ORDER,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cp, stride_cs, stride_ch, stride_pt, v_scale,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ORDERED: tl.constexpr,
    PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
):
    # programs start in this order: a sequence's last query blocks (the longest causal reach) first, and the
    # query heads that share a KV head side by side, so the second reads its keys and values from L2
    head = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    if ORDERED:
        b = tl.load(ORDER + b).to(tl.int32)
    q_start = tl.load(CU + b)
    q_len = tl.load(CU + b + 1) - q_start
    if m_block * BLOCK_M < q_len:  # the grid covers the longest query; shorter ones leave programs idle
        seq_len = tl.load(SEQ_LENS + b)
        kv_head = head // GROUP
        m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q_mask = (m < q_len)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(Q + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
        pos = seq_len - q_len + m  # absolute position of each query row: the cached prefix comes first

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        end = tl.minimum(seq_len, seq_len - q_len + (m_block + 1) * BLOCK_M)  # causal: nothing past the last row
        for n0 in range(0, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < end
            page = tl.load(PAGE_TABLE + b * stride_pt + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            kv_off = page * stride_cp + (n % PAGE_SIZE) * stride_cs + kv_head * stride_ch
            kv_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(K_CACHE + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if QUANTIZED:  # as decode's
                k = k.to(Q.dtype.element_ty)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            s = tl.where(n_mask[None, :] & (n[None, :] <= pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V_CACHE + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if QUANTIZED:
                v = v.to(Q.dtype.element_ty)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if QUANTIZED:
            acc = acc * v_scale
        out = acc / l_i[:, None]
        tl.store(O + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=q_mask)


def paged_prefill_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, scale, max_q_len: int,
                         block_m: int | None = None, block_n: int | None = None, num_warps: int = 4,
                         out=None, order: torch.Tensor | None = None,
                         kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Attention of a mixed batch (prefill chunks and decode rows). order, kv_scales: as paged_decode_triton's; an
    order shorter than the batch runs only the sequences it names (`paged_attention`'s `decodes`)."""
    B = seq_lens.shape[0] if order is None else order.shape[0]
    T, Hq, D = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if B == 0 or max_q_len == 0:
        return out
    cuda_m, cuda_n = prefill_blocks(D)
    quantized = k_cache.dtype == FP8_KV_DTYPE
    block_m = block_m or (cuda_m if q.is_cuda else 16)
    block_n = block_n or (cuda_n if q.is_cuda else 16)
    _prefill_kernel[(Hq, triton.cdiv(max_q_len, block_m), B)](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, page_table, order if order is not None else seq_lens,
        scale * LOG2E * (kv_scales[0] if quantized else 1.0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0), kv_scales[1],
        GROUP=Hq // k_cache.shape[2], PAGE_SIZE=k_cache.shape[1], HEAD_DIM=D,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(D), ORDERED=order is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANTIZED=quantized, num_warps=num_warps,
        num_stages=2,
    )
    return out


# ---------------------------------------------------------------------------------------------------
# Public ops


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Write k, v [T, Hk, D] (last dim contiguous; v may be a strided view of the qkv projection) into
    k_cache, v_cache [num_pages, page_size, Hk, D] at slot_mapping [T] (int64, page * page_size + offset).
    Rows whose slot is -1 (graph padding) write nothing. In place; no sync."""
    if use_triton(k, "attention"):
        store_kvcache_triton(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    else:
        store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, kv_scales)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    scale: float,
    *,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    order: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    decodes: int = 0,
) -> torch.Tensor:
    """Causal attention of a mixed batch over the paged KV cache (this step's K/V stored first when `store` is
    given, else already in it).

    q [T, Hq, D] (last dim contiguous); k_cache, v_cache [num_pages, page_size, Hk, D] with Hq % Hk == 0;
    cu_seqlens_q [B + 1] int32; seq_lens [B] int32 (KV length after this step, >= q_len);
    page_table [B, max_pages] int32 (padding entries must be valid page indices, e.g. 0).
    Returns [T, Hq, D] in q's dtype (written into `out` when given), softmax in float32. Rows owned by no
    sequence are left unspecified (the reference zeros them).

    max_q_len is a host int (the runner's Context has it), so choosing the kernel never
    waits on the GPU: max_q_len == 1 takes the decode kernel, whose grid depends only on the batch size
    and head counts (safe to capture once and replay with other seq_lens / page tables); otherwise the
    prefill kernel, whose grid covers max_q_len. Leaving max_q_len out costs one device->host sync to find it.

    store = (k, v, slot_mapping): this step's keys and values, written into the cache first (`store_kvcache`'s
    arguments); the decode kernel writes them itself, one launch fewer per layer. order [B]: the order the
    kernels start the sequences' programs in (`longest_first`); the results do not depend on it.

    decodes (a mixed step, with order): the batch's first `decodes` sequences have one row each and order[:decodes]
    permutes them (`split_order`). On Triton they run on the decode kernel as a decode step of that many sequences
    would (its binaries; it stores their rows) and the rest on the prefill kernel, which would give each decode row a
    64-row tile of its own per query head: 64x the tensor-core work over the same keys (docs/runtime.md).
    """
    triton_ok = use_triton(q, "attention")
    if seq_lens.shape[0] == 1:  # one sequence: nothing to order, and reading the order costs a load per program
        order = None
    if triton_ok and max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if seq_lens.numel() else 0
    if triton_ok and max_q_len == 1:
        return paged_decode_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, scale, out=out, store=store,
                                   order=order, kv_scales=kv_scales)
    split = triton_ok and 0 < decodes < seq_lens.shape[0] and order is not None
    if split:  # the decode rows as a decode step of `decodes` sequences runs them (the same binaries), storing theirs
        out = paged_decode_triton(q, k_cache, v_cache, cu_seqlens_q[: decodes + 1], seq_lens[:decodes],
                                  page_table[:decodes], scale, out=out, store=store,
                                  order=order[:decodes] if decodes > 1 else None, kv_scales=kv_scales)
        order = order[decodes:]  # the other sequences, by their index in the whole batch
        store = store and tuple(t[decodes:] for t in store)  # the decode kernel stored the first `decodes` rows
    if store is not None:
        k, v, slot_mapping = store
        store_kvcache(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    if not triton_ok:
        return paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, scale, out=out,
                                   kv_scales=kv_scales)
    return paged_prefill_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, scale, max_q_len, out=out,
                                order=order, kv_scales=kv_scales)


def split_order(q_lens: list[int], seq_lens: list[int]) -> tuple[int, list[int]]:
    """(decodes, order) of a step: its leading sequences of one row each when a longer one follows (a mixed step;
    the scheduler puts decodes first), else 0; and `longest_first` of those, then of the rest (by their index in the
    whole batch) -- one permutation of the batch, which `paged_attention(decodes=...)` runs in two launches."""
    decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    if decodes == len(q_lens):
        return 0, longest_first(seq_lens)
    rest = longest_first(seq_lens[decodes:])
    return decodes, longest_first(seq_lens[:decodes]) + [decodes + i for i in rest]


# ---------------------------------------------------------------------------------------------------
# Checks on reload (kernels/tsdev_kernels/checks.py): batches as serving builds them -- pages in random order, sequences
# of mixed length, prefill chunks behind a cached prefix, this step's K/V stored by the kernel -- against the reference.

ATTENTION_TOLERANCE = {
    torch.bfloat16: Tolerance(1e-2, 2e-2, "bf16 q/K/V and output: softmax and sums in float32 (online, in another "
                              "order than the reference's), tf32 products in the prefill kernel, one bf16 rounding"),
    torch.float16: Tolerance(2e-3, 4e-3, "fp16, as bf16 with 3 more mantissa bits"),
    torch.float32: Tolerance(1e-4, 1e-4, "float32 throughout (IEEE products): the online softmax's order"),
}


@dataclass(frozen=True)
class PagedSteps:
    """A step's metadata as the runner builds it, for sequences of q_lens new tokens behind `cached` ones: every
    sequence's pages drawn in random order from one pool of `num_pages` (3 more than they use)."""
    num_pages: int
    page_table: torch.Tensor  # [B, max pages] int32
    slot_mapping: torch.Tensor  # [T] int64: each new token's slot
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    order: torch.Tensor  # longest first, as the runner's
    max_q_len: int

    @classmethod
    def draw(cls, q_lens: list[int], cached: list[int], page_size: int, device, generator) -> "PagedSteps":
        seq_lens = [q + c for q, c in zip(q_lens, cached)]
        pages_of = [-(-n // page_size) for n in seq_lens]
        pool = torch.randperm(sum(pages_of) + 3, generator=generator, device=device).to(torch.int32)
        table = torch.zeros(len(seq_lens), max(pages_of), dtype=torch.int32, device=device)
        start = 0
        for i, n in enumerate(pages_of):
            table[i, :n] = pool[start:start + n]
            start += n
        slots = torch.cat([table[i, torch.arange(c, n, device=device) // page_size].long() * page_size
                           + torch.arange(c, n, device=device) % page_size
                           for i, (c, n) in enumerate(zip(cached, seq_lens))])
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        return cls(len(pool), table, slots, cu, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                   torch.tensor(longest_first(seq_lens), dtype=torch.int64, device=device), max(q_lens))


def decode_step(batch: int, context: int, generator, device) -> tuple[list[int], list[int]]:
    """(q_lens, cached) of a decode step: one row per sequence, behind 0..context cached tokens (mixed lengths)."""
    return [1] * batch, torch.randint(0, context, (batch,), generator=generator, device=device).tolist()


def mixed_step(tokens: int, context: int, generator, device) -> tuple[list[int], list[int]]:
    """(q_lens, cached) of a mixed step of `tokens` rows: a chunk behind a cached prefix, a whole prompt, and decode
    rows."""
    decode = min(2, tokens - 2)
    chunk = (tokens - decode) // 2
    q_lens = [chunk, tokens - decode - chunk, *[1] * decode]
    cached = [int(torch.randint(1, max(context - chunk, 2), (1,), generator=generator, device=device)), 0,
              *torch.randint(1, context, (decode,), generator=generator, device=device).tolist()]
    return q_lens, cached


def _paged_batch(q_lens: list[int], cached: list[int], heads: tuple[int, int, int], page_size: int, dtype, device,
                 generator, kv_dtype=None) -> tuple:
    """q, k_cache, v_cache, cu_seqlens_q, seq_lens, page_table, k, v, slot_mapping, order, max_q_len for a step
    (`PagedSteps`), the cache random (in `kv_dtype`, default `dtype`: an e4m3 pool holds the random values as its
    store would)."""
    hq, hk, d = heads
    step = PagedSteps.draw(q_lens, cached, page_size, device, generator)
    cache = lambda: quantize_kv(  # noqa: E731
        torch.randn(step.num_pages, page_size, hk, d, generator=generator, device=device), 1.0, kv_dtype or dtype)
    k_cache, v_cache = cache(), cache()
    tokens = sum(q_lens)
    q = torch.randn(tokens, hq, d, generator=generator, device=device).to(dtype)
    k, v = (torch.randn(tokens, hk, d, generator=generator, device=device).to(dtype) for _ in range(2))
    if kv_dtype == FP8_KV_DTYPE:  # this step's rows on e4m3's grid: the check is of attention over the pool, run
        # under Triton's interpreter too, whose e4m3 rounding differs from the GPU's (tests/test_fp8_kv_gpu.py
        # checks the store's rounding bit for bit there)
        k, v = (quantize_kv(x, 1.0, kv_dtype).to(dtype) for x in (k, v))
    return (q, k_cache, v_cache, step.cu_seqlens_q, step.seq_lens, step.page_table, k, v, step.slot_mapping,
            step.order, step.max_q_len)


def _decode_inputs(shape, dtype, device, generator, kv_dtype=None):
    batch, hq, hk, d, page_size, context = shape
    return _paged_batch(*decode_step(batch, context, generator, device), (hq, hk, d), page_size, dtype, device,
                        generator, kv_dtype)


def _prefill_inputs(shape, dtype, device, generator, kv_dtype=None):
    tokens, hq, hk, d, page_size, context = shape
    return _paged_batch(*mixed_step(tokens, context, generator, device), (hq, hk, d), page_size, dtype, device,
                        generator, kv_dtype)


def _attention_ref(q, k_cache, v_cache, cu, lens, table, k, v, slots, order, max_q_len):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(k, v, k_cache, v_cache, slots)
    return paged_attention_ref(q, k_cache, v_cache, cu, lens, table, q.shape[-1] ** -0.5)


def _decode_check(q, k_cache, v_cache, cu, lens, table, k, v, slots, order, max_q_len):
    """In place, as serving runs it: storing this step's K/V again writes the same values (timed calls repeat it);
    nothing waits on the host (a timing captures it in a CUDA graph)."""
    return paged_decode_triton(q, k_cache, v_cache, cu, lens, table, q.shape[-1] ** -0.5, store=(k, v, slots),
                               order=order)


def _prefill_check(q, k_cache, v_cache, cu, lens, table, k, v, slots, order, max_q_len):
    store_kvcache_triton(k, v, k_cache, v_cache, slots)  # in place, as _decode_check
    return paged_prefill_triton(q, k_cache, v_cache, cu, lens, table, q.shape[-1] ** -0.5, max_q_len, order=order)


def keys_seen(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int]:
    """(tokens of KV a step reads: each sequence's whole length, the (query row, key) pairs causal attention
    computes: row j of a sequence of q_len rows behind `cached` sees cached + j + 1 keys)."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    lens = seq_lens.tolist()
    pairs = sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(q_lens, lens))
    return sum(lens), pairs


def _attention_cost(q, k_cache, v_cache, cu, lens, table, k, v, slots, order, max_q_len):
    """q and the step's K/V read, the K/V stored, each sequence's K and V read once from the pool, the output
    written (q's size), the step's metadata; QK^T and PV: 4·head_dim FLOPs per query head and (row, key) pair."""
    tokens, pairs = keys_seen(cu, lens)
    kv_heads, head_dim = k_cache.shape[-2:]
    pool = 2 * tokens * kv_heads * head_dim * k_cache.element_size()
    step_kv = k.numel() * 2 * k_cache.element_size()  # stored in the pool's dtype
    return (nbytes(q, k, v, q, cu, lens, table, slots, order) + step_kv + pool,
            4 * pairs * q.shape[1] * head_dim)


def _attention_shapes(decode: bool, fp8: bool = False):
    """The served batches, for the pool's dtype only: the fp8 checks where the pool is e4m3, the others elsewhere."""
    def shapes(s):
        if fp8 != s.kv_fp8 or s.latent_dim:  # a latent-attention model's are mla.py's
            return []
        rows = [t for t in s.tokens if t <= s.max_running] if decode else [t for t in s.tokens if t >= 4]
        return [(t, s.q_heads, s.kv_heads, s.head_dim, s.page_size, s.max_context) for t in rows]
    return shapes


CHECKS = [
    KernelCheck(op="paged_decode", kernels=("_decode_kernel",), shapes=_attention_shapes(decode=True),
                inputs=_decode_inputs, kernel=_decode_check, reference=_attention_ref,
                tolerance=ATTENTION_TOLERANCE, cost=_attention_cost),
    KernelCheck(op="paged_prefill", kernels=("_prefill_kernel", "_store_kvcache_kernel"),
                shapes=_attention_shapes(decode=False), inputs=_prefill_inputs, kernel=_prefill_check,
                reference=_attention_ref, tolerance=ATTENTION_TOLERANCE,
                cost=_attention_cost),
    # an e4m3 pool (--kv-cache-dtype fp8): the same batches, its rows quantized as the store does, scales 1
    KernelCheck(op="paged_decode_fp8", kernels=("_decode_kernel",), shapes=_attention_shapes(decode=True, fp8=True),
                inputs=lambda shape, dtype, device, generator: _decode_inputs(shape, dtype, device, generator,
                                                                              FP8_KV_DTYPE),
                kernel=_decode_check, reference=_attention_ref, tolerance=ATTENTION_TOLERANCE,
                cost=_attention_cost),
    KernelCheck(op="paged_prefill_fp8", kernels=("_prefill_kernel", "_store_kvcache_kernel"),
                shapes=_attention_shapes(decode=False, fp8=True),
                inputs=lambda shape, dtype, device, generator: _prefill_inputs(shape, dtype, device, generator,
                                                                               FP8_KV_DTYPE),
                kernel=_prefill_check, reference=_attention_ref, tolerance=ATTENTION_TOLERANCE,
                cost=_attention_cost),
]
