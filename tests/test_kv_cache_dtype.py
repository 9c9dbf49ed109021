"""--kv-cache-dtype fp8 on the CPU (the references quantize as the kernels do; tests/test_kernels_interpreter.py has
the kernels, tests/test_fp8_kv_gpu.py the H200): the pool holds the tokens of the bytes it saves, prefix caching
and chunked prefill give the tokens a fresh prefill gives, sleep and wake keep them, a bad value is refused."""
import pytest
import torch
from typer.testing import CliRunner

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev.launch.serve import kv_pool_note

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(**{**dict(model=str(model_dir), device="cpu", max_model_len=256, max_batched_tokens=64,
                                  max_running=4), **overrides})


@pytest.mark.slow
def test_an_fp8_pool_holds_the_tokens_of_the_bytes_it_saves_and_the_startup_line_says_so(tiny_model_dir, monkeypatch):
    from tsdev_runtime.engine import model_runner

    monkeypatch.setattr(model_runner, "CPU_KV_BYTES", 1 << 20)  # the pool's memory, not max_running, bounds it
    auto, fp8 = (LLMEngine(config(tiny_model_dir, kv_cache_dtype=kv, max_running=64)) for kv in ("auto", "fp8"))
    assert fp8.runner.kv_cache.dtype == torch.float8_e4m3fn and auto.runner.kv_cache.dtype == torch.float32
    assert fp8.runner.num_pages == 4 * auto.runner.num_pages  # float32 on the CPU: a quarter of the bytes per token
    info = fp8.describe()
    assert info.kv_cache_dtype == "float8_e4m3fn" and "4x the tokens float32" in kv_pool_note(info)
    assert kv_pool_note(auto.describe()) == ""


@pytest.mark.slow
def test_fp8_kv_serves_prefix_cached_and_chunked_prompts_as_a_fresh_prefill_and_survives_sleep(tiny_model_dir):
    prompt = [(7 * i + 3) % 500 for i in range(150)]  # 150 tokens: three chunks of at most 64
    cached = LLMEngine(config(tiny_model_dir, kv_cache_dtype="fp8_e4m3"))
    first = cached.generate([prompt], GREEDY)[0]["token_ids"]
    again = cached.generate([prompt], GREEDY)[0]["token_ids"]  # its full pages come from the prefix cache
    assert cached.block_manager.hits > 0 and again == first
    fresh = LLMEngine(config(tiny_model_dir, kv_cache_dtype="fp8", enable_prefix_caching=False,
                             max_batched_tokens=256))  # one prefill of all 150 tokens
    assert fresh.generate([prompt], GREEDY)[0]["token_ids"] == first
    cached.control.free_memory(1)
    cached.control.restore_memory()
    assert cached.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert cached.generate([prompt], GREEDY)[0]["token_ids"] == first


def test_a_kv_cache_dtype_serve_does_not_know_is_refused_before_loading():
    from tsdev.cli import app

    result = CliRunner().invoke(app, ["serve", "--device", "cpu", "--kv-cache-dtype", "int4"])
    assert result.exit_code == 2 and "--kv-cache-dtype" in result.output and "fp8_e4m3" in result.output
    with pytest.raises(ValueError, match="fp8_e4m3"):
        EngineConfig(model=None, kv_cache_dtype="fp16").kv_torch_dtype(torch.bfloat16)
