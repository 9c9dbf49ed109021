"""Block-quantized FP8, as the FP8 checkpoints people serve store it (Qwen's `*-FP8` releases, DeepSeek-V3): e4m3
weights with one float32 multiplier per block of 128 x 128 (`<name>.weight_scale_inv`: weight ~ e4m3 x the scale of its
block), and activations quantized at run time per token and per group of 128 columns (`activation_scheme:
dynamic`). The torch references of that arithmetic (what the checkpoint writer of the tests stores) and the Triton
kernels checked against them: `quantize_fp8_token_groups_triton` (one program per token and group) and
`fp8_block_linear_triton` (a GEMM whose K loop steps one block at a time, after the group quantization or quantizing
each activation tile's groups itself where `tsdev tune` measured that faster; each block's e4m3 product starts from
zero, is multiplied by the token's group scale and the weight block's scale and added to a float32 sum -- so the
reduced-precision sums of Hopper's FP8 tensor cores never run past one block, the scheme of DeepSeek's DeepGEMM).
`fp8_block_linear` serves layers: the Triton kernels on CUDA (their GPU test: tests/test_fp8_block_gpu.py), or
torch._scaled_mm's block-scaled cuBLASLt GEMM at the token counts where the crossover `tsdev tune` measures says it is
faster (`uses_scaled_mm`; TSDEV_KERNELS=cublas:fp8 or triton:fp8 forces a side), the reference elsewhere and under
TSDEV_KERNELS=ref:fp8.

A weight whose sizes are not multiples of the block has partial blocks at its edges (the scales' shape is
ceil(N / block_n) x ceil(K / block_k), as DeepSeek's); each block's scale is its largest magnitude / 448 (e4m3's
largest finite value), 1 for an all-zero block, as transformers' fine-grained FP8 quantizer writes it.
"""
import functools
from pathlib import Path

import torch
import triton
import triton.language as tl

from tsdev_kernels.checks import KernelCheck, Tolerance, matmul_cost, nbytes
from tsdev_kernels.ops import (device_name, find_tuned, nearest, pdl, routed, sm_count, split_arrivals,
                               tuned_file_name, tuned_log, use_triton, wait_for_previous)
from tsdev_kernels.ops.linear import _matrix, gemv_config

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
E4M3_RECIPROCAL = 1 / E4M3_MAX  # a float32 multiplier once in a tensor's arithmetic
BLOCK = (128, 128)  # (block_n, block_k): the only block size shipped checkpoints use


def _blocked(t: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """t [N, K] zero-padded to whole blocks, viewed [N / block_n, block_n, K / block_k, block_k]."""
    n, k = t.shape
    padded = torch.nn.functional.pad(t, (0, -k % block_k, 0, -n % block_n))
    return padded.view(padded.shape[0] // block_n, block_n, padded.shape[1] // block_k, block_k)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], weight_scale_inv float32 [ceil(N / block_n), ceil(K / block_k)])."""
    n, k = weight.shape
    tiles = _blocked(weight.float(), *block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, E4M3_MAX / torch.where(amax > 0, amax, 1.0), torch.ones_like(amax))
    scale_inv = 1.0 / scale  # the stored multiplier, computed as transformers' quantizer computes it
    scaled = tiles * scale[:, None, :, None]
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(tiles.shape[0] * block[0], tiles.shape[2] * block[1])
    return q[:n, :k].contiguous(), scale_inv


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(e4m3 [N, K], scales [ceil(N / block_n), ceil(K / block_k)]) -> the weight [N, K] in `dtype`."""
    n, k = q.shape
    expected = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a weight of {n} x {k} in blocks of "
                         f"{block[0]} x {block[1]}: expected {expected}")
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (q.float() * scales).to(dtype)


def quantize_fp8_token_groups(x: torch.Tensor, group: int = BLOCK[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [T, K] -> (e4m3 [T, K], scales float32 [T, ceil(K / group)]), each token's
    group of `group` columns scaled so that its largest magnitude is 448 (1 for an all-zero group)."""
    t, k = x.shape
    groups = torch.nn.functional.pad(x.float(), (0, -k % group)).view(t, -1, group)
    amax = groups.abs().amax(dim=-1)
    # amax times 448's float32 reciprocal, not amax / 448, which torch computes that way on CUDA but exactly on a CPU:
    # the reference says which; then an exact (IEEE) division, as the kernel's, bit for bit
    scale = torch.where(amax > 0, amax * E4M3_RECIPROCAL, torch.ones_like(amax))
    q = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(t, -1)[:, :k]
    return q.contiguous(), scale


def fp8_block_gemm_ref(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                       weight_scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The block GEMM of activations already quantized (xq [T, K] e4m3, x_scale [T, ceil(K / block_k)]) in float32:
    for each block of K the e4m3 product (exact in float32) times the token's group scale and the weight block's
    scale, summed over the blocks in float32 (+ bias). What both the Triton block GEMM and torch._scaled_mm with
    DeepSeek-style block scales (`fp8_block_scaled_mm`) compute, up to the order of the float32 sums; the caller
    rounds once."""
    block_n, block_k = block
    n, k = weight.shape
    kb = x_scale.shape[1]
    xs = torch.nn.functional.pad(xq.float(), (0, -k % block_k)).view(xq.shape[0], kb, block_k)
    ws = torch.nn.functional.pad(weight.float(), (0, -k % block_k)).view(n, kb, block_k)
    partial = torch.einsum("tbk,nbk->tbn", xs, ws)  # per K block: [T, blocks, N]
    w_scale = weight_scale_inv.float().repeat_interleave(block_n, 0)[:n]  # [N, blocks]
    y = (partial * x_scale[:, :, None] * w_scale.t()[None]).sum(dim=1)
    return y + bias.float() if bias is not None else y


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         block: tuple[int, int] = BLOCK, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y ~ x @ W.T (+ bias) the way a w8a8-block kernel computes it: x [..., K] quantized per token and group of
    block_k columns (`quantize_fp8_token_groups`), then `fp8_block_gemm_ref`; rounded to x's dtype once."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_fp8_token_groups(rows, block[1])
    y = fp8_block_gemm_ref(xq, x_scale, weight, weight_scale_inv, block, bias)
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


_MAX = tl.constexpr(448.0)  # E4M3_MAX, for the kernels
_RECIPROCAL = tl.constexpr(1 / 448.0)  # E4M3_RECIPROCAL


@triton.jit
def _token_group_quant_kernel(X, Q, S, K, stride_x, stride_q, stride_s, GROUP: tl.constexpr, PDL: tl.constexpr):
    """One token's (program 0) group of GROUP columns (program 1): `quantize_fp8_token_groups`' arithmetic."""
    wait_for_previous(PDL)
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    t = tl.load(X + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(t), axis=0)
    scale = tl.where(amax > 0, amax * _RECIPROCAL, 1.0)
    # div_rn: an IEEE-rounded division, as torch's; Triton's `/` on a GPU is the approximate div.full.f32, which
    # moves a value across an e4m3 rounding tie now and then (the check is bit for bit)
    q = tl.math.div_rn(t, tl.full([GROUP], 1.0, tl.float32) * scale)
    tl.store(Q + row * stride_q + cols, tl.clamp(q, -_MAX, _MAX).to(Q.dtype.element_ty), mask=cols < K)
    tl.store(S + row * stride_s + group, scale)


def quantize_fp8_token_groups_triton(x: torch.Tensor, group: int = BLOCK[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_token_groups` of x [T, K] (last dim contiguous) in one launch."""
    t, k = x.shape
    groups = -(-k // group)
    q = torch.empty(t, k, dtype=E4M3, device=x.device)
    scale = torch.empty(t, groups, dtype=torch.float32, device=x.device)
    if t:
        use_pdl = pdl(x)
        _token_group_quant_kernel[(t, groups)](x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), GROUP=group,
                                               PDL=use_pdl, num_warps=1 if group <= 128 else 4, launch_pdl=use_pdl)
    return q, scale


@triton.jit
def quantize_tile(a, ROWS: tl.constexpr, GROUP: tl.constexpr, dtype: tl.constexpr):
    """A [ROWS, GROUP] tile of activations (one group of columns per row) as `_token_group_quant_kernel` quantizes
    each row's group, bit for bit: (e4m3 values in `dtype`, float32 scales [ROWS]). The GEMMs that quantize their
    own tiles (`_block_gemm_kernel`, moe.py's `_moe_gemm`) call it."""
    a32 = a.to(tl.float32)
    amax = tl.max(tl.abs(a32), axis=1)
    scale = tl.where(amax > 0, amax * _RECIPROCAL, 1.0)
    q = tl.math.div_rn(a32, tl.broadcast_to(scale[:, None], (ROWS, GROUP)))
    return tl.clamp(q, -_MAX, _MAX).to(dtype), scale


@triton.jit
def _block_gemm_kernel(A, A_S, W, W_S, B, OUT, PART, ARRIVED, M, N, K, stride_am, stride_as, stride_wn, stride_ws,
                       stride_om, stride_part, BLOCK_N_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       QUANTIZE_A: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    """OUT[m, n] for a BLOCK_M x BLOCK_N tile: over the K blocks (BLOCK_K = the checkpoint's block_k), the e4m3 tiles'
    product from zero, times A_S[m, block] and W_S[n // BLOCK_N_SCALE, block], added to a float32 sum; plus the bias,
    rounded once. BLOCK_N divides BLOCK_N_SCALE, so a tile's columns share one weight scale per K block.
    QUANTIZE_A: A holds the unquantized activations (A_S unread), each tile's rows quantized per K block as
    `_token_group_quant_kernel` does, bit for bit (one launch instead of two; every column tile's program
    quantizes its rows again, which costs little where the projection streams its weight).
    SPLIT_K > 1 (axis 2): each program sums its share of the K blocks into PART[split, m, n] (float32); the last of a
    tile's splits to arrive (ARRIVED: `split_arrivals`) adds the shares in split order -- the same result whichever
    arrives last -- and writes the tile (attention.py's split merge: stored before the count is raised, read after).
    F32_DOT: the tiles multiplied as float32 (the interpreter; e4m3 products are exact in float32)."""
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    a_rows = A + rows[:, None].to(tl.int64) * stride_am
    w_rows = W + cols[:, None].to(tl.int64) * stride_wn
    w_scales = W_S + (tl.program_id(1) * BLOCK_N // BLOCK_N_SCALE) * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_blocks = tl.cdiv(K, BLOCK_K)
    share = tl.cdiv(k_blocks, SPLIT_K)
    first = tl.program_id(2) * share
    for block in range(first, tl.minimum(first + share, k_blocks)):
        k = block * BLOCK_K + ks
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & (k < K)[None, :], other=0.0)
        if QUANTIZE_A:
            a, a_s = quantize_tile(a, BLOCK_M, BLOCK_K, W.dtype.element_ty)
        else:
            a_s = tl.load(A_S + rows.to(tl.int64) * stride_as + block, mask=row_ok, other=0.0)
        if F32_DOT:
            part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(a, tl.trans(w))
        acc += part * a_s[:, None] * tl.load(w_scales + block)
    tile_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        tile = rows[:, None].to(tl.int64) * N + cols[None, :]  # in PART[split]: [M, N]
        tl.store(PART + tl.program_id(2) * stride_part + tile, acc, mask=tile_mask)
        tl.debug_barrier()
        counter = ARRIVED + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tl.debug_barrier()
            tl.store(counter, 0)  # zero again for the next launch
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in range(SPLIT_K):
                acc += tl.load(PART + split * stride_part + tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty),
                     mask=tile_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty),
                 mask=tile_mask)


@triton.jit
def _block_gemv_kernel(X, W, W_S, B, OUT, N, K, stride_x, stride_wn, stride_ws, stride_o, BLOCK_N_SCALE: tl.constexpr,
                       HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr):
    """OUT[t, n] for one token t (program 0) and BLOCK_N rows (program 1), quantizing the token as it goes: each chunk
    of BLOCK_K columns read as BLOCK_K / GROUP groups, each group quantized as `_token_group_quant_kernel` does, its
    e4m3 values times the group's scale and the weight block's scale multiplied into the rows' e4m3 weights, summed
    in float32 once after the loop; plus the bias, rounded once."""
    wait_for_previous(PDL)
    t, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    G: tl.constexpr = BLOCK_K // GROUP
    ks = tl.arange(0, BLOCK_K)
    w_rows = W + cols[:, None].to(tl.int64) * stride_wn
    w_scales = W_S + (tl.program_id(1) * BLOCK_N // BLOCK_N_SCALE) * stride_ws
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.reshape(tl.load(X + t * stride_x + k0 + ks, mask=k_ok, other=0.0).to(tl.float32), (G, GROUP))
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, amax / _MAX, 1.0)
        q = tl.clamp(x / scale[:, None], -_MAX, _MAX).to(W.dtype.element_ty).to(tl.float32)
        groups = k0 // GROUP + tl.arange(0, G)
        w_scale = tl.load(w_scales + groups, mask=groups * GROUP < K, other=0.0)
        xs = tl.reshape(q * (scale * w_scale)[:, None], (BLOCK_K,))
        w = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * xs[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_o + cols, y.to(OUT.dtype.element_ty), mask=col_ok)


GEMV_MAX_ROWS = 1  # up to this many tokens `fp8_block_linear_triton` may run the GEMV (`uses_gemv`)


def uses_gemv(rows: int, n: int, k: int, device: torch.device) -> bool:
    """Whether a block-FP8 projection of `rows` tokens, n outputs and k inputs runs the GEMV rather than the block
    GEMM: one token, and fewer GEMM column tiles (`block_gemm_config`'s) than SMs (the GEMM then leaves SMs idle;
    with more it streams the weight faster than the GEMV). `benchmarks/fp8_block_linear.py` on the H200 at one token
    (2026-12-05), GEMV against GEMM: q|k|v (N 6144) 12.7 vs 19.8 us, o (4096) 8.9 vs 18.6, down (4096) 21.5 vs
    55.9, gate|up (24576) 51.4 vs 29.9; at 2 tokens the GEMM wins everywhere."""
    if rows > GEMV_MAX_ROWS:
        return False
    return device.type != "cuda" or triton.cdiv(n, block_gemm_config(rows, n, k, device)[1]) < sm_count(
        device.index or 0)


def fp8_block_gemv_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                          block: tuple[int, int] = BLOCK, bias: torch.Tensor | None = None,
                          config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [T, K] (a few tokens; last dim contiguous) @ the block-FP8 weight [N, K].T (+ bias) -> [T, N] in x's dtype
    in one launch, the activations' group quantization inside: `_block_gemv_kernel`, one program per token and
    BLOCK_N rows, each reading its rows' weights once per token. config (BLOCK_N, BLOCK_K, num_warps): default the
    dense GEMV's rule for e4m3 rows (linear.py's `gemv_config`), BLOCK_K at least one group."""
    block_n, block_k = block
    t, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    bn, bk, warps = config or gemv_config(n, k, False, False, weight.element_size())
    bk = max(bk, block_k)
    if block_n % bn or bk % block_k:
        raise ValueError(f"fp8_block_gemv_triton: BLOCK_N {bn} must divide the scale block's {block_n} rows and "
                         f"BLOCK_K {bk} be a multiple of its {block_k} columns")
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t:
        use_pdl = pdl(x)
        _block_gemv_kernel[(t, triton.cdiv(n, bn))](
            x, weight, weight_scale_inv, bias if bias is not None else weight_scale_inv, out, n, k, x.stride(0),
            weight.stride(0), weight_scale_inv.stride(0), out.stride(0), BLOCK_N_SCALE=block_n,
            HAS_BIAS=bias is not None, GROUP=block_k, BLOCK_N=bn, BLOCK_K=bk, PDL=use_pdl, num_warps=warps,
            launch_pdl=use_pdl)
    return out


GEMM_CONFIG_DIR = Path(__file__).resolve().parent.parent / "gemm_configs"
UNTUNED_GEMM = (64, 128, 4)


def block_gemm_stem(n: int, k: int, route: bool = False) -> str:
    """The shape's part of a tuned file's name: N=..,K=..,dtype=float8_e4m3fn,block=128x128 (vLLM's scheme, ours
    for the dtype and block); route: the crossover file (`uses_scaled_mm`), `,route=scaled_mm` added."""
    return f"N={n},K={k},dtype=float8_e4m3fn,block=128x128{',route=scaled_mm' if route else ''}"


def block_gemm_config_path(n: int, k: int, gpu: str, folder: Path | None = None, route: bool = False) -> Path:
    """The file of the block GEMM's configurations (route: its crossover against _scaled_mm) for an N x K projection
    on GPU `gpu` (its CUDA name) in `folder` (default the shipped GEMM_CONFIG_DIR; `tsdev tune` writes the user's
    own under `cache_dir()/tuned/gemm_configs`)."""
    return (folder or GEMM_CONFIG_DIR) / tuned_file_name(block_gemm_stem(n, k, route), gpu)


def block_gemm_config(rows: int, n: int, k: int, device: torch.device | str) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, num_warps[, shares of K]) for `rows` tokens of an n x k block-FP8 projection: on CUDA the
    entry of the nearest token bucket in the tuned table (`_gemm_table`), if there is one; else UNTUNED_GEMM
    (64, 128, 4) at every M -- the fastest of `benchmarks/fp8_block_linear.py`'s six at Qwen3-8B's four projections
    for M 1 to 256 on the H200 (2026-12-05: at M 16, 20.5 against 32.5 us for (16, 64, 4) on q|k|v), within 2 % of
    the best, (128, 128, 8), at M 2048."""
    gpu = device_name(device)
    table = _gemm_table(n, k, gpu) if gpu else None
    return tuple(nearest(table, rows)) if table else UNTUNED_GEMM


@functools.lru_cache
def _gemm_table(n: int, k: int, gpu: str) -> dict | None:
    """The tuned table for this shape and GPU (`find_tuned`'s order: the user's, the shipped file, the sibling
    GPU's), looked up once per process (a step's eager projections ask per call); one line says which serves."""
    stem = block_gemm_stem(n, k)
    if found := find_tuned("gemm_configs", stem, gpu, GEMM_CONFIG_DIR):
        tuned_log.info("block-FP8 GEMM %s on the %s: tuned configs from %s (%s)", stem, gpu, found.path, found.source)
        return found.table
    tuned_log.warning("no tuned block-FP8 GEMM configs %s for the %s: using %s at every M (slower). Write them on "
                      "this GPU with: tsdev tune --gemm %d,%d", stem, gpu, UNTUNED_GEMM, n, k)
    return None


MAX_SPLIT_K, MIN_SPLIT_BLOCKS = 8, 4  # at most 8 shares of K, each of at least 4 blocks (512 columns)


def block_gemm_split(tiles: int, k_blocks: int, sms: int) -> int:
    """Shares of K for a block GEMM of `tiles` output tiles over `k_blocks` K blocks on `sms` SMs: as many as keep
    every tile's programs within one wave (tiles x split <= sms), at most MAX_SPLIT_K, each share at least
    MIN_SPLIT_BLOCKS blocks; 1 (no split) once the tiles alone fill the GPU. A skinny M's projection has few tiles
    (Qwen3-8B's o and down at M <= 64: 32 of 64 x 128 on 132 SMs), and each tile's program streams its weight
    columns alone: at M 1, 18.6 / 55.9 us for o / down against _scaled_mm's 12.9 / 37.5 (docs/benchmarks.md). Not
    measured split yet (`benchmarks/fp8_block_linear.py --configs 64,128,4,4`)."""
    split = min(MAX_SPLIT_K, sms // max(tiles, 1), k_blocks // MIN_SPLIT_BLOCKS)
    return max(1, split)


def fp8_block_gemm_triton(xq: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor,
                          weight_scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                          bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                          config: tuple[int, ...] | None = None) -> torch.Tensor:
    """xq [T, K] e4m3 with its group scales [T, ceil(K / block_k)] (`quantize_fp8_token_groups`) @ the block-FP8
    weight [N, K].T (+ bias) -> [T, N] in out_dtype: `_block_gemm_kernel`, config (BLOCK_M, BLOCK_N, num_warps) and
    optionally the shares of K (default `block_gemm_split` on CUDA, 1 elsewhere). x_scale None: xq holds the
    unquantized activations (last dim contiguous), quantized inside the kernel with the same arithmetic."""
    block_n, block_k = block
    t, n, k = xq.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty(t, n, dtype=out_dtype, device=xq.device)
    bm, bn, warps, *split = config or block_gemm_config(t, n, k, xq.device)
    bn = min(bn, block_n)
    grid = (triton.cdiv(t, bm), triton.cdiv(n, bn))
    k_blocks = triton.cdiv(k, block_k)
    split_k = split[0] if split else (block_gemm_split(grid[0] * grid[1], k_blocks, sm_count(xq.device.index or 0))
                                      if xq.is_cuda else 1)
    split_k = max(1, min(split_k, k_blocks))
    if t:
        use_pdl = pdl(xq)
        part = torch.empty((split_k, t, n) if split_k > 1 else (1,), dtype=torch.float32, device=xq.device)
        arrived = split_arrivals(xq.device, grid[0] * grid[1]) if split_k > 1 else part
        quantize = x_scale is None
        scales = weight_scale_inv if quantize else x_scale  # not read when quantizing
        _block_gemm_kernel[(*grid, split_k)](
            xq, scales, weight, weight_scale_inv, bias if bias is not None else scales, out, part, arrived, t, n, k,
            xq.stride(0), scales.stride(0), weight.stride(0), weight_scale_inv.stride(0), out.stride(0), t * n,
            BLOCK_N_SCALE=block_n, HAS_BIAS=bias is not None, QUANTIZE_A=quantize, F32_DOT=not xq.is_cuda,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, SPLIT_K=split_k, PDL=use_pdl, num_warps=warps,
            launch_pdl=use_pdl)
    return out


def fp8_block_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                            block: tuple[int, int] = BLOCK, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_block_linear_ref`'s arithmetic: the GEMV (one launch) where `uses_gemv`; else the block GEMM quantizing its
    activation tiles itself (one launch) where `quantizes_inside`, or after the token-group quantization (two)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if uses_gemv(rows.shape[0], *weight.shape, x.device):
        out = fp8_block_gemv_triton(rows, weight, weight_scale_inv, block, bias)
    elif quantizes_inside(rows.shape[0], *weight.shape, x.device):
        out = fp8_block_gemm_triton(rows, None, weight, weight_scale_inv, block, bias, x.dtype)
    else:
        xq, x_scale = quantize_fp8_token_groups_triton(rows, block[1])
        out = fp8_block_gemm_triton(xq, x_scale, weight, weight_scale_inv, block, bias, x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


# --- cuBLAS where it wins ------------------------------------------------------------------------
# torch._scaled_mm takes DeepSeek-style block scales on sm_90 with CUDA >= 12.9 (cuBLASLt): activations 1 x 128 per
# token group, weights 128 x 128. On the H100 at 96b8aee it took 20-22 us for Qwen3-8B's q|k|v at M 1-256 and 87 at
# 2048, where the Triton projection took 21 / 59 / 30 / 40 / 220 at M 1 / 16 / 64 / 256 / 2048 (untuned), 175 us for
# down at 2048 against 500 (issue 65; docs/benchmarks.md). The op routes each M to the faster side by the crossover
# `tsdev tune` measures; the Triton kernel stays the one a user edits and reloads. The crossover `tsdev tune` measured
# on an H100 on 2026-12-07 at Qwen3-8B's four projections (gemm_configs/*route=scaled_mm*): Triton faster up to 64
# tokens even untuned (qkv 15.8 us against 19 at 64), _scaled_mm at 256 for three of four untuned (gate_up 84 / 64,
# down 83 / 71, qkv 30 / 29, o 25 / 28) and for all from 1024 (down 249 / 202 at 1024, 991 / 797 at 4096).

SCALED_MM_MIN_ROWS = 256  # without a measured crossover: _scaled_mm from this many tokens (the H100 figures above)


def fp8_block_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                        weight_scale_inv: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`fp8_block_gemm_ref`'s product through torch._scaled_mm (cuBLASLt's block-scaled FP8 GEMM), rounded to
    out_dtype: xq [T, K] e4m3 with its group scales [T, K / 128], weight [N, K] e4m3 with weight_scale_inv
    [N / 128, K / 128] (N and K multiples of 128). cuBLASLt reads the activations' scales outer-dim-major (stride
    (1, M)), M a multiple of 4 (16-byte rows of scales): the rows are padded with zeros (scale 1) and cut off after."""
    t, k = xq.shape
    rows = t + -t % 4
    a = xq if rows == t else torch.zeros(rows, k, dtype=xq.dtype, device=xq.device)
    scale_a = torch.ones(x_scale.shape[1], rows, dtype=torch.float32, device=xq.device).t()  # [rows, K/128], (1, M)
    if rows != t:
        a[:t].copy_(xq)
    scale_a[:t].copy_(x_scale)
    out = torch._scaled_mm(a, weight.t(), scale_a=scale_a, scale_b=weight_scale_inv.contiguous().t(),
                           out_dtype=out_dtype)
    return out[:t]


@functools.lru_cache
def _probe_scaled_mm(index: int) -> bool:
    """Whether this torch and GPU run `fp8_block_scaled_mm` (one tiny call); said once when not."""
    device = torch.device("cuda", index)
    try:
        xq, x_scale = quantize_fp8_token_groups(torch.ones(4, 128, device=device))
        w, w_scale = quantize_fp8_blocks(torch.ones(128, 128, device=device))
        ok = fp8_block_scaled_mm(xq, x_scale, w, w_scale).float().sum().item() == 4 * 128 * 128
        why = "" if ok else "a wrong product"
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if why:
        tuned_log.warning("block-FP8 projections: the Triton kernel at every M -- torch %s on the %s has no "
                          "block-scaled _scaled_mm (%s; it needs sm_90 and CUDA >= 12.9)", torch.__version__,
                          torch.cuda.get_device_name(index), why)
    return not why


def scaled_mm_available(device: torch.device) -> bool:
    """Whether block-FP8 projections on `device` may go to torch._scaled_mm: probed once per GPU, eagerly (never
    inside a capture: until a probe has run, captures take the Triton kernel)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing() and _probe_scaled_mm.cache_info().currsize == 0:
        return False
    return _probe_scaled_mm(index)


@functools.lru_cache
def _route_table(n: int, k: int, gpu: str) -> dict | None:
    """{M: {"triton_us": .., "scaled_mm_us": ..}} that `tsdev tune` measured for this shape on this GPU (or its
    sibling), looked up once per process."""
    found = find_tuned("gemm_configs", block_gemm_stem(n, k, route=True), gpu, GEMM_CONFIG_DIR)
    if found:
        tuned_log.info("block-FP8 projection %d x %d on the %s: Triton / _scaled_mm crossover from %s (%s)", n, k, gpu,
                       found.path, found.source)
    return found.table if found else None


def quantizes_inside(rows: int, n: int, k: int, device: torch.device) -> bool:
    """Whether the Triton projection of `rows` tokens (n x k) runs the block GEMM that quantizes its own activation
    tiles rather than a quantization launch before it: where `tsdev tune`'s crossover file measured it faster
    (`inside_us` against `triton_us`, the two launches' time) at the nearest bucket; without that measurement the two
    launches, the path measured before. Every column tile's program quantizes its rows again: one launch fewer,
    more arithmetic."""
    table = _route_table(n, k, device_name(device)) if device.type == "cuda" else None
    entry = nearest(table, rows) if table else None
    return entry is not None and entry.get("inside_us", float("inf")) < entry["triton_us"]


def uses_scaled_mm(rows: int, n: int, k: int, device: torch.device) -> bool:
    """Whether a block-FP8 projection of `rows` tokens (n x k, no bias) runs `fp8_block_scaled_mm` rather than the
    Triton kernel: where _scaled_mm is available (`scaled_mm_available`) and n and k are whole blocks, by
    TSDEV_KERNELS (cublas:fp8 always, triton:fp8 never), else by the measured crossover's nearest bucket, else from
    SCALED_MM_MIN_ROWS tokens."""
    forced = routed("fp8")
    if forced == "triton" or n % BLOCK[0] or k % BLOCK[1] or not scaled_mm_available(device):
        return False
    if forced == "cublas":
        return True
    table = _route_table(n, k, device_name(device))
    if table:
        entry = nearest(table, rows)
        return entry.get("scaled_mm_us", float("inf")) < min(entry["triton_us"], entry.get("inside_us", float("inf")))
    return rows >= SCALED_MM_MIN_ROWS


def fp8_block_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """A block-FP8 projection (no bias) through cuBLAS: the Triton token-group quantization, then
    `fp8_block_scaled_mm`."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_fp8_token_groups_triton(rows if rows.stride(-1) == 1 else rows.contiguous())
    return fp8_block_scaled_mm(xq, x_scale, weight, weight_scale_inv, x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block: tuple[int, int] = BLOCK, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A block-FP8 projection: on CUDA `fp8_block_linear_triton`, or `fp8_block_linear_scaled_mm` at the M where
    `uses_scaled_mm` says cuBLAS is faster; `fp8_block_linear_ref` elsewhere."""
    if use_triton(x, "fp8"):
        rows = x.numel() // x.shape[-1]
        if bias is None and block == BLOCK and rows and uses_scaled_mm(rows, *weight.shape, x.device):
            return fp8_block_linear_scaled_mm(x, weight, weight_scale_inv)
        return fp8_block_linear_triton(x, weight, weight_scale_inv, block, bias)
    return fp8_block_linear_ref(x, weight, weight_scale_inv, block, bias)


# ---------------------------------------------------------------------------------------------------
# Checks on reload (kernels/tsdev_kernels/checks.py), where a block-FP8 checkpoint is served: the quantization of the
# activations, and the projection (the GEMV at one token, quantization + block GEMM past it) at the served widths.

BLOCK_TOLERANCE = {
    torch.bfloat16: Tolerance(1e-2, 1.6e-2, "bf16 output rounded once from float32 block sums in another order than "
                              "the reference's (on Hopper each block's FP8 wgmma sum in reduced precision)"),
    torch.float16: Tolerance(2e-3, 2e-3, "fp16 output, as bf16 with 3 more mantissa bits"),
    torch.float32: Tolerance(1e-3, 1e-3, "float32 output of the block sums, each block's FP8 wgmma sum in reduced "
                             "precision"),
}
BIT_FOR_BIT = Tolerance(0.0, 0.0, "the reference's float32 arithmetic and its one cast to e4m3: bit for bit")


def _check_activations(tokens: int, k: int, dtype, device: str, generator: torch.Generator) -> torch.Tensor:
    """Fresh random activations [tokens, k]. Off CUDA (Triton's interpreter) values e4m3 holds exactly once divided
    by their group's scale -- each group's largest 448 times a power of two -- since the interpreter's cast rounds
    others a binade down where a GPU and torch do not."""
    x = torch.randn(tokens, k, generator=generator, device=device) * 4
    if device.startswith("cuda"):
        return x.to(dtype)
    grid = quantize_fp8_token_groups(x)[0].float()
    grid[:, ::BLOCK[1]] = 448.0
    powers = torch.randint(-8, -4, (tokens, 1), generator=generator, device=device)
    return (grid * 2.0 ** powers).to(dtype)


def _groups_inputs(shape, dtype, device, generator):
    return (_check_activations(*shape, dtype, device, generator),)


def _linear_inputs(shape, dtype, device, generator):
    rows, k, n = shape
    weight, scale_inv = quantize_fp8_blocks(_matrix(n, k, torch.float32, device, generator))
    return _check_activations(rows, k, dtype, device, generator), weight, scale_inv


def _groups_cost(x):
    """x read; its e4m3 values (a byte each) and a float32 scale per 128-column group written."""
    return nbytes(x) + x.numel() + x.numel() // BLOCK[1] * 4, 0


def _as_floats(quantized: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return quantized[0].float(), quantized[1]


CHECKS = [
    KernelCheck(op="fp8_token_groups", kernels=("_token_group_quant_kernel",),
                shapes=lambda s: [(t, s.hidden) for t in s.tokens] if s.fp8_blocks else [],
                inputs=_groups_inputs, kernel=lambda x: _as_floats(quantize_fp8_token_groups_triton(x)),
                reference=lambda x: _as_floats(quantize_fp8_token_groups(x)),
                tolerance=dict.fromkeys((torch.bfloat16, torch.float16, torch.float32), BIT_FOR_BIT),
                cost=_groups_cost),
    KernelCheck(op="fp8_block_linear", kernels=("_token_group_quant_kernel", "_block_gemm_kernel",
                                                "_block_gemv_kernel"),
                shapes=lambda s: [(t, s.intermediate, s.hidden) for t in s.tokens] if s.fp8_blocks else [],
                inputs=_linear_inputs, kernel=fp8_block_linear_triton, reference=fp8_block_linear_ref,
                tolerance=BLOCK_TOLERANCE, cost=matmul_cost, tensor_cores="fp8"),  # e4m3 x e4m3 products
]
