"""The mixture-of-experts router in one launch: the router GEMV (x @ w.T, float32 sums, logits rounded to x's dtype as
torch's linear rounds them), the softmax over the experts in float32, the top k and their renormalisation, written as
the ids and weights the MoE kernels read (moe.py). The torch router (runtime/tsdev_runtime/moe/router.py) is about
seven launches at batch 1.

One program per token: it reads the token's row and the router's [E, H] weights in tiles of BLOCK_E x BLOCK_H (the
weights stay in L2 across the tokens), then picks the k largest probabilities one after another, the lower expert id
first among equal ones (a stable order, as `route_ref`'s stable sort; torch.topk leaves ties unspecified). The weights
are rounded to x's dtype, where transformers' Qwen3-MoE rounds them, and returned in float32.

Not yet what the model serves with: it waits for its check on the H200 (tests/test_router_gpu.py; issue 49).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def route_ref(x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], w [E, H] -> (weights [T, k] float32, rounded to x's dtype; ids [T, k] int32), best first."""
    probs = torch.softmax(F.linear(x, w), dim=-1, dtype=torch.float32)
    ordered = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = ordered.values[:, :top_k], ordered.indices[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype).float(), ids.to(torch.int32)


@triton.jit
def _router_kernel(X, W, WEIGHTS, IDS, E, H, stride_x, stride_w, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    acc = tl.zeros([BLOCK_E], tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        in_row = cols < H
        x = tl.load(X + t * stride_x + cols, mask=in_row, other=0.0).to(tl.float32)
        w = tl.load(W + experts[:, None].to(tl.int64) * stride_w + cols[None, :],
                    mask=valid[:, None] & in_row[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    logits = tl.where(valid, acc.to(X.dtype.element_ty).to(tl.float32), float("-inf"))
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    total = tl.sum(tl.zeros([BLOCK_E], tl.float32), axis=0)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        chosen = tl.min(tl.where(probs == best, experts, BLOCK_E), axis=0)
        tl.store(IDS + t * TOP_K + k, chosen)
        tl.store(WEIGHTS + t * TOP_K + k, best)
        total += best
        probs = tl.where(experts == chosen, -1.0, probs)
    for k in tl.static_range(TOP_K):
        weight = tl.load(WEIGHTS + t * TOP_K + k)
        if RENORMALIZE:
            weight = weight / total
        tl.store(WEIGHTS + t * TOP_K + k, weight.to(X.dtype.element_ty).to(tl.float32))


def route_triton(x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    T, H = x.shape
    E = w.shape[0]
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=x.device)
    if T:
        block_e = triton.next_power_of_2(E)
        block_h = min(triton.next_power_of_2(H), max(16, 8192 // block_e))
        x, w = x.contiguous(), w.contiguous()
        _router_kernel[(T,)](x, w, weights, ids, E, H, x.stride(0), w.stride(0), TOP_K=top_k,
                             RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_H=block_h, num_warps=4)
    return weights, ids
