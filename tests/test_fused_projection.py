"""The decode step at batch 1 runs each layer's norm inside the q|k|v and gate|up projections and SwiGLU's
activation inside the gate|up one (`Linear.project_normed`). On the CPU the fused GEMV runs under the Triton
interpreter when project_normed is told Triton may run: a greedy generation must then take the fused path at
every decode step, only there (not in the prefill), and generate what the separate ops do."""

import runtime.layers.linear as layers_linear
from kernels.ops import linear as linear_ops
from runtime.config import EngineConfig, ModelConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.sequence import SamplingParams


def fused_calls(monkeypatch) -> list[tuple[bool, bool]]:
    """Let project_normed fuse on the CPU; record (residual given, gated) of each fused GEMV."""
    calls, gemv = [], linear_ops.gemv_triton

    def recording(x, weight, *args, **kwargs):
        if kwargs.get("norm_weight") is not None:
            calls.append((kwargs["residual"] is not None, kwargs["gated"]))
        return gemv(x, weight, *args, **kwargs)

    monkeypatch.setattr(layers_linear, "use_triton", lambda x, family: True)
    monkeypatch.setattr(linear_ops, "gemv_triton", recording)
    return calls


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
