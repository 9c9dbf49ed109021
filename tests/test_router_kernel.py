"""The fused MoE router (kernels/tsdev_kernels/ops/router.py) against its torch reference, under Triton's interpreter:
fresh random inputs, ties, all-equal logits, experts no token picks, every token to one expert."""
import os

import pytest
import torch

from tsdev_kernels.ops.router import route_ref, route_triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the Triton kernel on the CPU under TRITON_INTERPRET=1 (conftest sets it)")


def assert_same_routing(x, w, top_k, renormalize, near=1e-6):
    weights, ids = route_triton(x, w, top_k, renormalize)
    want_weights, want_ids = route_ref(x, w, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    probs = torch.softmax(torch.nn.functional.linear(x, w), dim=-1, dtype=torch.float32)
    ordered = probs.sort(dim=-1, descending=True).values
    for t in range(x.shape[0]):  # a near-tie (within float32 rounding of the two softmaxes) may go either way
        gaps = (ordered[t, : top_k + 1].diff().abs() < near).any()
        if not gaps:
            assert ids[t].tolist() == want_ids[t].tolist(), (t, ids[t], want_ids[t])
    tol = 1e-6 if x.dtype == torch.float32 else 8e-3  # one rounding to x's dtype apart at most
    torch.testing.assert_close(weights, want_weights, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, hidden, top_k, renormalize", [
    (1, 8, 64, 2, True), (5, 128, 96, 8, True), (3, 60, 40, 4, False), (7, 256, 72, 8, True)])
def test_the_fused_router_routes_as_the_reference_on_random_inputs(dtype, tokens, experts, hidden, top_k, renormalize):
    g = torch.Generator().manual_seed(tokens * 1000 + experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(dtype)
    assert_same_routing(x, w, top_k, renormalize)


@pytest.mark.parametrize("tokens", [1, 5, 12])
def test_the_router_gemm_runs_on_the_projection_kernels_and_routes_as_the_reference(tokens, monkeypatch):
    """On CUDA the router's GEMM is linear.py's `linear`: the Triton GEMV for one token, the skinny kernel up to
    SKINNY_ROWS, cuBLAS above (here torch's) -- interpreted, in float32 (the interpreter's bf16 dots are not exact)."""
    from tsdev_kernels.ops import linear

    calls = []
    for name in ("gemv_triton", "skinny_triton", "linear_ref"):
        kernel = getattr(linear, name)
        monkeypatch.setattr(linear, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    monkeypatch.setattr(linear, "use_triton", lambda x, family: True)
    g = torch.Generator().manual_seed(tokens)
    x, w = torch.randn(tokens, 96, generator=g), torch.randn(128, 96, generator=g) * 96**-0.5
    assert_same_routing(x, w, 8, True)
    assert calls[0] == {1: "gemv_triton", 5: "skinny_triton", 12: "linear_ref"}[tokens]


def test_ties_and_all_equal_logits_pick_the_lower_expert_first():
    x = torch.ones(3, 16)
    w = torch.zeros(12, 16)  # all logits equal: experts 0..k-1, each 1/k after renormalising
    weights, ids = route_triton(x, w, 4, True)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3 and torch.allclose(weights, torch.full((3, 4), 0.25))
    w[7] = w[3] = w[9] = 1.0  # three equal best experts, then the rest equal
    weights, ids = route_triton(x, w, 4, False)
    assert ids.tolist() == [[3, 7, 9, 0]] * 3
    assert_same_routing(x, w, 4, False)


def test_experts_no_token_picks_and_every_token_to_one_expert():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 32, generator=g).abs() + 0.1  # positive rows
    w = torch.randn(16, 32, generator=g) * 0.01
    w[5] = 10.0  # every token's best is expert 5 by far
    weights, ids = route_triton(x, w, 2, True)
    assert (ids[:, 0] == 5).all() and (weights[:, 0] > 0.99).all()
    assert_same_routing(x, w, 2, True)  # (9 tokens, top 2, one of them 5: at least 6 of the 16 experts get none)


def transformers_grouped_route(x, w, bias, top_k, n_group, topk_group, renormalize, scaling):
    """transformers' DeepseekV3TopkRouter on the same weights: (weights, ids) of each token, in its order."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=x.shape[1], n_routed_experts=w.shape[0], num_experts_per_tok=top_k,
                              n_group=n_group, topk_group=topk_group, norm_topk_prob=renormalize,
                              routed_scaling_factor=scaling)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(w.float())
        router.e_score_correction_bias.copy_(bias.float())
        _, weights, ids = router(x)
    return weights, ids


def by_id(weights, ids):
    """Each row's (id, weight) pairs in id order: transformers' top k is unsorted."""
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("tokens, experts, hidden, top_k, n_group, topk_group, renormalize", [
    (6, 16, 32, 4, 4, 2, True), (5, 64, 48, 8, 8, 4, True), (3, 32, 40, 6, 4, 1, False), (1, 256, 64, 8, 8, 4, True)])
def test_grouped_routing_chooses_what_transformers_deepseek_v3_router_chooses(tokens, experts, hidden, top_k, n_group,
                                                                             topk_group, renormalize):
    from tsdev_kernels.ops.router import route_grouped_ref, route_grouped_triton

    g = torch.Generator().manual_seed(experts * 10 + tokens)
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(experts, hidden, generator=g) * hidden**-0.5
    bias = torch.randn(experts, generator=g) * 0.1
    want_ids, want_weights = by_id(
        *transformers_grouped_route(x, w, bias, top_k, n_group, topk_group, renormalize, 2.5))
    for route in (route_grouped_ref, route_grouped_triton):
        weights, ids = route(x, w, bias, top_k, n_group, topk_group, renormalize, 2.5)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        got_ids, got_weights = by_id(weights, ids)
        assert torch.equal(got_ids, want_ids), route.__name__
        torch.testing.assert_close(got_weights, want_weights, rtol=1e-5, atol=1e-6)
    chosen_groups = (ids.long() // (experts // n_group))
    assert all(len(set(row)) <= topk_group for row in chosen_groups.tolist())


def test_grouped_routing_refuses_groups_it_cannot_hold():
    from tsdev_kernels.ops.router import route_grouped_triton

    with pytest.raises(ValueError, match="power-of-two"):
        route_grouped_triton(torch.randn(2, 8), torch.randn(24, 8), torch.zeros(24), 2, 4, 2, True, 1.0)
