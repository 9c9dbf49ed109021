"""`tsdev serve` as a user runs it: a subprocess, driven by the official openai client and raw httpx."""
import time

import httpx
import pytest

import openai


@pytest.fixture
def server(tiny_server):
    return tiny_server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith((name + " ", name + "{")))


def test_openai_completions(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_openai_chat(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 5
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi")


def wait_until_idle(url: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if metric(url, "tsdev_requests_running") == 0 and metric(url, "tsdev_kv_pages_used") == 0:
            return
        time.sleep(0.1)
    pytest.fail("the disconnected request still holds pages")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_pages(server, stream, tiny_server_log):
    body = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True, "stream": stream}
    generated_before = metric(server, "tsdev_generation_tokens_total")
    if stream:
        with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # keep it referenced: dropping it would close the connection now
            next(lines)
            assert metric(server, "tsdev_kv_pages_used") > 0
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server + "/v1/completions", json=body, timeout=0.5)
    wait_until_idle(server)
    assert metric(server, "tsdev_generation_tokens_total") - generated_before < 900  # stopped early, not finished
    assert "unhandled error" not in tiny_server_log.read_text()  # the server answered 499, not an error
