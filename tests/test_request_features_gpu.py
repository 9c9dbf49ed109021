"""The request features on CUDA (Triton penalties kernel, device-side counts, logprobs) give the CPU's tokens and
logprobs (torch references) on the tiny model in float32, and run on the real shape (run on the H200: `pytest -m
gpu`)."""
import pytest
import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams

from consumer import Consumer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [[5, 17, 300, 42, 9, 77, 123, 4, 8, 15, 16, 23, 42, 99, 512, 7, 3], [200, 201, 202], list(range(100, 141))]


def run(engine: LLMEngine, prompts, params) -> dict[str, tuple[list[int], list[float], list]]:
    """request id -> (tokens, their logprobs, prompt logprobs), by stepping the engine."""
    consumer = Consumer(engine)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        consumer.add(str(i), prompt, p)
    got = {str(i): ([], [], []) for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in consumer.step():
            tokens, logprobs, prompt_logprobs = got[out.request_id]
            tokens += out.new_token_ids
            logprobs += [e.logprob for e in out.logprobs or []]
            prompt_logprobs += [e.logprob for e in out.prompt_logprobs or []]
    return got


def features(seed: int | None) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=20, temperature=0 if seed is None else 0.9, seed=seed, ignore_eos=True,
                           repetition_penalty=1.6, frequency_penalty=0.4, presence_penalty=0.3,
                           logit_bias={300: 3.0, 7: -5.0}, logprobs=3),
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=2),
            SamplingParams(max_tokens=20, temperature=0 if seed is None else 0.7, seed=seed, min_tokens=5,
                           logit_bias={0: 50.0}, frequency_penalty=-0.5)]


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "sampled"])
def test_cuda_float32_gives_the_cpu_tokens_and_logprobs_with_every_feature(tiny_model_dir, seed):
    cpu = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", kv_pages=256))
    cuda = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32", kv_pages=256))
    want, got = run(cpu, PROMPTS, features(seed)), run(cuda, PROMPTS, features(seed))
    for key in want:
        assert got[key][0] == want[key][0], key
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(want[key][1]), rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor(got[key][2]), torch.tensor(want[key][2]), rtol=0, atol=1e-4)
    assert len(want["2"][0]) == 6 and want["2"][0][-1] == 0  # min_tokens held EOS (biased +50) back 5 tokens
    assert sorted(cuda.free_slots) == list(range(cuda.config.max_running))


def test_the_real_shape_serves_penalties_logprobs_and_n_in_one_batch():
    engine = LLMEngine(EngineConfig(model=None, device="cuda", max_running=16, max_model_len=2048))
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    steered = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5, repetition_penalty=1.5,
                             logit_bias={11: 2.0})
    out = run(engine, [PROMPTS[0], PROMPTS[0], PROMPTS[2]], [plain, steered, steered])
    assert out["0"][0] != out["1"][0]  # the penalties changed the greedy continuation
    assert all(len(tokens) == 24 and len(lps) == 24 and all(lp <= 0 for lp in lps) for tokens, lps, _ in out.values())
    assert sorted(engine.free_slots) == list(range(16))
