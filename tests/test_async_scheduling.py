"""Async scheduling (step N+1 launched before step N is read) must not change what any request sees."""
import pytest
from tsdev_runtime.engine.sequence import PENDING, SamplingParams

from consumer import Consumer

PROMPTS = [[(7 * i + j) % 900 + 1 for j in range(5 + 9 * i)] for i in range(6)]


def outputs_per_request(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    consumer = Consumer(engine)
    for rid, (prompt, params) in requests.items():
        consumer.add(rid, prompt, params)
    seen: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in consumer.step():
            seen[out.request_id].append((out.new_token_ids, out.new_text, out.finished, out.finish_reason,
                                         out.num_output_tokens))
    assert engine.block_manager.num_used_pages == 0 and engine.in_flight is None
    return seen


def workload(make_engine) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy and seeded requests of several lengths, one of length 1, and two that end on a stop string
    taken from the middle of their own greedy text (a stop the scheduler cannot see coming)."""
    probe = make_engine(async_scheduling=False)
    texts = [r["text"]
             for r in probe.generate(PROMPTS[:2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))]
    assert all(len(t) >= 6 for t in texts), texts
    requests = {f"greedy{i}": (p, SamplingParams(max_tokens=3 + 4 * i, temperature=0, ignore_eos=True))
                for i, p in enumerate(PROMPTS)}
    requests["one"] = (PROMPTS[2], SamplingParams(max_tokens=1, temperature=0))
    requests["seeded"] = (PROMPTS[3], SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=7, ignore_eos=True))
    for i, text in enumerate(texts):
        middle = len(text) // 2
        requests[f"stop{i}"] = (PROMPTS[i], SamplingParams(max_tokens=20, temperature=0,
                                                           stop=[text[middle : middle + 2]], ignore_eos=True))
    return requests


@pytest.mark.slow
def test_async_scheduling_gives_every_request_the_same_outputs(make_engine):
    requests = workload(make_engine)
    sync = outputs_per_request(make_engine(async_scheduling=False), requests)
    overlapped = outputs_per_request(make_engine(), requests)
    assert overlapped == sync
    assert all(steps[-1][3] == "stop" for rid, steps in sync.items() if rid.startswith("stop"))


@pytest.mark.slow
def test_async_scheduling_under_preemption_and_chunked_prefill(make_engine):
    requests = workload(make_engine)
    sync = outputs_per_request(make_engine(async_scheduling=False, kv_pages=24, max_batched_tokens=16,
                                           max_model_len=80), requests)
    engine = make_engine(kv_pages=24, max_batched_tokens=16, max_model_len=80)
    assert outputs_per_request(engine, requests) == sync
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_abort_while_a_step_is_in_flight(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    consumer = Consumer(engine)
    consumer.add("a", PROMPTS[3], params)
    consumer.add("b", PROMPTS[4], params)
    for _ in range(4):
        consumer.step()
    seq = engine.scheduler.find("a")
    assert seq.token_ids[-1] == PENDING  # its next token is being sampled
    out = consumer.abort("a")
    assert out.finished and out.finish_reason == "abort" and PENDING not in seq.token_ids
    assert out.num_output_tokens == len(seq) - seq.num_prompt_tokens
    later = []
    while engine.has_unfinished():
        later += consumer.step()
    assert {o.request_id for o in later} == {"b"} and later[-1].num_output_tokens == 30
    assert engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_would_outgrow_the_context_ends_with_length_when_it_is_full(make_engine, async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling, max_model_len=24)
    prompt = PROMPTS[1]  # 14 tokens
    short, long = engine.generate([prompt, prompt], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                                     SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)])
    assert (len(short["token_ids"]), short["finish_reason"]) == (4, "length")  # max_tokens first
    assert (len(long["token_ids"]), long["finish_reason"]) == (24 - len(prompt), "length")  # the context first
    assert engine.block_manager.num_used_pages == 0
