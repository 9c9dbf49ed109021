"""What OpenAI and vLLM clients send beyond a plain completion: logprobs, echo, n, penalties, logit_bias, min_tokens,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, /tokenize and /detokenize; and the fields the
server refuses rather than ignore. The oracle is transformers on a checkpoint it wrote itself (float32, CPU):
its log-softmax for logprobs, its own logits processors (repetition penalty, sequence bias) or a plain torch
reference over its logits for the rest, step by step."""
import re

import pytest
import torch
import transformers
from fastapi.testclient import TestClient
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.server.app import build_app

from consumer import Consumer

PROMPT = [5, 17, 300, 42, 9, 77, 123, 4, 8, 15, 16, 23, 42, 99, 512, 7, 3, 42, 300]


@pytest.fixture(scope="module")
def hf_model(hf_written_dir):
    return transformers.Qwen3ForCausalLM.from_pretrained(hf_written_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(hf_written_dir):
    return LLMEngine(EngineConfig(model=str(hf_written_dir), device="cpu", max_model_len=256, kv_pages=256,
                                  page_size=4, max_running=16))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, "tiny")) as c:
        yield c


def hf_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at every position of `tokens` [len, V]."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def completion(client, **body) -> dict:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_logprobs_are_transformers_log_softmax_with_the_top_tokens_in_order(client, engine, hf_model):
    body = completion(client, max_tokens=6, temperature=0.9, seed=11, logprobs=5, ignore_eos=True)
    choice = body["choices"][0]
    ids, lp = choice["token_ids"], choice["logprobs"]
    expected = hf_logprobs(hf_model, PROMPT + ids)[len(PROMPT) - 1 : -1]
    got = torch.tensor(lp["token_logprobs"])
    torch.testing.assert_close(got, expected.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1), rtol=0, atol=1e-4)
    strings = engine.tokenizer.decode_batch([[t] for t in range(expected.shape[1])], skip_special_tokens=False)
    for position, top in enumerate(lp["top_logprobs"]):
        values, best = expected[position].topk(5)
        want = {strings[t]: v for t, v in zip(best.tolist(), values.tolist())}
        want[strings[ids[position]]] = expected[position, ids[position]].item()  # the drawn token is always there
        assert list(top) == list(want), (position, top, want)  # the same tokens, best first, then the drawn one
        assert all(abs(top[k] - want[k]) < 1e-4 for k in want), (position, top, want)
    assert lp["tokens"] == [strings[t] for t in ids]
    assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i]) for i in range(len(ids))]


def test_the_greedy_token_is_the_most_likely_one(client):
    lp = completion(client, max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)["choices"][0]["logprobs"]
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert chosen == max(top.values())


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, hf_model):
    body = completion(client, max_tokens=0, echo=True, logprobs=2)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["token_ids"] == [] and body["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(PROMPT) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = hf_logprobs(hf_model, PROMPT)[:-1].gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), expected, rtol=0, atol=1e-4)
    echoed = completion(client, max_tokens=3, echo=True, logprobs=0, temperature=0, ignore_eos=True)["choices"][0]
    assert len(echoed["logprobs"]["tokens"]) == len(PROMPT) + 3
    torch.testing.assert_close(torch.tensor(echoed["logprobs"]["token_logprobs"][1 : len(PROMPT)]), expected,
                               rtol=0, atol=1e-4)


def test_prompt_logprobs_survive_chunked_prefill_and_a_warm_prefix_cache(hf_written_dir, hf_model):
    engine = LLMEngine(EngineConfig(model=str(hf_written_dir), device="cpu", max_model_len=256, kv_pages=256,
                                    page_size=4, max_batched_tokens=7))  # the prompt takes three steps
    engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0))  # its pages are cached now
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    consumer = Consumer(engine)
    consumer.add("p", PROMPT, params)
    outputs = []
    while engine.has_unfinished():
        outputs += consumer.step()
    first, = [o for o in outputs if o.prompt_logprobs is not None]
    expected = hf_logprobs(hf_model, PROMPT)[:-1]
    assert [e.token_id for e in first.prompt_logprobs] == PROMPT[1:]
    torch.testing.assert_close(torch.tensor([e.logprob for e in first.prompt_logprobs]),
                               expected.gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1), rtol=0, atol=1e-4)
    assert [e.top_ids[0] for e in first.prompt_logprobs] == expected.argmax(-1).tolist()
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 0


def test_n_choices_are_distinct_and_a_seed_makes_them_reproducible(client, engine):
    hits_before = engine.block_manager.hits
    body = completion(client, prompt=list(range(100, 141)), max_tokens=8, n=4, seed=7, ignore_eos=True)
    again = completion(client, prompt=list(range(100, 141)), max_tokens=8, n=4, seed=7, ignore_eos=True)
    texts = [c["token_ids"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert len({tuple(t) for t in texts}) == 4 and texts == [c["token_ids"] for c in again["choices"]]
    assert body["usage"]["prompt_tokens"] == 41 and body["usage"]["completion_tokens"] == 32
    # choices 1..3 found the prompt's 10 full pages in the prefix cache (in both requests)
    assert engine.block_manager.hits - hits_before >= 2 * 3 * 10


def test_n_choices_of_several_prompts_are_numbered_prompt_by_prompt(client):
    body = completion(client, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, n=2, ignore_eos=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 8


class GeneratedPenalties(transformers.LogitsProcessor):
    """vLLM's presence and frequency penalties, over the generated tokens only (a plain torch reference)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        for row, ids in enumerate(input_ids[:, self.prompt_length :]):
            counts[row] = torch.bincount(ids, minlength=scores.shape[1]).float()
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def hf_greedy(hf_model, prompt, n: int, processors=(), **kwargs) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=0, logits_processor=transformers.LogitsProcessorList(processors), **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("params, hf", [
    (dict(repetition_penalty=1.8), lambda: dict(repetition_penalty=1.8)),
    (dict(repetition_penalty=0.5), lambda: dict(repetition_penalty=0.5)),
    (dict(presence_penalty=1.5), lambda: dict(processors=[GeneratedPenalties(len(PROMPT), 1.5, 0)])),
    (dict(frequency_penalty=0.7), lambda: dict(processors=[GeneratedPenalties(len(PROMPT), 0, 0.7)])),
    (dict(frequency_penalty=-0.9, presence_penalty=-0.4),
     lambda: dict(processors=[GeneratedPenalties(len(PROMPT), -0.4, -0.9)])),
    (dict(logit_bias={"300": 4.0, "42": 2.5, "7": -100}),
     lambda: dict(sequence_bias={(300,): 4.0, (42,): 2.5, (7,): -100.0})),
    (dict(logit_bias={"17": 3.0}, repetition_penalty=1.4, frequency_penalty=0.3),
     lambda: dict(sequence_bias={(17,): 3.0}, repetition_penalty=1.4,
                  processors=[GeneratedPenalties(len(PROMPT), 0, 0.3)])),
], ids=["repetition", "repetition-below-1", "presence", "frequency", "negative", "logit_bias", "all"])
def test_penalties_and_logit_bias_steer_greedy_decoding_as_the_reference_over_transformers(
        client, hf_model, params, hf):
    n = 24
    plain = completion(client, max_tokens=n, temperature=0, ignore_eos=True)["choices"][0]["token_ids"]
    steered = completion(client, max_tokens=n, temperature=0, ignore_eos=True, **params)["choices"][0]["token_ids"]
    assert steered == hf_greedy(hf_model, PROMPT, n, **hf())
    assert steered != plain  # the parameters changed something (else this compared nothing)


def test_penalised_requests_batched_with_plain_ones_keep_their_own_tokens(engine):
    """The penalties touch only their own rows, and each request keeps its own history (slots are per request)."""
    prompts = [PROMPT, PROMPT[:9], PROMPT[3:]]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.8),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=0.8,
                             logit_bias={300: 3.0})]
    alone = [engine.generate([p], sp)[0]["token_ids"] for p, sp in zip(prompts, params)]
    together = [r["token_ids"] for r in engine.generate(prompts, params)]
    assert together == alone
    assert sorted(engine.free_slots) == list(range(engine.config.max_running))  # every slot came back


def test_min_tokens_holds_back_eos_until_it_is_reached(client):
    eos_first = dict(max_tokens=8, temperature=0, logit_bias={"0": 100})  # EOS (id 0) wins every draw
    assert completion(client, **eos_first)["choices"][0]["token_ids"] == [0]
    held = completion(client, min_tokens=3, **eos_first)["choices"][0]
    assert len(held["token_ids"]) == 4 and held["token_ids"][-1] == 0 and 0 not in held["token_ids"][:3]
    assert held["finish_reason"] == "stop"


def test_stop_token_ids_end_the_completion_at_their_first_draw(client):
    ids = completion(client, max_tokens=10, temperature=0, ignore_eos=True)["choices"][0]["token_ids"]
    stop = ids[3]
    stopped = completion(client, max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop])["choices"][0]
    assert stopped["token_ids"] == ids[: ids.index(stop) + 1] and stopped["finish_reason"] == "stop"
    kept = completion(client, max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
    assert len(kept["choices"][0]["token_ids"]) > ids.index(stop) + 1  # min_tokens keeps stop ids out too


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    text = completion(client, max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]["text"]
    stop = text[5:8]
    cut = completion(client, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])["choices"][0]
    kept = completion(client, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                      include_stop_str_in_output=True)["choices"][0]
    assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop"
    assert kept["text"] == text[: text.index(stop) + len(stop)]


def test_skip_special_tokens_false_shows_the_special_tokens(client):
    forced = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={"2": 100})  # <|im_end|>, a special
    assert completion(client, **forced)["choices"][0]["text"] == ""
    assert completion(client, skip_special_tokens=False, **forced)["choices"][0]["text"] == "<|im_end|>" * 3


def test_chat_logprobs_and_n(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  "logprobs": True, "top_logprobs": 3, "n": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        content = choice["logprobs"]["content"]
        assert len(content) == 4
        # a character split across tokens is U+FFFD in each token's string (as vLLM's): any text there, none at the
        # end when max_tokens cut the character short
        joined = re.sub("\ufffd+", "\ufffd", "".join(e["token"] for e in content))
        pattern = "".join("(.+?)" if ch == "\ufffd" else re.escape(ch) for ch in joined)
        pattern = pattern.removesuffix("(.+?)") + "(.*?)" if joined.endswith("\ufffd") else pattern
        assert re.fullmatch(pattern, choice["message"]["content"], re.DOTALL), (joined, choice["message"]["content"])
        for entry in content:  # a token's own bytes; its string shows a part of a character as U+FFFD
            assert bytes(entry["bytes"]).decode(errors="replace") == entry["token"] and len(entry["top_logprobs"]) == 3
            assert entry["logprob"] <= entry["top_logprobs"][0]["logprob"]


def test_a_token_that_is_part_of_a_character_carries_its_own_bytes(client, engine):
    """A lone byte's entry said "bytes": [239, 191, 189], U+FFFD's, not its own (issue 68). The oracle: the bytes
    each byte-level vocabulary entry stands for, by transformers' table."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    entries = {bytes(byte_of[c] for c in piece) for piece in engine.tokenizer.get_vocab()}
    lone = engine.tokenizer.token_to_id("\u00a1")  # the byte 0xA1 (the second half of "¡", U+00A1)
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "logprobs": True,
        "top_logprobs": 20, "logit_bias": {str(lone): 100}, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["token_ids"] == [lone] * 3
    assert [(e["token"], e["bytes"]) for e in content] == [("\ufffd", [0xA1])] * 3
    top = [t for e in content for t in e["top_logprobs"]]
    assert any(t["token"] == "\ufffd" for t in top)  # other lone bytes among the alternatives
    for entry in top:
        assert bytes(entry["bytes"]) in entries and bytes(entry["bytes"]).decode(errors="replace") == entry["token"]


def test_completion_text_offsets_add_up_to_the_text_where_tokens_split_characters(client, engine):
    """text_offset counted U+FFFD per token, so "é" in two tokens moved every later offset by one (issue 68). The
    oracle: where each token starts is the length of the text decoded before it, counted once a character is whole."""
    prompt = "ok \u00a1s\u00ed, caf\u00e9!"  # "ok ¡sí, café!": each byte of ¡, í and é is a token
    prompt_ids = engine.tokenizer.encode(prompt).ids
    body = completion(client, prompt=prompt, echo=True, logprobs=1, max_tokens=12, temperature=1.0, seed=3,
                      ignore_eos=True)
    choice = body["choices"][0]
    lp, generated = choice["logprobs"], choice["token_ids"]
    assert choice["text"].startswith(prompt) and len(lp["tokens"]) == len(prompt_ids) + len(generated)
    assert lp["tokens"].count("\ufffd") >= 6

    def starts(ids: list[int], at: int, skip_special_tokens: bool) -> list[int]:
        out, whole = [], ""
        for i in range(len(ids)):
            decoded = engine.tokenizer.decode(ids[:i], skip_special_tokens=skip_special_tokens)
            whole = decoded if not decoded.endswith("\ufffd") else whole  # a character not yet whole: not counted
            out.append(at + len(whole))
        return out

    assert lp["text_offset"] == starts(prompt_ids, 0, False) + starts(generated, len(prompt), True)
    assert lp["text_offset"][len(prompt_ids) - 1] == len(prompt) - 1  # "!", after the 13 characters before it
    assert all(a <= b <= len(choice["text"]) for a, b in zip(lp["text_offset"], lp["text_offset"][1:]))


def test_streamed_logprobs_equal_the_unstreamed_ones(client):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2, "echo": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        from tsdev.client import iter_sse_data

        r.read()
        parts = [e["choices"][0]["logprobs"] for e in iter_sse_data(r)]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"]
    assert [t for p in parts for t in p["token_logprobs"]] == whole["token_logprobs"]
    assert [t for p in parts for t in p["text_offset"]] == whole["text_offset"]


@pytest.mark.parametrize("route, body, field, needle", [
    ("/v1/completions", {"prompt": "hi", "temperature_x": 1}, "temperature_x", "unknown field 'temperature_x'"),
    ("/v1/completions", {"prompt": "hi", "suffix": "bye"}, "suffix", "suffix (insertion) is not supported"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, None, "best_of > n is not supported"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "object"}}, "guided_json", "guided decoding"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1}, "prompt_logprobs", "echo"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x",
     "unknown field 'stream_options.x'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, "response_format", "structured output"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools", "tool calling"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, None,
     "top_logprobs needs \"logprobs\": true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.content.type", "content parts of type 'image_url' are not supported"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "keys are token ids"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, None,
     "continue_final_message continues the final message"),
    ("/v1/completions", {"prompt": "hi", "user": "u" * 257}, "user", "at most 256 characters"),
])
def test_fields_the_server_does_not_implement_are_refused_naming_them(client, route, body, field, needle):
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == field, error


def test_an_unknown_field_lists_what_the_route_reads_and_harmless_values_pass(client):
    error = client.post("/v1/completions", json={"prompt": "hi", "foo": 1}).json()["error"]
    assert "logprobs" in error["message"] and "guided_json" not in error["message"]
    ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                   "response_format": {"type": "text"}, "tools": [], "user": None})
    assert ok.status_code == 200, ok.text
    # a reply's message sent back as history, with its empty fields
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "refusal": None,
                                                   "tool_calls": [], "annotations": [], "audio": None}]
    assert client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2}).status_code == 200
    calls = [*history[:1], {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}]
    refused = client.post("/v1/chat/completions", json={"messages": calls, "max_tokens": 2}).json()["error"]
    assert "tool_calls are not supported" in refused["message"] and refused["param"] == "messages.tool_calls"


def test_tokenize_and_detokenize_round_trip(client, engine):
    text = "Hello, world: tokens round trip"
    r = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == engine.tokenizer.encode(text).ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256 and len(r["token_strs"]) == r["count"]
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1
    assert client.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_version_and_one_model(client):
    assert client.get("/version").json()["version"]
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    missing = client.get("/v1/models/gpt-9")
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]


@pytest.mark.slow
def test_the_openai_client_reads_logprobs_from_both_routes(tiny_server):
    from openai import OpenAI

    client = OpenAI(base_url=tiny_server + "/v1", api_key="unused")
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, logprobs=2, temperature=0,
                                           extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) >= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, n=2, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2
    content = chat.choices[1].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2 and content[0].logprob <= 0


def test_user_is_accepted_and_written_in_the_requests_log_line(client, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="tsdev_runtime.requests"):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                      "user": "alice@example"})
        assert r.status_code == 200, r.text
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "user": "bob"}).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "tsdev_runtime.requests"]
    assert any(line.startswith("chatcmpl-") and "from user 'alice@example'" in line and "max_tokens 2" in line
               for line in lines), lines
    assert any(line.startswith("cmpl-") and "from user 'bob'" in line for line in lines), lines


def test_ping_and_load_answer_as_vllms(client):
    for method in ("GET", "POST"):
        ping = client.request(method, "/ping")
        assert ping.status_code == 200 and ping.content == b""
    assert client.get("/load").json() == {"server_load": 0}
