"""The decode step at batch 1 runs each layer's norm inside the q|k|v and gate|up projections and SwiGLU's
activation inside the gate|up one (`norm_linear`, called by the model's attention and MLP). On the CPU the fused GEMV
runs under the Triton interpreter when `gemv_fuses` is told Triton may run: a greedy generation must then take the
fused path at every decode step, only there (not in the prefill), and generate what the separate ops do; it must still
after a reload of those layers, and never for an activation other than SwiGLU's."""

import pytest
import torch
from torch import nn

import tsdev_runtime.layers.linear as layers_linear
from tsdev_kernels.ops import linear as linear_ops
from tsdev_runtime.config import EngineConfig, ModelConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.layers.linear import MergedLinear, norm_linear
from tsdev_runtime.layers.norm import RMSNorm
from tsdev.hotreload import Reloader


def fused_calls(monkeypatch) -> list[tuple[bool, bool]]:
    """Let norm_linear fuse on the CPU; record (residual given, gated) of each fused GEMV. Each program takes 64
    rows (the rule gives the tiny model's projections one row a program): the interpreter runs programs one by one, and
    rows are independent, so only the number of programs changes."""
    calls, gemv = [], linear_ops.gemv_triton

    def recording(x, weight, *args, **kwargs):
        if kwargs.get("norm_weight") is not None:
            calls.append((kwargs["residual"] is not None, kwargs["gated"]))
        return gemv(x, weight, *args, **{"block_n": 64, **kwargs})

    monkeypatch.setattr(layers_linear, "use_fused_triton", lambda x, *families: True)
    monkeypatch.setattr(linear_ops, "gemv_triton", recording)
    return calls


@pytest.mark.slow
def test_fused_decode_generates_what_the_ops_one_after_another_do(tiny_model_dir, monkeypatch):
    prompt, params = list(range(5, 30)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def generate():
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_running=1))
        return engine.generate([prompt], params)[0]["token_ids"]

    plain = generate()
    calls = fused_calls(monkeypatch)
    fused = generate()
    layers = ModelConfig.from_dir(tiny_model_dir).num_hidden_layers
    # two fused projections a layer (the first layer's first norm has no residual) in each one-row forward: the
    # 11 decode steps (and the engine's warm-up)
    per_step = [(False, False), (True, True)] + [(True, False), (True, True)] * (layers - 1)
    steps = len(calls) // len(per_step)
    assert calls == per_step * steps and steps >= 11
    assert fused == plain and len(set(plain)) > 3


def test_the_fused_path_survives_a_reload_of_the_norm_and_activation_layers(tiny_model_dir, monkeypatch):
    """norm_linear fuses only for the stock RMSNorm and SiluAndMul classes (another activation must not get
    SwiGLU's epilogue); a reload updates those classes in place, so the model's modules still qualify after it."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_running=1))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tx = Reloader(["tsdev_runtime.layers", "tsdev_runtime.models"]).reload(
        modules=["tsdev_runtime.layers.norm", "tsdev_runtime.layers.activation"])
    try:
        assert tx.report.ok, tx.report.error
        assert "tsdev_runtime.layers.linear" in tx.report.dependents
        calls = fused_calls(monkeypatch)
        engine.generate([list(range(5, 30))], params)
        assert calls and len(calls) % (2 * ModelConfig.from_dir(tiny_model_dir).num_hidden_layers) == 0
    finally:
        tx.rollback()


def test_another_activation_runs_after_the_projection_not_in_it(monkeypatch):
    class Gelu(nn.Module):
        def forward(self, x):
            return nn.functional.gelu(x)

    proj, norm = MergedLinear(16, {"gate": 8, "up": 8}), RMSNorm(16, 1e-6)
    nn.init.normal_(proj.weight), nn.init.normal_(norm.weight)
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    calls = fused_calls(monkeypatch)
    y, new_residual = norm_linear(norm, proj, x, residual, act=Gelu())
    assert calls == []
    normed, want_residual = norm(x, residual)
    assert torch.equal(y, nn.functional.gelu(proj(normed))) and torch.equal(new_residual, want_residual)
    fused, _ = norm_linear(norm, proj, x, residual)  # no activation: fused
    assert calls == [(True, False)] and torch.allclose(fused, proj(normed), atol=1e-5)


def test_gemv_fuses_one_row_of_one_dtype_through_the_stock_modules_only(monkeypatch):
    """The fused path's whole choice (`gemv_fuses`): one row, a weight the GEMV reads (not block FP8), the stock
    RMSNorm and SiluAndMul, one dtype, and Triton serving every family it fuses."""
    from tsdev_runtime.layers.activation import SiluAndMul
    from tsdev_runtime.layers.linear import gemv_fuses

    proj, norm, act = MergedLinear(16, {"gate": 8, "up": 8}), RMSNorm(16, 1e-6), SiluAndMul()
    row, residual = torch.randn(1, 16), torch.randn(1, 16)
    asked = []
    monkeypatch.setattr(layers_linear, "use_fused_triton", lambda x, *families: asked.append(families) or True)
    assert gemv_fuses(norm, proj, row, residual, act) and gemv_fuses(norm, proj, row, None, None)
    assert asked == [("norm", "linear", "activation"), ("norm", "linear")]
    assert not gemv_fuses(norm, proj, torch.randn(2, 16), residual, act)  # two rows: the GEMM
    assert not gemv_fuses(norm, proj, row, residual.double(), act)  # another dtype

    class MyNorm(RMSNorm):
        pass

    assert not gemv_fuses(MyNorm(16, 1e-6), proj, row, residual, act)  # a subclass's arithmetic is its own
    proj.store_fp8_blocks((8, 8))
    assert not gemv_fuses(norm, proj, row, residual, act)  # block FP8: its own kernel
    monkeypatch.setattr(layers_linear, "use_fused_triton", lambda x, *families: False)
    assert not gemv_fuses(norm, MergedLinear(16, {"q": 8}), row, residual, None)
