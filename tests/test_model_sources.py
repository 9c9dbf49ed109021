"""Checkpoints as users have them: a hub id resolved from the local Hugging Face cache (offline, never downloaded),
and chat prompts rendered from the checkpoint's own template as transformers renders them."""
import json
import shutil

import pytest
import transformers
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.server.app import build_app
from tsdev_runtime.server.chat import ChatTemplate
from tsdev_runtime.weights.hub import resolve_model

COMMIT, OTHER = "a" * 40, "b" * 40


def cache_with(tmp_path, checkpoint, repo="acme/tiny-chat", refs=None) -> tuple:
    """The layout `hf download` leaves: blobs, snapshots/<commit>/ of links into them, refs/<name>."""
    root = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    for commit in (COMMIT, OTHER):
        snapshot = root / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for f in checkpoint.iterdir():
            blob = root / "blobs" / f"{commit[:4]}-{f.name}"
            shutil.copy(f, blob)
            (snapshot / f.name).symlink_to(blob)
    (root / "refs").mkdir()
    for name, commit in (refs or {"main": COMMIT, "v2": OTHER}).items():
        (root / "refs" / name).write_text(commit)
    return tmp_path / "hub", root


@pytest.mark.slow
def test_a_hub_id_resolves_to_its_cached_snapshot_and_serves(tmp_path, monkeypatch, tiny_model_dir):
    cache, root = cache_with(tmp_path, tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model("acme/tiny-chat") == root / "snapshots" / COMMIT
    assert resolve_model("acme/tiny-chat", "v2") == root / "snapshots" / OTHER  # a branch or tag in refs/
    assert resolve_model("acme/tiny-chat", OTHER) == root / "snapshots" / OTHER  # a commit hash
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir  # a directory is itself
    engine = LLMEngine(EngineConfig(model=str(resolve_model("acme/tiny-chat")), device="cpu", kv_pages=64))
    served = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    direct = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", kv_pages=64))
    assert served == direct.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))


def test_hf_home_is_the_cache_when_hf_hub_cache_is_unset(tmp_path, monkeypatch, tiny_model_dir):
    cache, root = cache_with(tmp_path, tiny_model_dir)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve_model("acme/tiny-chat") == root / "snapshots" / COMMIT


@pytest.mark.parametrize("repo, revision, needle", [
    ("acme/absent", None, "models--acme--absent/refs/main"),
    ("acme/tiny-chat", "v9", f"cached snapshots: {COMMIT}, {OTHER} (pass one with --revision)"),
    ("acme/tiny-chat", "c" * 40, "snapshots/" + "c" * 40),
])
def test_a_hub_id_not_in_the_cache_says_where_it_looked_and_what_to_run(tmp_path, monkeypatch, tiny_model_dir,
                                                                        repo, revision, needle):
    cache, _ = cache_with(tmp_path, tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(FileNotFoundError) as error:
        resolve_model(repo, revision)
    whole = f"`hf download {repo}{'' if revision is None else f' --revision {revision}'}`"  # one command, copyable
    assert needle in str(error.value) and whole in str(error.value), str(error.value)
    assert "never downloads" in str(error.value)


def test_serve_takes_a_hub_id_and_serves_it_under_that_name(tmp_path, monkeypatch, tiny_model_dir):
    import tsdev.launch.serve
    from tsdev.cli import app

    cache, root = cache_with(tmp_path, tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    seen = []
    monkeypatch.setattr(tsdev.launch.serve, "run_server",
                        lambda config, server, console, *_: seen.append((config, server)) or 0)
    result = CliRunner().invoke(app, ["serve", "acme/tiny-chat", "--device", "cpu", "--revision", "v2"])
    assert result.exit_code == 0, result.output
    config, server = seen[0]
    assert config.model == str(root / "snapshots" / OTHER) and server.served_model_name == "acme/tiny-chat"
    missing = CliRunner().invoke(app, ["serve", "acme/absent", "--device", "cpu"])
    assert missing.exit_code == 2 and "`hf download acme/absent`" in " ".join(missing.output.split())
    bad = CliRunner().invoke(app, ["serve", str(tiny_model_dir), "--device", "cpu", "--revision", "v2"])
    assert bad.exit_code == 2 and "applies to a Hugging Face hub id" in " ".join(bad.output.split())
    no_template = CliRunner().invoke(app, ["serve", "--device", "cpu", "--chat-template", str(tmp_path / "x.jinja")])
    assert no_template.exit_code == 2 and "no such file" in " ".join(no_template.output.split())
    assert len(seen) == 1  # neither reached the server


# A Llama-3-style template: the date from strftime_now, a loop control, the bos token, a system message split off.
LLAMA_STYLE = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|im_start|>system\\nToday: ' + date_string + '\\n' + system + '<|im_end|>' }}"
    "{%- for message in messages %}{%- if message['content'] == 'STOP' %}{%- break %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "And now?"},
            {"role": "user", "content": "STOP"}, {"role": "user", "content": "never rendered"}]


def with_template(tmp_path, tiny_model_dir, where: str):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, checkpoint)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    if where == "tokenizer_config":
        config["chat_template"] = LLAMA_STYLE
    else:  # transformers >= 4.43 writes chat_template.jinja beside the config
        (checkpoint / "chat_template.jinja").write_text(LLAMA_STYLE)
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    return checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("where", ["tokenizer_config", "chat_template.jinja"])
def test_chat_prompt_tokens_are_the_checkpoints_template_as_transformers_renders_it(tmp_path, tiny_model_dir, where):
    checkpoint = with_template(tmp_path, tiny_model_dir, where)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.chat_template == LLAMA_STYLE  # transformers reads the template from the same place
    want = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", kv_pages=64))
    with TestClient(build_app(engine, "tiny")) as client:
        tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert tokens == list(want)
    assert chat["usage"]["prompt_tokens"] == len(want)
    assert "never rendered" not in engine.tokenizer.decode(tokens)  # the loop control stopped it


@pytest.mark.slow
def test_chat_template_flag_overrides_the_checkpoints(tmp_path, tiny_model_dir):
    checkpoint = with_template(tmp_path, tiny_model_dir, "chat_template.jinja")
    override = tmp_path / "plain.jinja"
    override.write_text("{%- for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{%- endfor %}assistant:")
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", kv_pages=64))
    with TestClient(build_app(engine, "tiny", chat_template=str(override))) as client:
        tokens = client.post("/tokenize", json={"messages": MESSAGES[1:2]}).json()["tokens"]
    assert engine.tokenizer.decode(tokens) == "user: Hello thereassistant:"
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        build_app(engine, "tiny", chat_template=str(tmp_path / "absent.jinja"))


def test_tokenizer_dir_gives_the_tokenizer_and_chat_template_of_a_checkpoint_without_them(tmp_path, tiny_model_dir,
                                                                                          monkeypatch):
    from test_cli import engine_config

    tokenizer_dir = with_template(tmp_path, tiny_model_dir, "chat_template.jinja")
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, weights_only / name)
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        LLMEngine(EngineConfig(model=str(weights_only), device="cpu", kv_pages=64))
    assert (engine_config(monkeypatch, str(weights_only), "--tokenizer", str(tokenizer_dir)).tokenizer
            == str(tokenizer_dir))
    engine = LLMEngine(EngineConfig(model=str(weights_only), tokenizer=str(tokenizer_dir), device="cpu", kv_pages=64))
    want = transformers.AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(
        MESSAGES[1:2], add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    with TestClient(build_app(engine, "tiny")) as client:
        assert client.post("/tokenize", json={"messages": MESSAGES[1:2]}).json()["tokens"] == list(want)
        text = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4}).json()["choices"][0]["text"]
    assert isinstance(text, str) and text


# The part of Qwen3's template that chat_template_kwargs reach: the generation prompt, closed thinking when
# enable_thinking is false (as Qwen3's own template writes it).
QWEN3_STYLE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.mark.parametrize("kwargs, thinking", [({}, ""), ({"enable_thinking": True}, ""),
                                              ({"enable_thinking": False}, "<think>\n\n</think>\n\n")])
def test_enable_thinking_false_closes_the_embedded_models_thinking_as_qwen3s_template_does(tiny_model_dir, kwargs,
                                                                                          thinking):
    """The embedded models' template ignored enable_thinking (issue 68). Qwen3's own template writes the empty
    thinking block after the generation prompt when it is false (Qwen3's model card: the prompt below); the server
    renders it as transformers does from the same checkpoint."""
    user = [{"role": "user", "content": "Hello there"}]
    want = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n" + thinking
    assert ChatTemplate(tiny_model_dir).render(user, variables=kwargs) == want
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True, **kwargs) == want


def test_chat_template_kwargs_and_continue_final_message_render_as_transformers_does(tmp_path, tiny_model_dir):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, checkpoint)
    (checkpoint / "chat_template.jinja").write_text(QWEN3_STYLE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)

    def want(messages, **kwargs):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    user = [{"role": "user", "content": "Hello there"}]
    started = [*user, {"role": "assistant", "content": "Once upon a"}]
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", kv_pages=64))
    with TestClient(build_app(engine, "tiny")) as client:
        def tokens(**body):
            reply = client.post("/tokenize", json=body)
            assert reply.status_code == 200, reply.text
            return reply.json()["tokens"]

        no_thinking = tokens(messages=user, chat_template_kwargs={"enable_thinking": False})
        assert no_thinking == want(user, add_generation_prompt=True, enable_thinking=False)
        assert no_thinking != tokens(messages=user) == want(user, add_generation_prompt=True)
        assert "</think>" in engine.tokenizer.decode(no_thinking, skip_special_tokens=False)
        continued = tokens(messages=started, add_generation_prompt=False, continue_final_message=True)
        assert continued == want(started, continue_final_message=True)
        assert engine.tokenizer.decode(continued).endswith("Once upon a")

        chat = {"messages": started, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "add_generation_prompt": False, "continue_final_message": True}
        reply = client.post("/v1/chat/completions", json=chat).json()
        assert reply["usage"]["prompt_tokens"] == len(continued)
        echoed = client.post("/v1/chat/completions", json={**chat, "echo": True}).json()
        assert echoed["choices"][0]["message"]["content"] == "Once upon a" + reply["choices"][0]["message"]["content"]
        with client.stream("POST", "/v1/chat/completions", json={**chat, "echo": True, "stream": True}) as r:
            from tsdev.client import iter_sse_data

            r.read()
            streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in iter_sse_data(r) if e["choices"])
        assert streamed == echoed["choices"][0]["message"]["content"]
        not_same_role = client.post("/v1/chat/completions", json={"messages": user, "max_tokens": 2, "echo": True,
                                                                   "temperature": 0, "ignore_eos": True}).json()
        assert not not_same_role["choices"][0]["message"]["content"].startswith("Hello there")

        both = client.post("/v1/chat/completions", json={**chat, "add_generation_prompt": True}).json()["error"]
        assert "\"add_generation_prompt\": false" in both["message"]
        clash = client.post("/tokenize", json={"messages": user, "chat_template_kwargs": {"messages": []}}).json()
        assert clash["error"]["param"] == "chat_template_kwargs" and "may not set messages" in clash["error"]["message"]
