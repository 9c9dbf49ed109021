"""Sampling's hot path: greedy, temperature, top-k, top-p for a batch of rows, without a host sync.

Semantics are the runtime sampler's: a row with temperature 0 takes argmax(logits); any other row
divides its logits by the temperature, keeps its top-k (0 = all) and then its top-p nucleus (1 = all;
the best token always stays), and draws with the exponential race argmax(probs / E), E ~ Exp(1).

The noise is generator-free: E at (row, column) is a hash of the row's 64-bit seed and the column
(`exponential_noise`). So a row's draw depends only on its logits and its seed, never on the rest of
the batch; the seeds live in a tensor a CUDA graph can read; and the top-k path draws noise only for
its candidates. Callers derive a fresh seed per row per step (e.g. from the request's seed and the
number of tokens it has generated).

CUDA paths, picked by the host-side promise `max_top_k` (the caller knows every row's parameters):
* max_top_k == 0 (no row filters): one Triton pass over the vocabulary computes
  argmax(logits / T - log E) (the race in log space; T == 0 rows use the logits), split across
  programs per row and merged by a torch argmax over the few per-program winners.
* max_top_k == K > 0 (every sampled row has 1 <= top_k <= K): torch.topk(K) candidates (in two
  stages for a handful of rows, so that one row spreads over many thread blocks), then one
  Triton program per row does top-k, top-p (a cumsum over K) and the race on those K only, drawing
  noise for the candidates' columns. No full-vocabulary sort.
* None: anything goes: the reference's full sort for the filters, then the Triton race.
"""

import torch
import triton
import triton.language as tl

from tsdev_kernels.checks import KernelCheck, Tolerance, nbytes
from tsdev_kernels.ops import sm_count, use_triton

_M1, _M2 = 0x21F0AAAD, 0xD35A2D97  # "lowbias32"-style 32-bit integer hash (C. Wellons' hash-prospector)
_SEED_SALT = 0x9E3779B9


# ---------------------------------------------------------------------------------------------------
# Counter-based noise: the same bits in torch (reference, CPU) and in the Triton kernel


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without overflowing int64."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 15)


def exponential_noise(seeds: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [S, N] float32 for rows with seeds [S] (int64) at columns cols ([N] or [S, N], int64).

    Column j of a row gets the same value whichever columns are asked for, which is what lets the
    top-k path draw noise for its candidates only. Uniforms have 23 bits, strictly inside (0, 1).
    """
    seeds = seeds.to(torch.int64)
    key = _mix32((seeds & 0xFFFFFFFF) ^ _mix32(((seeds >> 32) & 0xFFFFFFFF) ^ _SEED_SALT))
    cols = cols.to(torch.int64)
    return _exp1_from_hash(_mix32(_mix32(cols) ^ key.unsqueeze(1)))


def _exp1_from_hash(h: torch.Tensor) -> torch.Tensor:
    # 23 bits, so that u < 1 holds in float32 (with 24, (2**24 - 0.5) / 2**24 rounds to 1.0, E to 0, and
    # that token would win the race whatever its probability)
    u = ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)
    return -torch.log(u)


@triton.jit
def _mix32_tl(x):
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0xD35A2D97
    return x ^ (x >> 15)


# ---------------------------------------------------------------------------------------------------
# References


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf (the best token stays).

    The runtime sampler's filter, except that a row with top_p >= 1 drops nothing (the sampler could drop
    tail tokens whose mass-before rounds to 1.0).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    k = torch.where(top_ks > 0, top_ks, logits.shape[-1]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_ps.unsqueeze(1)) & (top_ps.unsqueeze(1) < 1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample_ref(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """The runtime sampler on tensors, with the Exp(1) noise [S, V] given. Returns token ids [S] int64."""
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
    probs = apply_top_k_top_p(scaled, top_ks, top_ps).softmax(dim=-1)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, greedy)


# ---------------------------------------------------------------------------------------------------
# Triton: the race over the full vocabulary, each row split across programs


@triton.jit(do_not_specialize=["num_splits"])  # one binary whatever the rows (33 rows make 16 splits: no second one)
def _race_kernel(
    LOGITS, TEMPS, SEEDS, BEST_VAL, BEST_IDX, V, stride_l, num_splits,
    SALT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(TEMPS + row).to(tl.float32)
    seed = tl.load(SEEDS + row).to(tl.int64)
    # the row's key, as in exponential_noise
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32_tl(lo ^ _mix32_tl(hi ^ SALT))
    inv_temp = 1.0 / tl.maximum(temp, 1e-5)

    chunk = tl.cdiv(tl.cdiv(V, num_splits), BLOCK) * BLOCK
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(split * chunk, tl.minimum(split * chunk + chunk, V), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        logit = tl.load(LOGITS + row.to(tl.int64) * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
        h = _mix32_tl(_mix32_tl(cols.to(tl.uint32)) ^ key)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as _exp1_from_hash
        # argmax(probs / E) == argmax(logit / T - log E): no softmax needed
        score = tl.where(temp > 0, logit * inv_temp - tl.log(-tl.log(u)), logit)
        better = score > best_val  # strict: the earliest column wins a tie, as torch.argmax
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, V), axis=0)
    tl.store(BEST_VAL + row * num_splits + split, top)
    tl.store(BEST_IDX + row * num_splits + split, idx)


def race_triton(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                num_splits: int | None = None, block: int | None = None) -> torch.Tensor:
    """argmax per row of logits / T - log E(seed, column) (T > 0) or of the logits (T == 0): [S] int64."""
    S, V = logits.shape
    block = block or (2048 if logits.is_cuda else 128)
    if num_splits is None:
        sms = sm_count(logits.device.index or 0) if logits.is_cuda else 2
        num_splits = max(1, min(triton.cdiv(V, 4 * block), triton.cdiv(4 * sms, max(S, 1))))
    best_val = torch.empty(S, num_splits, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(S, num_splits, dtype=torch.int32, device=logits.device)
    if S:
        _race_kernel[(S, num_splits)](
            logits, temperatures, seeds, best_val, best_idx, V, logits.stride(0), num_splits,
            SALT=_SEED_SALT, BLOCK=block, num_warps=8 if block >= 2048 else 4,
        )
    if num_splits == 1:
        return best_idx[:, 0].long()
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True)).squeeze(1).long()


# ---------------------------------------------------------------------------------------------------
# Triton: top-k / top-p / the race on torch.topk's candidates, one program per row


@triton.jit(do_not_specialize=["K", "stride_v", "stride_c"])  # one binary per BLOCK_K, whatever the top_k
def _candidates_kernel(
    VALUES, COLS, TEMPS, TOP_KS, TOP_PS, SEEDS, OUT, K, stride_v, stride_c,
    SALT: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    r = tl.arange(0, BLOCK_K)
    temp = tl.load(TEMPS + row).to(tl.float32)
    top_k = tl.load(TOP_KS + row).to(tl.int32)
    top_p = tl.load(TOP_PS + row).to(tl.float32)
    seed = tl.load(SEEDS + row).to(tl.int64)
    values = tl.load(VALUES + row * stride_v + r, mask=r < K, other=float("-inf")).to(tl.float32)
    cols = tl.load(COLS + row * stride_c + r, mask=r < K, other=0).to(tl.int32)
    # greedy: the best logit, the lowest column among ties (torch.argmax's choice)
    greedy = tl.min(tl.where((values == tl.max(values, axis=0)) & (r < K), cols, 2147483647), axis=0)
    # top-k, then the top-p nucleus over the renormalised survivors (candidates come sorted, best first)
    k = tl.where(top_k > 0, tl.minimum(top_k, K), K)
    scaled = tl.where(r < k, values / tl.maximum(temp, 1e-5), float("-inf"))
    probs = tl.exp(scaled - tl.max(scaled, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    mass_before = tl.cumsum(probs, axis=0) - probs
    p_limit = tl.where(top_p < 1, top_p, float("inf"))  # top_p >= 1 drops nothing
    keep = (r < k) & ((mass_before < p_limit) | (r == 0))
    # the race, in log space, with the same noise exponential_noise gives these columns
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32_tl(lo ^ _mix32_tl(hi ^ SALT))
    h = _mix32_tl(_mix32_tl(cols.to(tl.uint32)) ^ key)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as _exp1_from_hash
    score = tl.where(keep, scaled - tl.log(-tl.log(u)), float("-inf"))
    best = tl.min(tl.where(score == tl.max(score, axis=0), r, BLOCK_K), axis=0)
    sampled = tl.sum(tl.where(r == best, cols, 0), axis=0)
    tl.store(OUT + row, tl.where(temp > 0, sampled, greedy).to(tl.int64))


# Two-stage top-k pays only when a few rows leave the GPU idle. H200, V=151936, k=20 (us, top-k path in a
# graph): S=1 plain 64 / 64 chunks 47; S=16 plain 82 / 64 chunks 100; S=64 154 / 238; S=256 585 / 781.
TOPK_CHUNKS, TOPK_CHUNKS_MAX_ROWS = 64, 4


def _topk(logits: torch.Tensor, k: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(k) over the vocabulary, sorted, in two stages: the best k of each of `chunks` column
    ranges, then the best k of those. A plain topk gives each row one thread block, which leaves the
    GPU idle at small batch; this spreads a row over `chunks` blocks."""
    S, V = logits.shape
    width = V // chunks
    if chunks <= 1 or width < k:
        return logits.topk(k, dim=-1)
    values, cols = logits[:, : chunks * width].unflatten(1, (chunks, width)).topk(k, dim=-1, sorted=False)
    cols = (cols + torch.arange(0, chunks * width, width, device=logits.device).unsqueeze(1)).flatten(1)
    values = values.flatten(1)
    if chunks * width < V:  # the last V % chunks columns are candidates as they are
        values = torch.cat([values, logits[:, chunks * width :]], dim=1)
        cols = torch.cat([cols, torch.arange(chunks * width, V, device=logits.device).expand(S, -1)], dim=1)
    values, best = values.topk(k, dim=-1)
    return values, cols.gather(1, best)


def candidate_block(k: int) -> int:
    """The candidate kernel's BLOCK_K for k candidates: one compiled binary per value."""
    return max(16, triton.next_power_of_2(k))


def candidate_blocks(max_top_k: int) -> list[int]:
    """Every BLOCK_K that a top_k in 1..max_top_k uses (the warm-up compiles them all)."""
    return [2**i for i in range(4, candidate_block(max_top_k).bit_length())]


def sample_top_k_triton(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                        seeds: torch.Tensor, max_top_k: int, topk_chunks: int | None = None) -> torch.Tensor:
    """Rows whose top_k is in 1..max_top_k (greedy rows: anything): the filters and the race on the
    max_top_k best candidates only, which hold every token such a row can draw."""
    S, V = logits.shape
    k = min(max_top_k, V)
    if topk_chunks is None:
        topk_chunks = TOPK_CHUNKS if S <= TOPK_CHUNKS_MAX_ROWS else 1
    values, cols = _topk(logits, k, topk_chunks)  # sorted, best first
    out = torch.empty(S, dtype=torch.int64, device=logits.device)
    if S:
        _candidates_kernel[(S,)](
            values, cols, temperatures, top_ks, top_ps, seeds, out, k, values.stride(0), cols.stride(0),
            SALT=_SEED_SALT, BLOCK_K=candidate_block(k), num_warps=4 if k <= 1024 else 8,
        )
    return out


# ---------------------------------------------------------------------------------------------------
# Public op


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
    *,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Token ids [S] int64 for logits [S, V] float32 (rows may be strided; the vocab dim contiguous).

    temperatures [S] float32 (0 = greedy), top_ks [S] int (0 = off), top_ps [S] float32 (1 = off),
    seeds [S] int64: the row's noise for this step (see `exponential_noise`); same seed, same logits,
    same token, whatever the batch. All on the logits' device; nothing is read back to the host, so
    the call can sit inside a CUDA graph (the seeds in a static buffer, refreshed each step).

    max_top_k is a host-side promise about the sampled (temperature > 0) rows that picks the CUDA path:
    0 = no row filters (every top_k == 0 and top_p >= 1): one pass; K > 0 = every sampled row has
    1 <= top_k <= K: topk(K) candidates; None (default) = no promise: a full sort, the slowest path.
    A wrong promise gives wrong draws, not an error. On CPU the reference runs (promise ignored).
    """
    if not use_triton(logits, "sampling"):
        cols = torch.arange(logits.shape[1], device=logits.device)
        return sample_ref(logits, temperatures, top_ks, top_ps, exponential_noise(seeds, cols))
    if max_top_k == 0:
        return race_triton(logits, temperatures, seeds)
    if max_top_k is not None:
        return sample_top_k_triton(logits, temperatures, top_ks, top_ps, seeds, max_top_k)
    scaled = apply_top_k_top_p(logits / temperatures.clamp(min=1e-5).unsqueeze(1), top_ks, top_ps)
    sampled = race_triton(scaled, torch.ones_like(temperatures), seeds)
    return torch.where(temperatures > 0, sampled, logits.argmax(dim=-1))


# ---------------------------------------------------------------------------------------------------
# Penalties and logit_bias: what a request's own tokens and its bias do to its row before the draw (vLLM's
# semantics). Each request that uses them holds a slot of per-request tables: `counts` [slots, V] int32 (the
# times each token was generated, with PROMPT_BIT set for the tokens of its prompt), `params` [slots, 3]
# float32 (presence, frequency, repetition) and its bias entries `bias_ids` / `bias_values` [slots, B] with
# `bias_count` [slots] int32. A step passes one slot per row (-1: the row is left alone).

PROMPT_BIT = 1 << 30
BIAS_BLOCK = 512  # the bias kernel's lanes: at least sequence.MAX_LOGIT_BIAS entries


def apply_penalties_ref(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, params: torch.Tensor,
                        bias_ids: torch.Tensor, bias_values: torch.Tensor, bias_count: torch.Tensor) -> None:
    """In place, for each row r with slot s = slots[r] >= 0: logits[r, bias_ids[s, :n]] += bias_values[s, :n]
    (n = bias_count[s]); then a token seen in the prompt or the output has its logit divided by the repetition
    penalty when positive, multiplied when not; then every logit drops by frequency x its output count and by
    presence once it was generated. Float32, in that order (vLLM's: the bias is a logits processor, before the
    penalties)."""
    rows = (slots >= 0).nonzero().squeeze(1)
    if not rows.numel():
        return
    slot = slots[rows]
    x = logits[rows]
    lanes = torch.arange(bias_ids.shape[1], device=logits.device)
    entries = lanes < bias_count[slot].unsqueeze(1)
    x.scatter_add_(1, bias_ids[slot].long(), torch.where(entries, bias_values[slot], 0.0))
    history = counts[slot]
    generated = (history & (PROMPT_BIT - 1)).float()
    presence, frequency, repetition = params[slot].unbind(1)
    rep = repetition.unsqueeze(1)
    x = torch.where(history != 0, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency.unsqueeze(1) * generated - presence.unsqueeze(1) * (generated > 0).float()
    logits[rows] = x


@triton.jit
def _bias_kernel(LOGITS, SLOTS, BIAS_IDS, BIAS_VALUES, BIAS_COUNT, stride_l, stride_b, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(SLOTS + row)
    if slot >= 0:
        lanes = tl.arange(0, BLOCK)
        mask = lanes < tl.load(BIAS_COUNT + slot)
        ids = tl.load(BIAS_IDS + slot.to(tl.int64) * stride_b + lanes, mask=mask, other=0)
        values = tl.load(BIAS_VALUES + slot.to(tl.int64) * stride_b + lanes, mask=mask, other=0.0)
        where = LOGITS + row.to(tl.int64) * stride_l + ids
        tl.store(where, tl.load(where, mask=mask, other=0.0) + values, mask=mask)  # a request's ids are distinct


@triton.jit(do_not_specialize=["V", "stride_l", "stride_c"])
def _penalties_kernel(LOGITS, SLOTS, COUNTS, PARAMS, V, stride_l, stride_c,
                      PROMPT_BIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(SLOTS + row)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        history = tl.load(COUNTS + slot.to(tl.int64) * stride_c + cols, mask=mask, other=0)
        generated = (history & (PROMPT_BIT - 1)).to(tl.float32)
        x = tl.load(LOGITS + row.to(tl.int64) * stride_l + cols, mask=mask, other=0.0)
        presence, frequency, rep = (tl.load(PARAMS + slot * 3), tl.load(PARAMS + slot * 3 + 1),
                                    tl.load(PARAMS + slot * 3 + 2))
        x = tl.where(history != 0, tl.where(x > 0, x / rep, x * rep), x)
        x = x - frequency * generated - presence * (generated > 0).to(tl.float32)
        tl.store(LOGITS + row.to(tl.int64) * stride_l + cols, x, mask=mask)


def apply_penalties_triton(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, params: torch.Tensor,
                           bias_ids: torch.Tensor, bias_values: torch.Tensor, bias_count: torch.Tensor,
                           block: int | None = None) -> None:
    S, V = logits.shape
    block = block or (4096 if logits.is_cuda else 128)
    if S:
        _bias_kernel[(S,)](logits, slots, bias_ids, bias_values, bias_count, logits.stride(0), bias_ids.stride(0),
                           BLOCK=BIAS_BLOCK)
        _penalties_kernel[(S, triton.cdiv(V, block))](
            logits, slots, counts, params, V, logits.stride(0), counts.stride(0),
            PROMPT_BIT=PROMPT_BIT, BLOCK=block, num_warps=8 if block >= 4096 else 4,
        )


def apply_penalties(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, params: torch.Tensor,
                    bias_ids: torch.Tensor, bias_values: torch.Tensor, bias_count: torch.Tensor) -> None:
    """logit_bias and the penalties on logits [S, V] float32 in place (the vocab dim contiguous), for the rows
    whose slot (slots [S] int64) is >= 0, from the slot tables described above. Two launches whatever the rows:
    a row without a slot costs programs that return."""
    if use_triton(logits, "sampling"):
        apply_penalties_triton(logits, slots, counts, params, bias_ids, bias_values, bias_count)
    else:
        apply_penalties_ref(logits, slots, counts, params, bias_ids, bias_values, bias_count)


@triton.jit
def _count_kernel(COUNTS, SLOTS, TOKENS, stride_c):
    row = tl.program_id(0)
    slot = tl.load(SLOTS + row)
    if slot >= 0:
        tl.atomic_add(COUNTS + slot.to(tl.int64) * stride_c + tl.load(TOKENS + row), 1)


def count_tokens(counts: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """counts[slots[r], tokens[r]] += 1 for every row with a slot (the drawn tokens join their histories)."""
    if use_triton(counts, "sampling"):
        if slots.numel():
            _count_kernel[(slots.numel(),)](counts, slots, tokens, counts.stride(0))
        return
    rows = slots >= 0
    counts.index_put_((slots[rows], tokens[rows]), torch.ones_like(tokens[rows], dtype=counts.dtype), accumulate=True)


# ---------------------------------------------------------------------------------------------------
# Logprobs: a token's log-probability and the top-N under the raw distribution (log-softmax of the logits)


def token_logprobs_ref(logits: torch.Tensor, tokens: torch.Tensor, top_n: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lse = logits.logsumexp(dim=-1, keepdim=True)
    chosen = (logits.gather(1, tokens.unsqueeze(1)) - lse).squeeze(1)
    values, ids = logits.topk(top_n, dim=-1)
    return chosen, values - lse, ids


@triton.jit(do_not_specialize=["V", "stride_l", "top_n"])
def _logprobs_kernel(LOGITS, MAXES, SUMS, TOP_VALUES, TOP_IDS, V, stride_l, top_n, BLOCK: tl.constexpr):
    """One (row, chunk): the chunk's max and sum of exp(x - max), and its top_n values and columns, best first
    (ties: the lowest column, as torch.topk's order is not promised; the merge below picks among candidates)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    chunks = tl.num_programs(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(LOGITS + row.to(tl.int64) * stride_l + cols, mask=cols < V, other=float("-inf"))
    top = tl.max(x, axis=0)
    out = row * chunks + chunk
    tl.store(MAXES + out, top)
    tl.store(SUMS + out, tl.sum(tl.exp(x - top), axis=0))
    for i in range(top_n):
        best = tl.max(x, axis=0)
        col = tl.min(tl.where(x == best, cols, 2147483647), axis=0)
        tl.store(TOP_VALUES + out * top_n + i, best)
        tl.store(TOP_IDS + out * top_n + i, col)
        x = tl.where(cols == col, float("-inf"), x)


def token_logprobs_triton(logits: torch.Tensor, tokens: torch.Tensor, top_n: int, block: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    S, V = logits.shape
    block = block or (4096 if logits.is_cuda else 64)
    chunks = triton.cdiv(V, block)
    maxes = torch.empty(S, chunks, dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxes)
    values = torch.empty(S, chunks, top_n, dtype=torch.float32, device=logits.device)
    ids = torch.empty(S, chunks, top_n, dtype=torch.int32, device=logits.device)
    if S:
        _logprobs_kernel[(S, chunks)](logits, maxes, sums, values, ids, V, logits.stride(0), top_n, BLOCK=block,
                                      num_warps=8 if block >= 4096 else 4)
    top = maxes.max(dim=1, keepdim=True).values
    lse = top + (sums * (maxes - top).exp()).sum(dim=1, keepdim=True).log()
    chosen = (logits.gather(1, tokens.unsqueeze(1)) - lse).squeeze(1)
    if not top_n:
        return chosen, values.flatten(1), ids.flatten(1).long()
    best, where = values.flatten(1).topk(top_n, dim=1)  # the top_n of every chunk's top_n
    return chosen, best - lse, ids.flatten(1).gather(1, where).long()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logits [R, V] float32 and tokens [R] int64: (logprob of each row's token [R], the top_n logprobs
    [R, top_n] best first, their token ids [R, top_n] int64). Logprobs are logits minus the row's logsumexp, so the
    top-N of the logits is the top-N of the logprobs. On CUDA one pass over the logits (per chunk: max, sum of
    exponentials, top-N) and a merge of the chunks' few candidates; nothing of size [R, V] is written."""
    if use_triton(logits, "sampling"):
        return token_logprobs_triton(logits, tokens, top_n)
    return token_logprobs_ref(logits, tokens, top_n)


# ---------------------------------------------------------------------------------------------------
# Checks on reload (kernels/tsdev_kernels/checks.py): the float32 logits ops at the decode batches served, over the
# whole vocab

def _logits_tolerance(atol: float, rtol: float, why: str) -> dict:
    """The logits are float32 whatever the model's dtype."""
    return dict.fromkeys((torch.bfloat16, torch.float16, torch.float32), Tolerance(atol, rtol, why))


def _logits(shape, generator, device) -> torch.Tensor:
    return torch.randn(shape, generator=generator, device=device) * 4


def _logprobs_inputs(shape, dtype, device, generator):
    rows, vocab = shape
    tokens = torch.randint(0, vocab, (rows,), generator=generator, device=device)
    return _logits(shape, generator, device), tokens, 5


def _penalties_inputs(shape, dtype, device, generator):
    """A slot per row but the last (-1: left alone), histories with prompt and generated tokens, up to 16 bias
    entries on distinct tokens."""
    rows, vocab = shape
    randint = lambda high, size: torch.randint(0, high, size, generator=generator, device=device)  # noqa: E731
    slots = torch.arange(rows, device=device)
    slots[-1] = -1
    counts = randint(3, (rows, vocab)).to(torch.int32) * (randint(8, (rows, vocab)) == 0)  # a few tokens seen
    counts |= (randint(16, (rows, vocab)) == 0).to(torch.int32) * PROMPT_BIT  # and the prompt's
    params = torch.rand(rows, 3, generator=generator, device=device)  # presence, frequency in [0, 1)
    params[:, 2] += 1.0  # repetition >= 1
    bias_ids = torch.stack([torch.randperm(vocab, generator=generator, device=device)[:16]  # distinct, as a
                            for _ in range(rows)]).to(torch.int32)  # request's logit_bias (a dict) holds them
    bias_values = torch.randn(rows, 16, generator=generator, device=device)
    bias_count = randint(17, (rows,)).to(torch.int32)
    return _logits(shape, generator, device), slots, counts, params, bias_ids, bias_values, bias_count


def _draw_inputs(shape, dtype, device, generator, filtered: bool):
    """Logits, temperatures with greedy rows (0) among sampled ones, the rows' seeds; with `filtered`, top-k in
    1..SAMPLE_TOP_K and top-p in (0.05, 1] (half the rows: off)."""
    rows, _ = shape
    temps = torch.rand(rows, generator=generator, device=device) * 1.5 + 0.2
    temps[::3] = 0.0
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=generator, device=device)
    top_ks = torch.zeros(rows, dtype=torch.int64, device=device)
    top_ps = torch.ones(rows, device=device)
    if filtered:
        top_ks = torch.randint(1, SAMPLE_TOP_K + 1, (rows,), generator=generator, device=device)
        ps = torch.rand(rows, generator=generator, device=device) * 0.9 + 0.05
        top_ps = torch.where(torch.rand(rows, generator=generator, device=device) < 0.5, ps, 1.0)
    return _logits(shape, generator, device), temps, top_ks, top_ps, seeds


def _sample_ref(logits, temps, top_ks, top_ps, seeds):
    cols = torch.arange(logits.shape[1], device=logits.device)
    return sample_ref(logits, temps, top_ks, top_ps, exponential_noise(seeds, cols))


def _on_a_copy(apply):
    def run(logits, *tables):
        out = logits.clone()
        apply(out, *tables)
        return out
    return run


SAMPLE_TOP_K = 50  # the sample_top_k check's max_top_k (a request's usual top_k is at most this)
SAME_TOKENS = _logits_tolerance(0.0, 0.0, "token ids: the same seeded noise on the same logits draws the same token "
                                "(a near tie within float32 rounding: about once in 10^6 rows)")


def _logprobs_cost(logits, tokens, top_n):
    """The logits and tokens read; per row the chosen token's log-probability and the top_n (value, id) written."""
    rows = logits.shape[0]
    return nbytes(logits, tokens) + rows * 4 + rows * top_n * (4 + 8), 0


def _sample_cost(logits, *per_row):
    """The logits and the rows' parameters read, one int64 token per row written."""
    return nbytes(logits, *per_row) + logits.shape[0] * 8, 0


def _penalties_cost(logits, *tables):
    """The logits read and written in place, the rows' counts, parameters and bias entries read."""
    return 2 * nbytes(logits) + nbytes(*tables), 0


def _decode_rows(serving):
    return [(t, serving.vocab) for t in serving.tokens if t <= serving.max_running]


CHECKS = [
    KernelCheck(op="token_logprobs", kernels=("_logprobs_kernel",), shapes=_decode_rows, inputs=_logprobs_inputs,
                kernel=token_logprobs_triton, reference=token_logprobs_ref, cost=_logprobs_cost,
                tolerance=_logits_tolerance(1e-4, 1e-5, "float32 log-sum-exp over the vocab in chunks, merged: "
                                            "the sums' order; the top ids exact (no ties in random logits)")),
    KernelCheck(op="sample", kernels=("_race_kernel",), shapes=_decode_rows,
                inputs=lambda shape, dtype, device, generator: _draw_inputs(shape, dtype, device, generator, False),
                kernel=lambda logits, temps, top_ks, top_ps, seeds: race_triton(logits, temps, seeds),
                reference=_sample_ref, tolerance=SAME_TOKENS, cost=_sample_cost),
    KernelCheck(op="sample_top_k", kernels=("_candidates_kernel",), shapes=_decode_rows,
                inputs=lambda shape, dtype, device, generator: _draw_inputs(shape, dtype, device, generator, True),
                kernel=lambda logits, temps, top_ks, top_ps, seeds: sample_top_k_triton(logits, temps, top_ks, top_ps,
                                                                                        seeds, SAMPLE_TOP_K),
                reference=_sample_ref, tolerance=SAME_TOKENS, cost=_sample_cost),
    KernelCheck(op="apply_penalties", kernels=("_bias_kernel", "_penalties_kernel"), shapes=_decode_rows,
                inputs=_penalties_inputs, kernel=_on_a_copy(apply_penalties_triton),
                reference=_on_a_copy(apply_penalties_ref), cost=_penalties_cost,
                tolerance=_logits_tolerance(1e-5, 1e-6, "float32, the same operations in the same order")),
]
