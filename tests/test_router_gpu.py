"""The fused MoE router on the GPU at the shapes users serve (Qwen3-30B-A3B: 128 experts over 2048; DeepSeek-V3's
gate: 256 over 7168), bf16, against its torch reference. The logits are rounded to bf16 (as torch's linear rounds
them), so exact ties are common and both break them toward the lower expert id; the two sum in different orders, so
a logit may round to the neighbouring bf16 value: then the kernel may pick an expert whose reference probability
equals, within that rounding, the one the reference picked. Every row must be such a top k, nearly every row the
same ids, and the weights of rows with the same ids within one bf16 rounding."""
import pytest
import torch

from tsdev_kernels.ops.router import route_ref, route_triton

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("experts, hidden, top_k", [(128, 2048, 8), (256, 7168, 8), (32, 1024, 4)])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_the_fused_router_matches_the_reference_on_the_gpu(experts, hidden, top_k, tokens):
    g = torch.Generator(device="cuda").manual_seed(experts + tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(experts, hidden, device="cuda", generator=g) * hidden**-0.5).to(torch.bfloat16)
    weights, ids = route_triton(x, w, top_k, True)
    want_weights, want_ids = route_ref(x, w, top_k, True)
    probs = torch.softmax(torch.nn.functional.linear(x, w), dim=-1, dtype=torch.float32)
    best = probs.sort(-1, descending=True).values[:, :top_k]
    picked = probs.gather(1, ids.long()).sort(-1, descending=True).values
    torch.testing.assert_close(picked, best, rtol=0.02, atol=0)  # a top k, up to one bf16 rounding of a logit
    assert all(len(set(row)) == top_k for row in ids.tolist())  # k distinct experts
    same = (ids == want_ids).all(dim=-1)
    assert same.float().mean() >= (0.98 if tokens > 64 else 0.9), same.float().mean()
    torch.testing.assert_close(weights[same], want_weights[same], atol=8e-3, rtol=8e-3)


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_deepseek_v3s_grouped_routing_matches_its_reference_on_the_gpu(tokens):
    """DeepSeek-V3's gate: 256 experts over 7168 in 8 groups, 4 groups allowed, top 8, scaling 2.5. Both take the
    same float32 logits (one F.linear), so the ids are the reference's."""
    from tsdev_kernels.ops.router import route_grouped_ref, route_grouped_triton

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 7168, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(256, 7168, device="cuda", generator=g) * 7168**-0.5).to(torch.bfloat16)
    bias = torch.randn(256, device="cuda", generator=g) * 0.1
    weights, ids = route_grouped_triton(x, w, bias, 8, 8, 4, True, 2.5)
    want_weights, want_ids = route_grouped_ref(x, w, bias, 8, 8, 4, True, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-5)
