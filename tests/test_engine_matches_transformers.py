"""The runtime's numbers equal Hugging Face transformers' Qwen3 on the same checkpoint (float32, CPU)."""
import pytest
import torch

from tsdev_runtime.engine.scheduler import ScheduledBatch
from tsdev_runtime.engine.sequence import SamplingParams, Sequence
from tolerances import assert_logits_close

import transformers

PROMPTS = [[5, 17, 300, 42, 9, 77, 123, 4, 8, 15, 16, 23, 42, 99, 512, 7, 3], [200, 201, 202], list(range(100, 141))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    model = transformers.Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare full lengths: the engine runs with ignore_eos
    return model


def hf_greedy(hf_model, prompt, n):
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_prefill_and_decode_logits_match(make_engine, hf_model):
    engine = make_engine()
    prompt = PROMPTS[0]
    seq = Sequence("a", prompt, GREEDY)
    engine.block_manager.allocate(seq, len(prompt))
    ours = [engine.runner.compute_logits(ScheduledBatch([seq], [len(prompt)]))[0]]
    seq.num_computed_tokens = len(prompt)
    tokens = list(prompt)
    for _ in range(4):
        tokens.append(int(ours[-1].argmax()))
        seq.token_ids.append(tokens[-1])
        engine.block_manager.allocate(seq, 1)
        ours.append(engine.runner.compute_logits(ScheduledBatch([seq], [1]))[0].clone())
        seq.num_computed_tokens += 1
    with torch.no_grad():
        theirs = hf_model(torch.tensor([tokens])).logits[0, len(prompt) - 1 :]
    assert_logits_close(torch.stack(ours), theirs)


def test_greedy_generation_matches_alone_and_batched(make_engine, hf_model):
    expected = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in PROMPTS]
    assert len({tuple(e) for e in expected}) == len(expected)
    engine = make_engine()
    for prompt, want in zip(PROMPTS, expected):
        assert engine.generate([prompt], GREEDY)[0]["token_ids"] == want
    mixed = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 5, 12)]
    batched = engine.generate(PROMPTS, mixed)
    assert [b["token_ids"] for b in batched] == [expected[0], expected[1][:5], expected[2]]


def test_greedy_matches_with_prefix_cache_hit(make_engine, hf_model):
    engine = make_engine()
    shared = PROMPTS[2]
    first = shared + [7, 8, 9]
    second = shared + [10, 11]
    engine.generate([first], GREEDY)
    hits_before = engine.block_manager.hits
    out = engine.generate([second], GREEDY)[0]["token_ids"]
    assert engine.block_manager.hits - hits_before >= len(shared) // 4 - 1
    assert out == hf_greedy(hf_model, second, GREEDY.max_tokens)


def test_greedy_matches_across_chunked_prefill(make_engine, hf_model):
    engine = make_engine(max_batched_tokens=7)
    prompt = PROMPTS[2]
    chunks = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        chunks.append(batch.total_tokens)
        return batch

    engine.scheduler.schedule = recording_schedule
    out = engine.generate([prompt], GREEDY)[0]["token_ids"]
    assert chunks[:6] == [7, 7, 7, 7, 7, 6]  # 41 prompt tokens in chunks of at most 7
    assert out == hf_greedy(hf_model, prompt, GREEDY.max_tokens)
