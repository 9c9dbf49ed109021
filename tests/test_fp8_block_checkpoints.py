"""Serving a checkpoint stored as block-quantized FP8 (Qwen's *-FP8 format: e4m3 weights, one float32 multiplier per
128 x 128 block, activations quantized per token and group of 128 at run time), dense models, one rank. The
checkpoint: a Qwen3 that transformers wrote, its projections quantized by the writer that stores what transformers'
own quantizer stores (tests/test_fp8_block.py). The oracle: transformers' model on the same checkpoint with each
projection replaced by the plain-torch w8a8-block arithmetic -- greedy tokens equal; the logits close to the
unquantized model's; a missing scale, a scale of the wrong shape, another block size are refused by name."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tsdev_kernels.ops.fp8_block import fp8_block_linear_ref, quantize_fp8_blocks
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine, prompt_logits
from tsdev_runtime.engine.sequence import SamplingParams
from written import save_with_tiny_tokenizer

PROMPTS = [[5, 17, 300, 42, 9, 77, 123, 8], [900, 3, 3, 250, 61]]
TOKENS = 12
QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                "modules_to_not_convert": ["model.layers.1.mlp.down_proj"]}


@pytest.fixture(scope="module")
def source_dir(tiny_model_dir, tmp_path_factory):
    """A Qwen3 that transformers wrote, float32, shaped so that every stacked shard fills whole 128-row blocks (q 256,
    k and v 128 rows; gate and up 512), also on each of two ranks (q 128 rows each, k and v replicated, gate and up 256,
    down's 512 input features 256 each), with K sizes that leave partial blocks (hidden 192)."""
    import transformers

    out = tmp_path_factory.mktemp("hf-qwen3-blocks")
    config = transformers.Qwen3Config(vocab_size=1024, hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(5)
    return save_with_tiny_tokenizer(transformers.Qwen3ForCausalLM(config).to(torch.float32), out, tiny_model_dir)


def write_fp8_blocks(source, out, quantization=QUANTIZATION, drop=None, reshape=None):
    """`source`'s checkpoint with every projection not left unconverted stored as block FP8."""
    shutil.copytree(source, out)
    path = next(out.glob("*.safetensors"))
    tensors = {}
    for name, tensor in load_file(str(path)).items():
        module = name.removesuffix(".weight")
        if (name.endswith(("proj.weight", "proj_with_mqa.weight"))  # every projection (DeepSeek's latent one too)
                and module not in quantization.get("modules_to_not_convert", [])):
            tensors[name], tensors[module + ".weight_scale_inv"] = quantize_fp8_blocks(tensor)
        else:
            tensors[name] = tensor
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:1]
    save_file(tensors, str(path))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return out


class BlockFP8Linear(torch.nn.Module):
    """A transformers projection run as the plain-torch w8a8-block arithmetic on the checkpoint's tensors."""

    def __init__(self, weight, scale):
        super().__init__()
        self.weight, self.scale = weight, scale

    def forward(self, x):
        return fp8_block_linear_ref(x, self.weight, self.scale)


def oracle_greedy(source, fp8_dir, prompts, model_class: str = "Qwen3ForCausalLM", patch=None,
                  projection=lambda name, weight, scale: BlockFP8Linear(weight, scale)):
    """transformers' `model_class` on `source` with each projection the FP8 checkpoint quantized run as
    `projection(name, weight, scale)` (BlockFP8Linear); `patch(name, module, tensors)` for every other module (a
    mixture of experts' expert loop)."""
    import transformers

    model = getattr(transformers, model_class).from_pretrained(source, dtype=torch.float32)
    tensors = load_file(str(next(fp8_dir.glob("*.safetensors"))))
    for name, module in list(model.named_modules()):
        if f"{name}.weight_scale_inv" in tensors:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, projection(name, tensors[f"{name}.weight"],
                                                                  tensors[f"{name}.weight_scale_inv"]))
        elif patch is not None:
            patch(name, module, tensors)
    outputs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def served(model_dir, prompts, **config):
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **config))
    out = [r["token_ids"]
           for r in engine.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))]
    return engine, out


def test_a_block_fp8_checkpoint_serves_the_greedy_tokens_of_the_same_arithmetic_in_plain_torch(source_dir, tmp_path):
    fp8_dir = write_fp8_blocks(source_dir, tmp_path / "fp8")
    engine, ours = served(fp8_dir, PROMPTS)
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale_inv.shape == (4, 2)  # 512 rows, 192 columns
    assert engine.runner.model.model.layers[1].mlp.down_proj.weight.dtype == torch.float32  # left unconverted
    assert ours == oracle_greedy(source_dir, fp8_dir, PROMPTS)
    assert len({tuple(t) for t in ours}) == len(ours)


def prefill_logits(model_dir, prompts) -> list[torch.Tensor]:
    """The logits after each prompt (its last position), one engine on `model_dir`, each prompt in a step alone."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32"))
    return [prompt_logits(engine, prompt) for prompt in prompts]


def test_its_logits_are_close_to_the_unquantized_models(source_dir, tmp_path):
    fp8_dir = write_fp8_blocks(source_dir, tmp_path / "fp8")
    for exact, quantized in zip(prefill_logits(source_dir, PROMPTS), prefill_logits(fp8_dir, PROMPTS), strict=True):
        assert not torch.equal(exact, quantized)  # the FP8 arithmetic ran
        cosine = torch.nn.functional.cosine_similarity(exact, quantized, dim=0)
        assert cosine > 0.99, cosine


@pytest.mark.parametrize("change, expected", [
    (dict(drop="model.layers.0.self_attn.k_proj.weight_scale_inv"), "lacks 1 tensor.*k_proj.weight_scale_inv"),
    (dict(reshape="model.layers.0.mlp.up_proj.weight_scale_inv"),
     "up_proj.weight_scale_inv has shape \\(1, 2\\), the model expects \\(4, 2\\)"),  # 512 x 192: 4 x 2 blocks
    (dict(quantization={**QUANTIZATION, "weight_block_size": [64, 64]}),
     "64 x 64 block.*weight_block_size \\[128, 128\\]"),
])
def test_a_broken_or_unsupported_block_fp8_checkpoint_is_refused_by_name(source_dir, tmp_path, change, expected):
    fp8_dir = write_fp8_blocks(source_dir, tmp_path / "fp8", **change)
    with pytest.raises(ValueError, match=expected):
        LLMEngine(EngineConfig(model=str(fp8_dir), device="cpu", dtype="float32"))


def test_what_the_file_leaves_unconverted_stays_in_the_model_dtype_and_an_fp8_lm_head_is_refused(source_dir, tmp_path):
    """Embeddings, norms and lm_head in the model's dtype (here float32) beside the e4m3 projections; a file that
    stores lm_head as block FP8 too is refused naming it (it is not served quantized), not as a wrong architecture."""
    fp8_dir = write_fp8_blocks(source_dir, tmp_path / "fp8")
    engine = LLMEngine(EngineConfig(model=str(fp8_dir), device="cpu", dtype="float32"))
    params = dict(engine.runner.model.named_parameters())
    e4m3 = {name for name, p in params.items() if p.dtype == torch.float8_e4m3fn}
    assert e4m3 and all(name.endswith("proj.weight") and name + "_scale_inv" in params for name in e4m3)
    kept = [name for name in params if name not in e4m3 and not name.endswith("_scale_inv")]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(kept)
    assert all(params[name].dtype == torch.float32 for name in kept)
    path = next(fp8_dir.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["lm_head.weight"], tensors["lm_head.weight_scale_inv"] = quantize_fp8_blocks(tensors["lm_head.weight"])
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="stores lm_head as block FP8.*lm_head unconverted"):
        LLMEngine(EngineConfig(model=str(fp8_dir), device="cpu", dtype="float32"))


def test_quantizing_again_is_refused(source_dir, tmp_path):
    fp8_dir = write_fp8_blocks(source_dir, tmp_path / "fp8")
    with pytest.raises(ValueError, match="stored quantized already"):
        LLMEngine(EngineConfig(model=str(fp8_dir), device="cpu", dtype="float32", quantization="fp8"))


def test_sleep_wake_reload_and_a_direct_update_keep_the_stored_tensors_and_tokens(source_dir, tmp_path):
    """The weights lifecycle on a block-FP8 model: the drill (sleep level 2, wake, reload_weights: every tensor equal
    to a fresh load, greedy output unchanged), then a direct update to another block-FP8 checkpoint serves what a
    fresh engine on it serves, and back."""
    from tsdev_runtime.engine.weights_drill import DrillFailed, drill
    from tsdev_runtime.weights.processing import DEBUG_DERIVED_ENV

    fp8_dir = write_fp8_blocks(source_dir, tmp_path / "fp8")
    other = write_fp8_blocks(perturbed(source_dir, tmp_path / "other-source"), tmp_path / "other-fp8")
    engine, before = served(fp8_dir, PROMPTS)
    report = drill(engine, rounds=2)
    assert report.rounds == 2 and len(report.seconds["reload"]) == 2
    with pytest.MonkeyPatch.context() as patch:  # the negative control: derived tensors not refreshed
        patch.setenv(DEBUG_DERIVED_ENV, "skip")
        with pytest.raises(DrillFailed, match="differ from the fresh load"):
            drill(engine, rounds=1)
    engine.control.set(weights_loaded=True)
    engine.control.load_weights()  # repaired
    update_and_verify(engine, other, fp8_dir, before)


def perturbed(source, out):
    """A copy of checkpoint `source` with every projection (and expert) moved: another model of the same shape."""
    shutil.copytree(source, out)
    path = next(out.glob("*.safetensors"))
    generator = torch.Generator().manual_seed(11)
    save_file({name: t + 0.05 * torch.randn(t.shape, generator=generator) if name.endswith("proj.weight") else t
               for name, t in load_file(str(path)).items()}, str(path))
    return out


def update_and_verify(engine, other, own, before):
    """A direct update to block-FP8 checkpoint `other` serves what a fresh engine on it serves and holds what
    `tsdev weights verify --against other` compares with (its e4m3 weights and scales as stored); back to `own`."""
    from tsdev_runtime.engine.weights_drill import fresh_checksum

    def greedy():
        params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
        return [r["token_ids"] for r in engine.generate(PROMPTS, params)]

    def fresh(model_dir):
        return fresh_checksum(EngineConfig(model=str(model_dir), device="cpu", dtype="float32"))

    engine.control.load_weights(str(other), "direct")
    after, held = greedy(), engine.control.checksum(derived=False)
    assert after == served(other, PROMPTS)[1] and after != before
    assert held == fresh(other)
    differ = {name for name in held if held[name] != fresh(own)[name]}
    assert any(name.endswith("weight_scale_inv") for name in differ) and any(
        name.endswith(("proj.weight", ".w13", ".w2")) for name in differ)  # verify against the old one names both
    engine.control.load_weights(str(own), "direct")
    assert greedy() == before and engine.control.checksum(derived=False) == fresh(own)


def cosines_to_unquantized(model_dir, shape: str, tmp_path) -> list[float]:
    """For each prompt, the cosine of `model_dir`'s prefill logits to those of the embedded checkpoint of `shape`
    written unquantized with the same seed."""
    from tsdev_runtime.weights.default_model import SHAPES, write_checkpoint

    plain = tmp_path / "plain"
    plain.mkdir()
    write_checkpoint(plain, SHAPES[shape])
    cosine = torch.nn.functional.cosine_similarity
    pairs = zip(prefill_logits(plain, PROMPTS), prefill_logits(model_dir, PROMPTS), strict=True)
    return [float(cosine(exact, quantized, dim=0)) for exact, quantized in pairs]


def tp_rank(model_dir: str) -> list | None:
    from ranks import on_rank0_engine

    config = EngineConfig(model=model_dir, device="cpu", dtype="float32", world_size=2, cudagraph_capture_sizes=[1, 4])
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    return on_rank0_engine(config, lambda engine: [r["token_ids"] for r in engine.generate(PROMPTS, params)])


@pytest.mark.slow
def test_two_ranks_each_hold_their_blocks_and_serve_the_tokens_of_one(source_dir, tmp_path):
    from ranks import run_ranks

    fp8_dir = write_fp8_blocks(source_dir, tmp_path / "fp8")
    rank0, _ = run_ranks(tp_rank, 2, str(fp8_dir), timeout=240)
    assert rank0 == served(fp8_dir, PROMPTS)[1]


@pytest.mark.slow
def test_two_ranks_refuse_a_checkpoint_whose_split_cuts_a_block_naming_the_module_and_sizes(tiny_model_dir, tmp_path):
    """gate and up of 384 rows: 192 a rank, inside the second 128-row block of scales."""
    import transformers

    from ranks import run_ranks

    config = transformers.Qwen3Config(vocab_size=1024, hidden_size=192, intermediate_size=384, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(6)
    source = save_with_tiny_tokenizer(transformers.Qwen3ForCausalLM(config), tmp_path / "hf", tiny_model_dir)
    fp8_dir = write_fp8_blocks(source, tmp_path / "fp8", {**QUANTIZATION, "modules_to_not_convert": []})
    with pytest.raises(AssertionError, match=r"model\.layers\.0\.mlp\.gate_up_proj: a stacked projection's shards "
                                             r"\(gate: 192 rows, up: 192 rows on each of 2 ranks\) do not fill whole "
                                             r"128-row blocks of FP8 scales: serve with a --tp"):
        run_ranks(tp_rank, 2, str(fp8_dir), timeout=120)


def test_a_rank_split_that_cuts_a_block_of_scales_is_refused():
    """A row-parallel projection whose rank halves fall inside a 128-column block of scales (down_proj's 384 input
    features: 192 per rank); the loader prefixes the module's checkpoint name."""
    from tsdev_runtime.weights.layout import block_part
    from tsdev_runtime.weights.layout import RankSlice

    with pytest.raises(ValueError, match="192 of 384 starts at 192, which splits a 128-wide block"):
        block_part(RankSlice((192, 384), 1, 192, 192), 128, "down_proj's input features")
    whole = block_part(RankSlice((192, 512), 1, 256, 256), 128, "down_proj's input features")
    assert (whole.shape, whole.dim, whole.start, whole.length) == ((2, 4), 1, 2, 2)
    last = block_part(RankSlice((300, 192), 0, 256, 44), 128, "rows")  # a partial last block
    assert (last.shape, last.start, last.length) == ((3, 2), 2, 1)


def test_the_embedded_default_fp8_serves_the_default_kind_stored_as_block_fp8(tmp_path, monkeypatch):
    """`tsdev serve --model default-fp8`: written once, as the FP8 releases store their weights; its logits close to
    the same random model unquantized."""
    from tsdev_runtime.weights.default_model import DEFAULT_FP8

    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path / "cache"))
    engine = LLMEngine(EngineConfig(model=DEFAULT_FP8, device="cpu"))
    config = json.loads((engine.model_dir / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert engine.runner.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    tokens = engine.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    assert all(len(r["token_ids"]) == TOKENS for r in tokens)
    for cosine in cosines_to_unquantized(engine.model_dir, "tiny-blocks", tmp_path):
        assert cosine > 0.99, cosine


def test_a_reload_checks_the_block_fp8_kernels_at_the_widths_it_serves(source_dir, tmp_path):
    """The served block-FP8 checkpoint's shapes reach the checks of its kernels (the quantization of the activations,
    the projection), which pass under Triton's interpreter; a bf16 model's do not declare them."""
    from tsdev_kernels import checks
    from tsdev_runtime.engine.kernel_checks import serving_of

    engine = LLMEngine(EngineConfig(model=str(write_fp8_blocks(source_dir, tmp_path / "fp8")), device="cpu",
                                    cudagraph_capture_sizes=[1, 2]))
    serving, unquantized = serving_of(engine), LLMEngine(EngineConfig(model=str(source_dir), device="cpu"))
    assert serving.fp8_blocks and not serving_of(unquantized).fp8_blocks
    by_op = {c.op: c for c in checks.declared()}
    linear = by_op["fp8_block_linear"].shapes(serving)
    assert (1, 512, 192) in linear and by_op["fp8_token_groups"].shapes(serving)[0][1] == 192
    for op in ("fp8_token_groups", "fp8_block_linear"):
        assert all(checks.run(by_op[op], shape, torch.float32, "cpu").ok for shape in by_op[op].shapes(serving)[:2])
