"""Qwen3-MoE on a tiny checkpoint that transformers itself wrote (per-expert tensor names, a dense layer between two
sparse ones) computes what transformers computes (float32, CPU): greedy tokens alone, batched and under --tp 2 on
gloo (the experts split on their intermediate features); its stacked experts load per expert through the declared
keys, and a layer's expert tensors streamed out of file order are processed exactly once, after the last key."""
import functools

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tsdev_kernels.ops import fp8, moe
from ranks import on_rank0_engine, run_ranks
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.moe.experts import StackedExperts
from tsdev_runtime.moe.layer import SparseMoeBlock
from test_model_families import engine_config, hf_greedy, hf_model
from tolerances import FP8_ROW, assert_logits_close

PROMPTS = [[5, 17, 300, 42, 9, 77, 123, 4, 8, 15, 16, 23], [200, 201, 202],
           [(13 * j + 1) % 1000 + 3 for j in range(40)]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(hf_qwen3_moe_dir) -> list[list[int]]:
    model = hf_model(hf_qwen3_moe_dir)
    return [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.slow
def test_the_layers_are_sparse_dense_sparse_and_the_experts_stacked(hf_qwen3_moe_dir):
    engine = LLMEngine(engine_config(hf_qwen3_moe_dir))
    layers = engine.runner.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, False, True]
    experts = layers[0].mlp.experts
    assert tuple(experts.w13.shape) == (8, 64, 64) and tuple(experts.w2.shape) == (8, 64, 32)
    tensors = load_file(hf_qwen3_moe_dir / "model.safetensors")
    for e in (0, 5):
        prefix = f"model.layers.2.mlp.experts.{e}"
        w13 = layers[2].mlp.experts.w13[e]
        assert torch.equal(w13[:32], tensors[f"{prefix}.gate_proj.weight"])
        assert torch.equal(w13[32:], tensors[f"{prefix}.up_proj.weight"])
        assert torch.equal(layers[2].mlp.experts.w2[e], tensors[f"{prefix}.down_proj.weight"])


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_alone_and_batched(hf_qwen3_moe_dir, expected):
    assert len({tuple(e) for e in expected}) == len(expected)
    engine = LLMEngine(engine_config(hf_qwen3_moe_dir))
    for prompt, want in zip(PROMPTS, expected):
        assert engine.generate([prompt], GREEDY)[0]["token_ids"] == want
    assert [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)] == expected


def tp_rank(model_dir: str) -> dict | None:
    def inspect(engine):
        experts = engine.runner.model.model.layers[0].mlp.experts
        return dict(tokens=[r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)],
                    w13=tuple(experts.w13.shape), w2=tuple(experts.w2.shape))
    return on_rank0_engine(engine_config(model_dir, world_size=2, cudagraph_capture_sizes=[1, 4]), inspect)


@pytest.mark.slow
def test_two_ranks_split_the_experts_and_serve_the_greedy_tokens_of_transformers(hf_qwen3_moe_dir, expected):
    rank0, _ = run_ranks(tp_rank, 2, str(hf_qwen3_moe_dir), timeout=240)
    assert (rank0["w13"], rank0["w2"]) == ((8, 32, 64), (8, 64, 16))  # half of each expert's 32 features
    assert rank0["tokens"] == expected


# --- completion by declared keys: one stacked parameter, many loads, out of file order --------------------------


class ScaledExperts(StackedExperts):
    """Stacked experts with a derived tensor (as fp8 experts have their scales): each expert's w13 amax."""

    def __init__(self, log: list):
        super().__init__(4, 8, 6)
        self.log = log
        self.register_buffer("amax", torch.zeros(4), persistent=False)

    def process_weights_after_loading(self) -> None:
        self.amax.copy_(self.w13.abs().amax(dim=(1, 2)))
        self.log.append("processed")


class OneLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.log: list[str] = []
        self.experts = ScaledExperts(self.log)


def expert_tensor(e: int, proj: str, value: float = 0.0) -> tuple[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * e + len(proj))
    shape = (8, 6) if proj == "down" else (6, 8)
    return f"experts.{e}.{proj}_proj.weight", torch.rand(shape, generator=g) + value


def test_expert_tensors_out_of_order_and_repeated_process_the_layer_once_after_its_last_key(tmp_path):
    from safetensors.torch import save_file

    from tsdev_runtime.weights.loader import load_weights

    save_file(dict(expert_tensor(e, p) for e in range(4) for p in ("gate", "up", "down")),
              tmp_path / "model.safetensors")
    layer = OneLayer()
    weights = load_weights(layer, tmp_path)
    assert set(weights.keys["experts.w13"]) == {(e, p) for e in range(4) for p in ("gate", "up")}  # E x 2 keys
    layer.log.clear()
    # expert 0's gate three times first, then every other tensor out of file order, expert 3's up last (large)
    stream = [expert_tensor(0, "gate")] * 3 + [expert_tensor(e, p) for e in (2, 1, 0, 3) for p in ("down", "gate", "up")
                                               if (e, p) != (3, "up")] + [expert_tensor(3, "up", 100.0)]
    seen = []

    def tensors():
        for name, tensor in stream:
            seen.append(list(layer.log))
            yield name, tensor

    weights.load_tensors(tensors())
    assert all(log == [] for log in seen)  # never processed before the last key arrived
    assert layer.log == ["processed"]  # exactly once
    assert layer.experts.amax[3] > 100 and torch.equal(layer.experts.amax, layer.experts.w13.abs().amax(dim=(1, 2)))


def test_a_trigger_on_element_counts_processes_the_experts_early_and_leaves_the_derived_tensor_stale(tmp_path):
    """The negative control: the trigger vLLM's layerwise reload used (process once the elements loaded reach the
    parameter's size) fires after repeated calls for one expert, before expert 3's last tensor arrives."""
    layer = OneLayer()
    experts = layer.experts
    experts.w13.data.zero_()  # the weights before this load (an update's old ones): small
    loaded, processed = 0, False
    stream = [expert_tensor(0, "gate")] * 7 + [expert_tensor(e, p) for e in range(4) for p in ("gate", "up")
                                               if (e, p) != (3, "up")] + [expert_tensor(3, "up", 100.0)]
    for name, tensor in stream:
        _, e, proj, _ = name.split(".")
        experts.load_weight("w13", (int(e), proj.removesuffix("_proj")), tensor)
        loaded += tensor.numel()
        if not processed and loaded >= experts.w13.numel():
            experts.process_weights_after_loading()
            processed = True
    assert processed and experts.amax[3] < 100  # derived before expert 3's up arrived: stale
    assert experts.w13.abs().amax(dim=(1, 2))[3] > 100


# --- an edit of the MoE layer reloads in place ----------------------------------------------------------------


def logits_edited_and_reverted(engine, module: str, old: str, new: str, prompt: list[int],
                               feed: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced logits before, with `old` replaced by `new` in `module`'s source (reloaded in place and
    committed), and after the revert (the old source saved again, as a user's undo)."""
    import importlib
    import inspect

    from test_model_families import teacher_forced_logits
    from tsdev.hotreload import Reloader

    source = inspect.getsource(importlib.import_module(module))
    assert source.count(old) == 1
    before = teacher_forced_logits(engine, prompt, feed)
    reloader = Reloader(["tsdev_runtime.models", "tsdev_runtime.layers", "tsdev_runtime.moe", "tsdev_kernels.ops"])
    tx = reloader.reload(sources={module: source.replace(old, new).encode()})
    assert tx.report.ok, tx.report.error
    tx.commit()
    try:
        edited = teacher_forced_logits(engine, prompt, feed)
    finally:
        back = reloader.reload(sources={module: source.encode()})
        assert back.report.ok, back.report.error
        back.commit()
    return before, edited, teacher_forced_logits(engine, prompt, feed)


@pytest.mark.parametrize("module, old, new", [
    # the router forgets to renormalise its top k
    ("tsdev_runtime.moe.router", "weights = weights / weights.sum(dim=-1, keepdim=True)", "weights = weights * 1.0"),
    # the kernel module halves silu(gate) * up (its reference: what the CPU runs)
    ("tsdev_kernels.ops.moe", "h = (F.silu(gate.float()).to(dt).float() * up.float()).to(dt)",
     "h = (F.silu(gate.float()).to(dt).float() * up.float() * 0.5).to(dt)"),
])
@pytest.mark.slow
def test_an_edit_of_the_moe_code_changes_the_output_and_its_revert_restores_it_bit_for_bit(hf_qwen3_moe_dir, module,
                                                                                            old, new):
    engine = LLMEngine(engine_config(hf_qwen3_moe_dir))
    before, edited, after = logits_edited_and_reverted(engine, module, old, new, PROMPTS[0], [7, 8, 9])
    assert not torch.allclose(edited, before, atol=1e-3)
    assert torch.equal(after, before)


def test_the_embedded_moe_default_serves_without_a_checkpoint(monkeypatch, tmp_path):
    from test_cli import engine_config as serve_config

    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path))
    assert serve_config(monkeypatch, "--model", "default-moe").model == "default-moe"
    engine = LLMEngine(engine_config("default-moe", max_model_len=256))
    assert engine.model_config.architecture == "Qwen3MoeForCausalLM" and engine.model_dir.parent == tmp_path
    layers = engine.runner.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, False, True]
    tokens = engine.generate([PROMPTS[0]], GREEDY)[0]["token_ids"]
    assert len(tokens) == GREEDY.max_tokens and len(set(tokens)) > 2


# --- the weight paths on an MoE model: sleep/wake + reload_weights, a direct update, the checksum, pinned staging --


@pytest.mark.slow
def test_sleep_level_2_and_reload_weights_restore_the_moe_models_checksum_and_tokens(hf_qwen3_moe_dir, expected):
    engine = LLMEngine(engine_config(hf_qwen3_moe_dir))
    checksum = engine.control.checksum()
    assert any(name.endswith("experts.w13") for name in checksum) and any(".mlp.gate." in n for n in checksum)
    engine.control.free_memory(2)
    engine.control.restore_memory()
    assert not engine.control.weights_loaded
    engine.control.load_weights()
    assert engine.control.checksum() == checksum
    assert [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.slow
def test_a_direct_update_of_every_expert_serves_transformers_tokens_of_the_new_weights(hf_qwen3_moe_dir, expected,
                                                                                        tmp_path):
    import shutil

    from safetensors.torch import save_file

    b = shutil.copytree(hf_qwen3_moe_dir, tmp_path / "B")
    tensors = load_file(hf_qwen3_moe_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(30)
    save_file({n: t + 0.05 * torch.randn(t.shape, generator=generator) for n, t in sorted(tensors.items())},
              b / "model.safetensors", metadata={"format": "pt"})
    on_b = [hf_greedy(hf_model(b), p, GREEDY.max_tokens) for p in PROMPTS]
    assert on_b != expected
    engine = LLMEngine(engine_config(hf_qwen3_moe_dir))
    model = engine.runner.model
    addresses = {n: t.data_ptr() for n, t in model.named_parameters()}
    original = engine.control.checksum()
    assert engine.control.load_weights(b, "direct").mode == "direct"
    assert {n: t.data_ptr() for n, t in model.named_parameters()} == addresses
    assert engine.control.checksum() == LLMEngine(engine_config(b)).control.checksum() != original
    assert [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)] == on_b
    engine.control.load_weights(hf_qwen3_moe_dir, "direct")
    assert engine.control.checksum() == original


def test_pinned_staging_loads_the_experts_bit_identical_to_plain(hf_qwen3_moe_dir, monkeypatch):
    from tsdev_runtime.config import ModelConfig
    from tsdev_runtime.models import MODELS, build_model
    from tsdev_runtime.weights import pinned
    from tsdev_runtime.weights.loader import load_weights

    monkeypatch.setattr(pinned, "check_pinnable", lambda device: None)  # the staged path on the CPU, unpinned
    monkeypatch.setattr(pinned, "host_register", lambda ptr, n: (lambda: None))
    config = ModelConfig.from_dir(hf_qwen3_moe_dir, MODELS)
    plain, staged = (build_model(config, "cpu", torch.float32) for _ in range(2))
    load_weights(plain, hf_qwen3_moe_dir, "plain")
    report = load_weights(staged, hf_qwen3_moe_dir, "pinned", memory_limit=64 << 10).report  # small slots: splits
    assert report.format == "pinned"
    for (name, a), (_, b) in zip(plain.named_parameters(), staged.named_parameters()):
        assert torch.equal(a, b), name


# --- FP8 experts: weight-only e4m3, one kernel configuration refreshed in place ------------------------------------


def hf_fp8_moe_model(model_dir):
    """transformers' Qwen3-MoE with `--quantization fp8`'s numerics: every projection through fp8_linear (as
    test_model_families' oracle: the attention's and the dense layer's), the router untouched, and the experts
    holding their dequantized e4m3 values; past the GEMV path's tokens (W8A8) each expert GEMM's input rows
    quantized per row too (x per token, the activation per slot), written out as transformers' expert loop."""
    from test_model_families import hf_fp8_model

    model = hf_fp8_model(model_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp.experts." in name:  # gate_up_proj [E, 2I, H], down_proj [E, H, I]: a scale per expert and row
                param.copy_(fp8.dequantize_fp8_rows(*fp8.quantize_fp8_rows(param)))
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts"):
            module.forward = functools.partial(w8a8_experts, module)
    return model


def w8a8_experts(experts, hidden_states, top_k_index, top_k_weights):
    quantized = lambda t: fp8.dequantize_fp8_rows(*fp8.quantize_fp8_rows(t))  # noqa: E731
    w8a8 = hidden_states.shape[0] > moe.GEMV_MAX_TOKENS
    rows = quantized(hidden_states) if w8a8 else hidden_states
    out = torch.zeros_like(hidden_states)
    for e in top_k_index.unique().tolist():
        token, k = torch.where(top_k_index == e)
        gate, up = F.linear(rows[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
        h = experts.act_fn(gate) * up
        y = F.linear(quantized(h) if w8a8 else h, experts.down_proj[e]) * top_k_weights[token, k, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


@pytest.mark.slow
def test_fp8_experts_are_transformers_with_dequantized_experts_and_fp8_projections(hf_qwen3_moe_dir, expected):
    """Fed the same tokens, the logits of each step (the prefill, then one-row decodes) are those of the oracle
    above, and so are the greedy tokens; unquantized they would differ."""
    from test_model_families import teacher_forced_logits

    oracle = hf_fp8_moe_model(hf_qwen3_moe_dir)
    engine = LLMEngine(engine_config(hf_qwen3_moe_dir, quantization="fp8", enforce_eager=True))
    experts = engine.runner.model.model.layers[0].mlp.experts
    assert experts.fp8 is not None and experts.fp8.w13.dtype == fp8.FP8_DTYPE
    assert engine.runner.model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router is never quantized
    theirs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)
        theirs.append(out.sequences[0, len(prompt):].tolist())
        assert_logits_close(teacher_forced_logits(engine, prompt, theirs[-1][:-1]), torch.cat(out.logits), FP8_ROW)
    assert theirs != expected  # quantizing changed something
    # one prompt at a time: the dense projections' fp8 numerics follow the step's row count
    # (kernels/tsdev_kernels/ops/fp8.py)
    assert [engine.generate([prompt], GREEDY)[0]["token_ids"] for prompt in PROMPTS] == theirs


@pytest.mark.slow
def test_a_weight_update_refreshes_the_fp8_kernel_configuration_in_place(hf_qwen3_moe_dir, tmp_path):
    """The object the kernels read and its tensors stay the same (CUDA graphs captured their addresses); their
    values become the new weights' quantization; the checksum sees them."""
    import shutil

    from safetensors.torch import save_file

    b = shutil.copytree(hf_qwen3_moe_dir, tmp_path / "B")
    tensors = load_file(hf_qwen3_moe_dir / "model.safetensors")
    save_file({n: t * 1.5 if ".experts." in n else t for n, t in tensors.items()}, b / "model.safetensors",
              metadata={"format": "pt"})
    engine = LLMEngine(engine_config(hf_qwen3_moe_dir, quantization="fp8"))
    experts = engine.runner.model.model.layers[2].mlp.experts
    config, addresses = experts.fp8, [t.data_ptr() for t in vars(experts.fp8).values()]
    checksum = engine.control.checksum()
    assert "model.layers.2.mlp.experts.fp8_w13_scale" in checksum
    engine.control.load_weights(b, "direct")
    assert experts.fp8 is config and [t.data_ptr() for t in vars(config).values()] == addresses
    for weight, values, scales in ((experts.w13, config.w13, config.w13_scale),
                                   (experts.w2, config.w2, config.w2_scale)):
        q, s = fp8.quantize_fp8_rows(weight)
        assert torch.equal(values.float(), q.float()) and torch.equal(scales, s.squeeze(-1))
    changed = {n for n in checksum if engine.control.checksum()[n] != checksum[n]}
    assert {"model.layers.2.mlp.experts.fp8_w13_scale", "model.layers.2.mlp.experts.w13"} <= changed


@pytest.mark.slow
def test_the_drill_holds_on_fp8_experts_and_fails_when_their_configuration_is_rebuilt(hf_qwen3_moe_dir, monkeypatch):
    """sleep(2) -> wake -> reload_weights leaves every tensor as the fresh load had it, the FP8 experts' derived ones
    included; the negative control derives into a new kernel-configuration object at each reload (as the fused-MoE
    kernel object once was rebuilt), leaving the tensors the layer registered -- and graphs captured -- stale."""
    from tsdev_runtime.engine.weights_drill import DrillFailed, drill
    from tsdev_runtime.weights.processing import DEBUG_DERIVED_ENV

    assert drill(LLMEngine(engine_config(hf_qwen3_moe_dir, quantization="fp8")), rounds=2).rounds == 2
    monkeypatch.setenv(DEBUG_DERIVED_ENV, "rebuild")
    with pytest.raises(DrillFailed, match="fp8_w13"):
        drill(LLMEngine(engine_config(hf_qwen3_moe_dir, quantization="fp8")), rounds=1)
