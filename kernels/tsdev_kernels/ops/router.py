"""The mixture-of-experts router in two launches: the router GEMM (linear.py's `linear`, as the projections run it:
the Triton GEMV for one token, the skinny kernel up to SKINNY_ROWS, cuBLAS above; logits rounded to x's dtype), then
one Triton program per token for the softmax over the experts in float32, the top k and their renormalisation,
written as the ids and weights the MoE kernels read (moe.py). The torch router (runtime/tsdev_runtime/moe/router.py's
CPU path) is about seven launches.

A first version did the GEMV in the same kernel, one program per token: at batch 1 one SM read the router's whole
[E, H] weight (512 KB for Qwen3-30B-A3B), 30 µs on the H200 against the torch router's 24 µs. The GEMV spreads it
over E programs (cuBLAS did, at the ~4-12 µs it takes for one row of the projections: docs/benchmarks.md).

The k largest probabilities are picked one after another, the lower expert id first among equal ones (a stable
order, as `route_ref`'s stable sort; torch.topk leaves ties unspecified). With the logits the reference's own, the
ids are the reference's. The weights are rounded to x's dtype, where transformers' Qwen3-MoE rounds them, and
returned in float32.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tsdev_kernels.ops.linear import linear


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
        logits = linear(x, w)
        _softmax_top_k_kernel[(T,)](logits, weights, ids, E, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
                                    BLOCK_E=triton.next_power_of_2(E), num_warps=1 if E <= 128 else 2)
    return weights, ids


# --- DeepSeek-V3's grouped routing ------------------------------------------------------------------------------------
# Sigmoid scores; the choice adds `e_score_correction_bias`; the experts are in `n_group` groups, each group scored by
# the sum of its two best choices, and only the `topk_group` best groups' experts may be chosen; the weights are the
# chosen experts' scores (without the bias), renormalised when `norm_topk_prob`, times `routed_scaling_factor`. The
# router's GEMM is in float32, as transformers' DeepseekV3TopkRouter computes it. Not served yet (DeepSeek models are
# their own issue); the kernel and its reference are here beside the softmax router's.


def route_grouped_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                      topk_group: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], w [E, H], bias [E] -> (weights [T, k] float32, ids [T, k] int32), best choice first."""
    scores = F.linear(x.float(), w.float()).sigmoid()
    choice = scores + bias.float()
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    allowed = torch.zeros(T, n_group, dtype=torch.bool, device=x.device).scatter_(1, best_groups, True)
    choice = choice.masked_fill(~allowed.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids.to(torch.int32)


@triton.jit
def _grouped_top_k_kernel(LOGITS, BIAS, WEIGHTS, IDS, stride_l, SCALING, TOP_K: tl.constexpr, N_GROUP: tl.constexpr,
                          GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, RENORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, N_GROUP)[:, None]
    members = tl.arange(0, GROUP)[None, :]
    experts = groups * GROUP + members  # [N_GROUP, GROUP]
    scores = tl.sigmoid(tl.load(LOGITS + t * stride_l + experts))
    choice = scores + tl.load(BIAS + experts)
    # each group's score: its two best choices (the lower member first among equal ones)
    first = tl.max(choice, axis=1)
    first_at = tl.min(tl.where(choice == first[:, None], members, GROUP), axis=1)
    second = tl.max(tl.where(members == first_at[:, None], float("-inf"), choice), axis=1)
    group_score = first + second
    allowed = tl.zeros([N_GROUP], tl.int1)
    group_ids = tl.arange(0, N_GROUP)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(group_score, axis=0)
        chosen = tl.min(tl.where(group_score == best, group_ids, N_GROUP), axis=0)
        allowed = allowed | (group_ids == chosen)
        group_score = tl.where(group_ids == chosen, float("-inf"), group_score)
    choice = tl.where(allowed[:, None], choice, float("-inf"))
    total = tl.sum(tl.zeros([N_GROUP], tl.float32), axis=0)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        chosen = tl.min(tl.min(tl.where(choice == best, experts, N_GROUP * GROUP), axis=1), axis=0)
        weight = tl.sum(tl.sum(tl.where(experts == chosen, scores, 0.0), axis=1), axis=0)
        tl.store(IDS + t * TOP_K + k, chosen)
        tl.store(WEIGHTS + t * TOP_K + k, weight)
        total += weight
        choice = tl.where(experts == chosen, float("-inf"), choice)
    for k in tl.static_range(TOP_K):
        weight = tl.load(WEIGHTS + t * TOP_K + k)
        if RENORMALIZE:
            weight = weight / (total + 1e-20)
        tl.store(WEIGHTS + t * TOP_K + k, weight * SCALING)


def route_grouped_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                         topk_group: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_grouped_ref` in two launches: the router GEMM in float32, then one program per token. The experts'
    count and group size must be powers of two (DeepSeek-V3: 256 in 8 groups of 32)."""
    T, E = x.shape[0], w.shape[0]
    group = E // n_group
    if E % n_group or group & (group - 1) or n_group & (n_group - 1) or group < 2:
        raise ValueError(f"grouped routing of {E} experts in {n_group} groups: the groups must be of a power-of-two "
                         "size of at least 2, and their count a power of two")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=x.device)
    if T:
        logits = F.linear(x.float(), w.float())
        _grouped_top_k_kernel[(T,)](logits, bias.float().contiguous(), weights, ids, logits.stride(0), float(scaling),
                                    TOP_K=top_k, N_GROUP=n_group, GROUP=group, TOPK_GROUP=topk_group,
                                    RENORMALIZE=renormalize, num_warps=1 if E <= 128 else 4)
    return weights, ids
