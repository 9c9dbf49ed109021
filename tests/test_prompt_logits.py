"""llm_engine.prompt_logits: the full-vocabulary logits after a prompt, for benchmarks comparing two models' outputs
(benchmarks/model_shapes.py) through the engine's public calls (issue 70)."""
import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine, prompt_logits
from tsdev_runtime.engine.sequence import SamplingParams


def test_prompt_logits_pick_the_greedy_token_and_give_their_pages_back(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, engine.model_config.vocab_size, (4, 37), generator=g).tolist()
    greedy = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    for prompt, out in zip(prompts, greedy, strict=True):
        logits = prompt_logits(engine, prompt)
        assert logits.dtype == torch.float32 and logits.shape == (engine.model_config.vocab_size,)
        assert int(logits.argmax()) == out["token_ids"][0]
        assert engine.stats().kv_pages_used == 0  # nothing kept
