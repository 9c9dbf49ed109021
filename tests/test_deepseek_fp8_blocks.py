"""DeepSeek-V3 as it ships: block-quantized FP8 (every projection and expert in e4m3 with one float32 multiplier per
128 x 128 block; the router as stored). A tiny V3 that transformers wrote, quantized by the writer that stores what
transformers' quantizer stores, served on the CPU. The oracle: transformers' model on the same tensors, each
projection the plain-torch w8a8-block arithmetic except kv_b_proj, whose dequantized weight the absorbed form
multiplies in (W_UK / W_UV: tsdev, as vLLM, never quantizes the latent) -- greedy tokens equal; W_UK / W_UV are the
dequantized rows; the weights drill holds."""
import pytest
import torch
from safetensors.torch import load_file
from test_fp8_block_checkpoints import PROMPTS, oracle_greedy, served, write_fp8_blocks
from test_fp8_block_moe_checkpoints import expert_loops

from tsdev_kernels.ops.fp8_block import dequantize_fp8_blocks
from written import save_with_tiny_tokenizer

QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


@pytest.fixture(scope="module")
def v3_dir(tiny_model_dir, tmp_path_factory):
    """A DeepSeek-V3 that transformers wrote, float32, shaped for whole 128-row blocks where tsdev stacks or splits
    (q_b and kv_b 256 rows: 2 heads of 64 + 64; experts and the shared expert 128 wide, the dense MLP 256) and
    partial ones elsewhere (hidden 192; kv_a_proj_with_mqa's 128 + 64 rows)."""

    import transformers

    out = tmp_path_factory.mktemp("hf-deepseek-v3-blocks")
    config = transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=192, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=64,
        qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(9)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp.gate." in name:
                param.normal_(0.0, 0.2)  # a router that varies its choice from token to token
            elif not name.endswith("norm.weight"):
                param.normal_(0.0, 0.1)
    return save_with_tiny_tokenizer(model, out, tiny_model_dir)


class DequantizedLinear(torch.nn.Module):
    def __init__(self, weight, scale):
        super().__init__()
        self.weight = dequantize_fp8_blocks(weight, scale)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype))


def projection(name, weight, scale):
    from test_fp8_block_checkpoints import BlockFP8Linear

    return DequantizedLinear(weight, scale) if name.endswith("kv_b_proj") else BlockFP8Linear(weight, scale)


def test_a_block_fp8_deepseek_v3_serves_the_greedy_tokens_of_the_same_arithmetic(v3_dir, tmp_path):
    fp8_dir = write_fp8_blocks(v3_dir, tmp_path / "fp8", QUANTIZATION)
    tensors = load_file(str(next(fp8_dir.glob("*.safetensors"))))
    assert tensors["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router as shipped
    engine, ours = served(fp8_dir, PROMPTS)
    layer = engine.runner.model.model.layers[1]
    assert layer.self_attn.kv_a_proj_with_mqa.weight_scale_inv.shape == (2, 2)  # 192 rows, 192 columns: partial
    assert layer.mlp.experts.block == (128, 128) and layer.mlp.shared_experts.gate_up_proj.quantization == "fp8_block"
    kv_b = dequantize_fp8_blocks(tensors["model.layers.1.self_attn.kv_b_proj.weight"],
                                 tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]).view(2, 128, 128)
    assert torch.equal(layer.self_attn.w_uk, kv_b[:, :64].float())
    assert ours == oracle_greedy(v3_dir, fp8_dir, PROMPTS, "DeepseekV3ForCausalLM", expert_loops, projection)
    assert len({tuple(t) for t in ours}) == len(ours)


def test_the_drill_holds_on_a_block_fp8_deepseek_v3(v3_dir, tmp_path):
    from tsdev_runtime.engine.weights_drill import drill

    engine, _ = served(write_fp8_blocks(v3_dir, tmp_path / "fp8", QUANTIZATION), PROMPTS[:1])
    assert drill(engine, rounds=2).rounds == 2
