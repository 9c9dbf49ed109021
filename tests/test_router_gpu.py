"""The fused MoE router on the GPU at the shapes users serve (Qwen3-30B-A3B: 128 experts over 2048; DeepSeek-V3's
gate: 256 over 7168), bf16, against its torch reference: the same experts (near-ties aside), weights within one bf16
rounding."""
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
    probs = torch.softmax(torch.nn.functional.linear(x, w), dim=-1, dtype=torch.float32).sort(-1, descending=True)
    clear = ~(probs.values[:, : top_k + 1].diff(dim=-1).abs() < 1e-6).any(dim=-1)  # rows without a near-tie
    assert clear.float().mean() > 0.9
    assert torch.equal(ids[clear], want_ids[clear])
    torch.testing.assert_close(weights[clear], want_weights[clear], atol=8e-3, rtol=8e-3)
