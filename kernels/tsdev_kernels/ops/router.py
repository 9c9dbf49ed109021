"""The mixture-of-experts router in two launches: the router GEMM (torch's linear: cuBLAS, logits rounded to x's
dtype), then one Triton program per token for the softmax over the experts in float32, the top k and their
renormalisation, written as the ids and weights the MoE kernels read (moe.py). The torch router
(runtime/tsdev_runtime/moe/router.py's CPU path) is about seven launches.

A first version did the GEMV in the same kernel, one program per token: at batch 1 one SM read the router's whole
[E, H] weight (512 KB for Qwen3-30B-A3B), 30 µs on the H200 against the torch router's 24 µs. cuBLAS spreads it.

The k largest probabilities are picked one after another, the lower expert id first among equal ones (a stable
order, as `route_ref`'s stable sort; torch.topk leaves ties unspecified). With the logits the reference's own, the
ids are the reference's. The weights are rounded to x's dtype, where transformers' Qwen3-MoE rounds them, and
returned in float32.
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
def _softmax_top_k_kernel(LOGITS, WEIGHTS, IDS, E, stride_l, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                          BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    raw = tl.load(LOGITS + t * stride_l + experts, mask=valid, other=0.0)
    logits = tl.where(valid, raw.to(tl.float32), float("-inf"))
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
        tl.store(WEIGHTS + t * TOP_K + k, weight.to(raw.dtype).to(tl.float32))


def route_triton(x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    T = x.shape[0]
    E = w.shape[0]
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=x.device)
    if T:
        logits = F.linear(x, w)
        _softmax_top_k_kernel[(T,)](logits, weights, ids, E, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
                                    BLOCK_E=triton.next_power_of_2(E), num_warps=1 if E <= 128 else 2)
    return weights, ids
