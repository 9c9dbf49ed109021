"""The embedded default model on CUDA (Qwen3-0.6B shape) answers with text (run on the H200: `pytest -m gpu`)."""
import pytest

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.weights import default_model

pytestmark = pytest.mark.gpu
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time",
           "<|im_start|>user\nWhat is a kernel?<|im_end|>\n<|im_start|>assistant\n"]


def test_default_model_on_cuda_completes_prompts_with_text():
    engine = LLMEngine(EngineConfig(model=None, device="cuda", max_running=8, max_model_len=2048))
    vocab_size = engine.model_config.vocab_size
    assert vocab_size == default_model.SHAPES["qwen3-0.6b"]["vocab_size"] == engine.tokenizer.get_vocab_size()
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    sampled = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=0, ignore_eos=True))
    for prompt, g, s in zip(PROMPTS, greedy, sampled):
        assert g["text"].strip() and s["text"].strip(), (prompt, g, s)
    empty = [i for i, t in enumerate(engine.tokenizer.decode_batch([[i] for i in range(vocab_size)])) if not t]
    assert set(empty) == engine.eos  # only the special tokens, which end a request
