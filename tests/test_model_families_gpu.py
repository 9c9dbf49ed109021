"""Each served family (Llama with llama3 rope scaling, Qwen2 with biases and one key/value head, Qwen3) on its tiny
checkpoint written by transformers (tests/conftest.py: hf_llama_dir, hf_qwen2_dir, hf_written_dir): greedy tokens of
the engine on CUDA in float32, with its CUDA graphs (the default), equal transformers' float32 greedy tokens on the
GPU, alone and batched, across position 64 (the llama3 scaling's original length). Run on the H200: `pytest -m gpu`.
The CPU counterpart: tests/test_model_families.py."""
import pytest
import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams

from test_model_families import FAMILIES, PROMPTS  # the CPU test's checkpoints and prompts (two cross position 64)

pytestmark = pytest.mark.gpu
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def transformers_greedy(model_dir) -> list[list[int]]:
    """transformers' float32 greedy tokens for PROMPTS on the GPU (the attention mask explicit: generate would
    otherwise mask prompt tokens equal to pad_token_id)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    model.generation_config.eos_token_id = None  # full lengths: the engine runs with ignore_eos
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    del model
    torch.cuda.empty_cache()
    return expected


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_on_cuda_float32_with_graphs_equals_transformers(family, request):
    model_dir = request.getfixturevalue(FAMILIES[family])
    expected = transformers_greedy(model_dir)
    assert all(len(e) == MAX_TOKENS for e in expected)
    assert len({tuple(e) for e in expected}) == len(expected)  # varied output: equality says something
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", kv_pages=256))
    assert engine.runner.dtype == torch.float32
    assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.graphs  # captured: the default
    for prompt, want in zip(PROMPTS, expected):
        assert engine.generate([prompt], GREEDY)[0]["token_ids"] == want, prompt
    assert [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)] == expected  # batched: graphs of 2 and 4
