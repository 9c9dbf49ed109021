"""HTTP API in-process: response shapes, streaming, and errors for bad input."""
import pytest
from fastapi.testclient import TestClient

from tsdev_runtime.server.app import build_app
from tsdev.client import iter_sse_data


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=128, kv_pages=256))
    with TestClient(build_app(engine, "tiny")) as c:
        yield c


def sse_events(response) -> list:
    assert response.read().decode().rstrip().endswith("data: [DONE]")
    return list(iter_sse_data(response))


def test_completion_reports_text_and_usage(client):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello, world", "max_tokens": 5,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] > 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5


def test_token_id_prompts_and_several_prompts(client):
    r = client.post("/v1/completions", json={"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 6


def test_streamed_text_equals_unstreamed_and_ends_with_usage(client):
    req = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**req, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


def test_chat_streaming_starts_with_the_role(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True, "ignore_eos": True}) as r:
        events = sse_events(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("body, status, needle", [
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens 0 generates nothing"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "valid integer"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": "hi", "model": "gpt-9"}, 400, "does not exist"),
    ({"prompt": "word " * 200}, 400, "maximum context length is 128"),
    ({"prompt": "hi", "max_tokens": 500}, 400, "maximum context length"),
    ({"prompt": [5, 99999]}, 400, "outside the vocabulary"),
    ({"prompt": "hi", "n": 17}, 400, "n: Input should be less than or equal to 16"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs: Input should be less than or equal to 20"),
    # beyond int64 it failed the engine's step, aborting every request in flight (issue 19's fuzz)
    ({"prompt": "hi", "top_k": 2**64}, 400, "top_k: Input should be less than or equal to"),
])
def test_bad_completion_requests_are_refused_with_a_reason(client, body, status, needle):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["code"] == status


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("route, field, value, needle", [
    ("/v1/completions", "max_tokens", True, "max_tokens: Input should be a valid integer, not a boolean (true)"),
    ("/v1/completions", "max_tokens", "3", 'max_tokens: Input should be a valid integer, not a string ("3")'),
    ("/v1/completions", "max_tokens", 3.0, "max_tokens: Input should be a valid integer, not a number (3.0)"),
    ("/v1/completions", "temperature", "0.5", 'temperature: Input should be a valid number, not a string ("0.5")'),
    ("/v1/completions", "temperature", True, "temperature: Input should be a valid number, not a boolean"),
    ("/v1/completions", "stream", "yes", 'stream: Input should be a valid boolean, not a string ("yes")'),
    ("/v1/completions", "echo", 1, "echo: Input should be a valid boolean, not an integer (1)"),
    ("/v1/chat/completions", "max_tokens", "3", "max_tokens: Input should be a valid integer, not a string"),
    ("/v1/chat/completions", "logprobs", 1, "logprobs: Input should be a valid boolean, not an integer"),
    ("/v1/chat/completions", "add_generation_prompt", "false", "add_generation_prompt: Input should be a valid "
                                                               "boolean, not a string"),
])
def test_json_values_of_another_type_are_refused_naming_the_field_and_its_type(client, route, field, value, needle):
    """Coerced, "stream": "yes" streamed and "max_tokens": true gave one token (issue 68)."""
    base = {"prompt": "hi"} if route == "/v1/completions" else CHAT
    r = client.post(route, json={**base, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(needle), error


def test_a_json_integer_is_a_number(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 1, "top_p": 1,
                                             "presence_penalty": 0, "repetition_penalty": 1, "logit_bias": {"5": 1}})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "temperature": 0, "frequency_penalty": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_refused_as_vllm_does(client, route):
    base = {"prompt": "hi", "max_tokens": 2} if route == "/v1/completions" else {**CHAT, "max_tokens": 2}
    for body in ({**base, "stream_options": {"include_usage": True}},
                 {**base, "stream": False, "stream_options": {}}):
        r = client.post(route, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "stream_options" and '"stream": true' in error["message"], error
    assert client.post(route, json={**base, "stream_options": None}).status_code == 200


def test_malformed_json_is_refused(client):
    r = client.post("/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_chat_longer_than_the_context_is_refused(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 300}]})
    assert r.status_code == 400 and "maximum context length is 128" in r.json()["error"]["message"]


def test_chat_without_messages_is_refused(client):
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_models_health_and_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    def generated(text: str) -> float:
        return next(float(line.split()[1]) for line in text.splitlines()
                    if line.startswith("tsdev_generation_tokens_total"))

    before = generated(client.get("/metrics").text)
    client.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 2, "ignore_eos": True})
    text = client.get("/metrics").text
    for name in ("tsdev_requests_running", "tsdev_requests_waiting", "tsdev_kv_pages_used",
                 "tsdev_generation_tokens_per_second", "tsdev_step_seconds_bucket", "tsdev_prefix_cache_hit_rate"):
        assert name in text
    assert generated(text) - before == 2
    value = lambda name: next(float(line.split()[1]) for line in text.splitlines()  # noqa: E731
                              if line.startswith(name + "{") or line.startswith(name + " "))
    # the host's part of every step: as many observations as steps, never more seconds than the steps took
    assert value("tsdev_step_host_seconds_count") == value("tsdev_step_seconds_count") > 0
    assert 0 < value("tsdev_step_host_seconds_sum") <= value("tsdev_step_seconds_sum")


def test_return_token_ids_gives_the_generated_ids(client, tiny_model_dir):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine
    from tsdev_runtime.engine.sequence import SamplingParams

    req = {"prompt": [3, 4, 5], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = client.post("/v1/completions", json=req).json()["choices"][0]["token_ids"]
    offline = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=128, kv_pages=256))
    assert whole == offline.generate([[3, 4, 5]],
                                     SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]["token_ids"]
    with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        streamed = [t for e in sse_events(r) for t in e["choices"][0]["token_ids"]]
    assert streamed == whole
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                     "ignore_eos": True, "return_token_ids": True}).json()
    assert len(chat["choices"][0]["token_ids"]) == 3


def test_an_internal_error_is_a_json_500(tiny_model_dir, monkeypatch):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=128, kv_pages=256))

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(engine.tokenizer, "encode", broken, raising=False)
    with TestClient(build_app(engine, "tiny"), raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 500 and "tokenizer exploded" in r.json()["error"]["message"]


def test_server_info_says_what_is_served(client, tiny_model_dir):
    import math
    import os

    from safetensors import safe_open

    from tsdev_runtime.control_protocol import SERVER_INFO_ROUTE, ServerInfo

    r = client.get(SERVER_INFO_ROUTE)
    assert r.status_code == 200, r.text
    info = ServerInfo.model_validate(r.json())
    assert (info.model, info.model_dir, info.architecture) == ("tiny", str(tiny_model_dir), "Qwen3ForCausalLM")
    assert (info.device, info.dtype, info.max_model_len, info.vocab_size) == ("cpu", "float32", 128, 1024)
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:  # tied embeddings: stored once, counted once
        assert info.parameters == sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert (info.rank, info.world_size) == (0, 1)
    assert info.allow_reload_forward is False and info.pid == os.getpid()


def error_of(response, status: int) -> dict:
    """The OpenAI-style error body every error status carries."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_unknown_routes_and_methods_get_openai_style_errors(client):
    assert "no route GET /v1/nope" in error_of(client.get("/v1/nope"), 404)["message"]
    r = client.get("/v1/completions")
    assert "use POST" in error_of(r, 405)["message"] and r.headers["allow"] == "POST"


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/completions", [{"prompt": "hi"}], 'must be a JSON object with "prompt"'),
    ("/v1/completions", "hi", "not a JSON string"),
    ("/v1/chat/completions", [{"role": "user", "content": "hi"}], 'must be a JSON object with "messages"'),
])
def test_a_body_that_is_not_an_object_says_what_to_send(client, path, body, needle):
    assert needle in error_of(client.post(path, json=body), 400)["message"]


def test_an_oversize_body_is_refused_413_before_parsing(client):
    error = error_of(client.post("/v1/completions", content=b"[" * (5 << 20),
                                 headers={"content-type": "application/json"}), 413)
    assert "--max-request-body-bytes" in error["message"]


@pytest.mark.parametrize("nesting", ["[" * 100_000 + "]" * 100_000,
                                     '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"])
def test_json_nested_too_deeply_to_parse_is_a_400_that_says_so(client, nesting):
    error = error_of(client.post("/v1/completions", content=nesting.encode(),
                                 headers={"content-type": "application/json"}), 400)
    assert "nested too deeply" in error["message"], error


def test_a_prompt_far_longer_than_the_context_is_refused_without_tokenizing(client):
    assert "characters" in error_of(client.post("/v1/completions", json={"prompt": "word " * 400_000}), 400)["message"]


def test_chat_roles_are_checked(client):
    error = error_of(client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "hi"}]}), 400)
    assert "'robot'" in error["message"] and error["param"] == "messages.role"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "developer", "content": "Be brief."},
                                                               {"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", rb'{"prompt": "\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", rb'{"prompt": ["hi", "\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", rb'{"prompt": "hi", "stop": ["\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages.content"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"text": "a\udc00"}]}]}',
     "messages.content.text"),
])
def test_text_with_a_lone_surrogate_is_refused_not_a_server_error(client, path, body, param):
    """JSON's \\ud800 escape carries half a surrogate pair, no tokenizer takes: prompts and messages were a 500."""
    error = error_of(client.post(path, content=body, headers={"content-type": "application/json"}), 400)
    assert error["param"] == param and "surrogate pair, not a character: send valid Unicode" in error["message"]


@pytest.mark.parametrize("body, content_type, needle", [
    (b"\xcc\x1b", "application/json", "not UTF-8 text ('utf-8' codec can't decode byte 0xcc"),
    (b'{"prompt": "hi"}', "text/plain", "not a body sent without the header Content-Type: application/json"),
    (b'{"prompt": "hi"}', "application/x-www-form-urlencoded", "Content-Type: application/json"),  # curl -d
    (b'{"prompt": "hi", "temperature": NaN}', "application/json", "temperature: Input should be a finite number"),
])
def test_a_body_the_server_cannot_read_says_what_to_send(client, body, content_type, needle):
    """These were "There was an error parsing the body", "... not something else" and "... less than 2"."""
    assert needle in error_of(client.post("/v1/completions", content=body, headers={"content-type": content_type}),
                              400)["message"]


LATENCY_HISTOGRAMS = ("tsdev_time_to_first_token_seconds", "tsdev_inter_token_latency_seconds",
                      "tsdev_e2e_request_latency_seconds", "tsdev_request_queue_time_seconds")


def test_latency_histograms_count_each_request(client):
    def counts() -> dict[str, float]:
        lines = client.get("/metrics").text.splitlines()
        return {name: next(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "_count{"))
                for name in LATENCY_HISTOGRAMS}

    before = counts()
    client.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 4, "ignore_eos": True})
    after = counts()
    assert {name: after[name] - before[name] for name in LATENCY_HISTOGRAMS} == {
        "tsdev_time_to_first_token_seconds": 1, "tsdev_inter_token_latency_seconds": 3,
        "tsdev_e2e_request_latency_seconds": 1, "tsdev_request_queue_time_seconds": 1}


def metric_lines(client, name: str) -> dict[frozenset, float]:
    """{frozenset of (label, value)}: value, for every sample of `name` on /metrics."""
    samples = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit(" ", 1)
            pairs = [pair.split("=", 1) for pair in labels.rstrip("}").split(",")]
            samples[frozenset((k, v.strip('"')) for k, v in pairs)] = float(value)
    return samples


def labels(**pairs) -> frozenset:
    return frozenset(pairs.items())


def test_metrics_carry_the_model_name_and_count_finishes_by_reason_and_preemptions(tiny_model_dir):
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

    # 12 pages of 4 tokens: four 20-token requests do not fit at once, so some are preempted
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=32, kv_pages=12,
                                    page_size=4, max_running=4))
    import concurrent.futures

    with TestClient(build_app(engine, "tiny-m")) as c:
        def complete(body):
            return c.post("/v1/completions", json={"prompt": [3, 4, 5, 6], **body})

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(complete, [{"max_tokens": 16, "ignore_eos": True}] * 4))
        assert all(r.status_code == 200 for r in replies)
        complete({"max_tokens": 8, "logit_bias": {"0": 100}})  # EOS at once: stop
        finished = metric_lines(c, "tsdev_request_success_total")
        assert finished[labels(model_name="tiny-m", finished_reason="length")] == 4
        assert finished[labels(model_name="tiny-m", finished_reason="stop")] == 1
        preempted = metric_lines(c, "tsdev_num_preemptions_total")[labels(model_name="tiny-m")]
        assert preempted == engine.stats().preemptions > 0
        text = c.get("/metrics").text
        samples = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert all('model_name="tiny-m"' in line for line in samples), [l for l in samples if "tiny-m" not in l]
