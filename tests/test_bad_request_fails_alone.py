"""One request cannot end the others: values the sampler would index with are refused at the edge (a 400 naming the
field and its range), and a step that still fails is run again one request at a time, so that only the request it
fails on is aborted (LLMEngine.recover)."""
import json
import threading

import pytest
from fastapi.testclient import TestClient

from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.server.app import build_app
from tsdev.client import iter_sse_data

from consumer import Consumer

VOCAB = 1024  # the tiny model's
POISON = 666  # the seed of the request the injected failure picks

STREAMS = [{"prompt": f"Stream number {i} says", "max_tokens": 40, "temperature": 0.8, "seed": i, "ignore_eos": True,
            "return_token_ids": True, **({"frequency_penalty": 0.5, "logit_bias": {"17": 3.0}} if i % 2 else {})}
           for i in range(8)]

BAD_SAMPLING = [  # (field, value): each out of its range
    ("logit_bias", {str(VOCAB): 1}), ("logit_bias", {"5000": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"99999999": 1}), ("logit_bias", {str(2**70): 1}), ("logit_bias", {"5": 101}),
    ("stop_token_ids", [99999999]), ("stop_token_ids", [-5]), ("stop_token_ids", [VOCAB]),
    ("seed", 2**64), ("seed", -2**63 - 1), ("top_k", 2**31), ("top_k", -2), ("top_p", 0), ("top_p", 1.5),
    ("temperature", -1), ("temperature", 3), ("presence_penalty", 3), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0), ("repetition_penalty", 2.5), ("min_tokens", 50), ("min_tokens", -1),
    ("max_tokens", -1), ("max_tokens", 10**9), ("n", 0), ("n", 17), ("logprobs", 21), ("logprobs", -1),
]


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=256, kv_pages=512,
                                    page_size=4))
    with TestClient(build_app(engine, "tiny")) as c:
        yield c


def streamed_token_ids(client, body: dict) -> list[int]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = list(iter_sse_data(r))
    assert all("error" not in e for e in events), events
    return [t for e in events for c in e["choices"] for t in c["token_ids"]]


def bad_requests() -> list[tuple[str, dict, str]]:
    """(route, body, the field its error must name)."""
    base = {"prompt": "hi", "max_tokens": 4}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out = [("/v1/completions", {**base, field: value}, field) for field, value in BAD_SAMPLING]
    out += [("/v1/chat/completions", {**chat, field: value}, field) for field, value in BAD_SAMPLING
            if field != "logprobs"]
    out += [("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ("/v1/completions", {**base, "prompt": [5, VOCAB]}, "prompt"),
            ("/v1/completions", {**base, "prompt": [-3]}, "prompt"),
            ("/v1/completions", {**base, "prompt": [[5], [2**40]]}, "prompt")]
    return out + [(path, {**body, "stream": True}, field) for path, body, field in out]


@pytest.mark.slow
def test_a_burst_of_out_of_range_values_is_refused_and_the_streams_in_flight_keep_their_tokens(client):
    alone = [streamed_token_ids(client, body) for body in STREAMS]
    assert all(len(tokens) == 40 for tokens in alone)
    together: list[list[int] | None] = [None] * len(STREAMS)

    def run(i):
        together[i] = streamed_token_ids(client, STREAMS[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(STREAMS))]
    for t in threads:
        t.start()
    answers = []
    for path, body, field in bad_requests():
        r = client.post(path, json=body)
        answers.append((r.status_code, body, field, r.read().decode()))
    for t in threads:
        t.join(timeout=120)
    assert not [answer for answer in answers if answer[0] != 400], [a for a in answers if a[0] != 400][:3]
    for status, body, field, text in answers:
        error = json.loads(text)["error"]
        assert field == error["param"] or field in error["message"], (body, error)
    assert together == alone


def test_a_logit_bias_outside_the_vocabulary_names_the_field_and_the_range(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": {"5000": 1}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "logit_bias" and f"0..{VOCAB - 1}" in error["message"] and "5000" in error["message"]


def outputs(engine, requests: dict, poison_after: int | None = None) -> tuple[dict, dict]:
    """Run `requests` to the end ({id: (prompt, params)}); the poisoned one joins after `poison_after` steps. A step
    that raises is recovered the way the server does. Returns {id: token ids} and {id: error} of the aborted."""
    tokens = {rid: [] for rid in requests}
    failed, steps = {}, 0
    pending = dict(requests)
    consumer = Consumer(engine)
    for rid in [r for r in requests if requests[r][1].seed != POISON]:
        consumer.add(rid, *pending.pop(rid))
    while engine.has_unfinished() or pending:
        if pending and steps == poison_after:
            for rid, request in pending.items():
                consumer.add(rid, *request)
            pending = {}
        steps += 1
        try:
            step_outputs = consumer.step()
        except RuntimeError:
            step_outputs, aborted = consumer.recover()
            failed.update(aborted)
        for out in step_outputs:
            if out.request_id not in failed:
                tokens[out.request_id] += out.new_token_ids
    assert engine.block_manager.num_used_pages == 0 and engine.in_flight is None
    return tokens, failed


@pytest.mark.slow
def test_a_step_that_fails_on_one_request_aborts_that_one_and_the_others_draw_the_same_tokens(make_engine):
    prompts = [[(11 * i + j) % 900 + 1 for j in range(6 + 7 * i)] for i in range(6)]
    requests = {
        "greedy": (prompts[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
        "seeded": (prompts[1], SamplingParams(max_tokens=24, temperature=0.9, top_k=40, seed=3, ignore_eos=True)),
        "penalised": (prompts[2], SamplingParams(max_tokens=24, temperature=0.7, seed=4, frequency_penalty=1.5,
                                                 presence_penalty=0.5, repetition_penalty=1.3, logit_bias={9: 4.0},
                                                 ignore_eos=True)),
        "logprobs": (prompts[3], SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True)),
        "short": (prompts[4], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)),
    }
    expected, none_failed = outputs(make_engine(), requests)
    assert not none_failed and all(len(t) == requests[r][1].max_tokens for r, t in expected.items())

    engine = make_engine()
    sample = engine.runner.sample

    def sample_unless_poisoned(logits, seqs):
        if any(s.params.seed == POISON for s in seqs):
            raise RuntimeError("injected: this request's values break the step")
        return sample(logits, seqs)

    engine.runner.sample = sample_unless_poisoned
    poisoned = {**requests, "poisoned": (prompts[5], SamplingParams(max_tokens=10, temperature=0.5, seed=POISON))}
    got, failed = outputs(engine, poisoned, poison_after=5)
    assert set(failed) == {"poisoned"} and "injected: this request's values break the step" in failed["poisoned"]
    assert {r: t for r, t in got.items() if r != "poisoned"} == expected
    assert engine.num_finished["abort"] == 1
