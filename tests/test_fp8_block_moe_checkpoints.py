"""A mixture of experts stored as block-quantized FP8 (Qwen's *-FP8 MoE releases: every projection and every expert's
gate, up and down in e4m3 with one float32 multiplier per 128 x 128 block; the router unconverted) served on the CPU.
The checkpoint: a Qwen3-MoE that transformers wrote, quantized by the writer that stores what transformers' own
quantizer stores. The oracle: transformers' model on the same tensors with each projection and each expert's three
run as the plain-torch w8a8-block arithmetic -- greedy tokens equal, alone and under --tp 2 on gloo; a layer with some
experts left unconverted is refused by name; the logits close to the unquantized model's; the weights drill and its
negative control; the embedded `default-moe-fp8`."""
import functools

import pytest
import torch
from safetensors.torch import load_file
from test_fp8_block_checkpoints import (PROMPTS, TOKENS, cosines_to_unquantized, oracle_greedy,  # the dense model's
                                        perturbed, prefill_logits, served, tp_rank, update_and_verify,  # oracle,
                                        write_fp8_blocks)  # prompts, ranks, lifecycle

from tsdev_kernels.ops.fp8_block import fp8_block_linear_ref
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from written import save_with_tiny_tokenizer

QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                "modules_to_not_convert": ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]}


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir, tmp_path_factory):
    """A Qwen3-MoE that transformers wrote, float32: two sparse layers around a dense one, 4 experts of 256
    intermediate features (two 128-row blocks of gate and of up, also 128 on each of two ranks), top 2, hidden 192
    (a partial block), q 256 rows and k, v 128."""

    import transformers

    out = tmp_path_factory.mktemp("hf-qwen3-moe-blocks")
    config = transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=192, intermediate_size=256,
                                         moe_intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=128, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                                         max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(7)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp.gate." in name:
                param.normal_(0.0, 0.2)  # a router that varies its choice from token to token
    return save_with_tiny_tokenizer(model, out, tiny_model_dir)


def block_experts(tensors, prefix, act_fn, hidden_states, top_k_index, top_k_weights):
    """transformers' expert loop, each expert's projections as the w8a8-block arithmetic on the checkpoint's tensors."""
    def project(rows, e, proj):
        name = f"{prefix}.{e}.{proj}_proj"
        return fp8_block_linear_ref(rows, tensors[name + ".weight"], tensors[name + ".weight_scale_inv"])
    out = torch.zeros_like(hidden_states)
    for e in top_k_index.unique().tolist():
        token, k = torch.where(top_k_index == e)
        rows = hidden_states[token]
        h = act_fn(project(rows, e, "gate")) * project(rows, e, "up")
        out.index_add_(0, token, project(h, e, "down") * top_k_weights[token, k, None])
    return out


def expert_loops(name, module, tensors):
    """oracle_greedy's patch: each sparse layer's experts run `block_experts`."""
    if name.endswith(".mlp.experts"):
        module.forward = functools.partial(block_experts, tensors, name, module.act_fn)


def test_a_block_fp8_moe_checkpoint_serves_the_greedy_tokens_of_the_same_arithmetic(moe_dir, tmp_path):
    fp8_dir = write_fp8_blocks(moe_dir, tmp_path / "fp8", QUANTIZATION)
    tensors = load_file(str(next(fp8_dir.glob("*.safetensors"))))
    assert tensors["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router as shipped
    engine, ours = served(fp8_dir, PROMPTS)
    experts = engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale_inv.shape == (4, 4, 2)
    assert experts.w2_scale_inv.shape == (4, 2, 2) and experts.block == (128, 128)
    routers = [layer.mlp.gate.weight for layer in engine.runner.model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(routers) == 2 and all(router.dtype == torch.float32 for router in routers)  # left unconverted
    assert torch.equal(experts.w2_scale_inv[3], tensors["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"])
    assert torch.equal(experts.w13_scale_inv[1, 2:], tensors["model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"])
    want = oracle_greedy(moe_dir, fp8_dir, PROMPTS, "Qwen3MoeForCausalLM", expert_loops)
    assert ours == want and len({tuple(t) for t in ours}) == len(ours)  # (that it is not the unquantized model's:
    # the logits test below)


@pytest.mark.slow
def test_two_ranks_each_hold_their_experts_blocks_and_serve_the_tokens_of_one(moe_dir, tmp_path):
    """Each rank holds 128 of every expert's 256 intermediate features: one block of gate rows, of up rows and of
    down's columns."""
    from ranks import run_ranks

    fp8_dir = write_fp8_blocks(moe_dir, tmp_path / "fp8", QUANTIZATION)
    rank0, _ = run_ranks(tp_rank, 2, str(fp8_dir), timeout=240)
    assert rank0 == served(fp8_dir, PROMPTS)[1]


def test_a_layer_with_some_experts_left_unconverted_is_refused_by_name(moe_dir, tmp_path):
    quantization = {**QUANTIZATION, "modules_to_not_convert": [*QUANTIZATION["modules_to_not_convert"],
                                                               "model.layers.2.mlp.experts.1.up_proj"]}
    fp8_dir = write_fp8_blocks(moe_dir, tmp_path / "fp8", quantization)
    with pytest.raises(ValueError, match="model.layers.2.mlp.experts.1.up_proj is left unconverted"):
        LLMEngine(EngineConfig(model=str(fp8_dir), device="cpu", dtype="float32"))


@pytest.mark.parametrize("change, expected", [
    (dict(drop="model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"),
     "lacks 1 tensor.*experts.3.down_proj.weight_scale_inv"),
    (dict(reshape="model.layers.0.mlp.experts.1.gate_proj.weight_scale_inv"),  # 256 x 192: 2 x 2 blocks
     "experts.1.gate_proj.weight_scale_inv has shape \\(1, 2\\), the model expects \\(2, 2\\)"),
])
def test_an_expert_with_its_scale_missing_or_misshapen_is_refused_by_name(moe_dir, tmp_path, change, expected):
    fp8_dir = write_fp8_blocks(moe_dir, tmp_path / "fp8", QUANTIZATION, **change)
    with pytest.raises(ValueError, match=expected):
        LLMEngine(EngineConfig(model=str(fp8_dir), device="cpu", dtype="float32"))


@pytest.mark.slow
def test_its_logits_are_close_to_the_unquantized_models(moe_dir, tmp_path):
    fp8_dir = write_fp8_blocks(moe_dir, tmp_path / "fp8", QUANTIZATION)
    for exact, quantized in zip(prefill_logits(moe_dir, PROMPTS), prefill_logits(fp8_dir, PROMPTS), strict=True):
        assert not torch.equal(exact, quantized)  # the FP8 arithmetic ran
        cosine = torch.nn.functional.cosine_similarity(exact, quantized, dim=0)
        assert cosine > 0.99, cosine


def test_the_weights_drill_holds_on_block_fp8_experts_and_catches_its_negative_control(moe_dir, tmp_path):
    """sleep(level=2) -> wake -> reload_weights: every tensor (the experts' e4m3 weights and block scales among them)
    equal to a fresh load, greedy output unchanged; derived tensors left stale are caught. Then a direct update to
    another block-FP8 MoE checkpoint and back, each verified against a fresh load."""
    from tsdev_runtime.engine.weights_drill import DrillFailed, drill
    from tsdev_runtime.weights.processing import DEBUG_DERIVED_ENV

    fp8_dir = write_fp8_blocks(moe_dir, tmp_path / "fp8", QUANTIZATION)
    engine, before = served(fp8_dir, PROMPTS)
    report = drill(engine, rounds=2)
    assert report.rounds == 2 and len(report.seconds["reload"]) == 2
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DEBUG_DERIVED_ENV, "skip")
        with pytest.raises(DrillFailed, match="differ from the fresh load"):
            drill(engine, rounds=1)
    engine.control.set(weights_loaded=True)
    engine.control.load_weights()
    after = [r["token_ids"] for r in engine.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0,
                                                                             ignore_eos=True))]
    assert after == before
    other = write_fp8_blocks(perturbed(moe_dir, tmp_path / "other-source"), tmp_path / "other-fp8", QUANTIZATION)
    update_and_verify(engine, other, fp8_dir, before)


@pytest.mark.slow
def test_the_embedded_default_moe_fp8_serves_default_moes_kind_stored_as_block_fp8(tmp_path, monkeypatch):
    import json

    from tsdev_runtime.weights.default_model import DEFAULT_MOE_FP8

    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path / "cache"))
    engine = LLMEngine(EngineConfig(model=DEFAULT_MOE_FP8, device="cpu"))
    assert json.loads((engine.model_dir / "config.json").read_text())["quantization_config"]["weight_block_size"] \
        == [128, 128]
    experts = engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.block == (128, 128)
    tokens = engine.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    assert all(len(r["token_ids"]) == TOKENS for r in tokens)
    for cosine in cosines_to_unquantized(engine.model_dir, "tiny-moe-blocks", tmp_path):
        # looser than the transformers-written model's 0.99: this router's logits (std 1 over 8 experts) are close
        # enough that FP8's rounding sends some tokens to another expert (2 of the first prompt's rows in layer 0:
        # cosine 0.958), which changes their output by more than rounding
        assert cosine > 0.9, cosine
