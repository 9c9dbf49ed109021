import gc
import os

import torch

# Without a GPU, Triton kernels run in its interpreter. Triton reads this when a kernel is decorated,
# so it must be set before anything imports kernels.ops (or tsdev.hotreload's Triton scenarios).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

# Tests never write into the user's real cache directory.
os.environ.setdefault("TSDEV_CACHE_DIR", str(Path(__file__).parent.parent / ".pytest_cache" / "tsdev-cache"))
# A developer's API key would close every server the tests start (tests that want one set it themselves).
from runtime.config import API_KEY_ENV_VARS  # noqa: E402

for _name in API_KEY_ENV_VARS:
    os.environ.pop(_name, None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 checkpoint whose random weights give varied (not repetitive) greedy output."""
    from runtime.weights.default_model import SHAPES, write_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen3")
    write_checkpoint(out, {**SHAPES["tiny"], "max_position_embeddings": 1024}, seed=1, std=0.2)
    return out


@pytest.fixture(scope="session")
def hf_written_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny Qwen3 checkpoint that transformers itself wrote (`save_pretrained` of a seeded random model, float32),
    with the tiny model's tokenizer: the oracle for what the runtime computes from a Hugging Face directory."""
    import shutil

    import transformers

    out = tmp_path_factory.mktemp("hf-qwen3")
    config = transformers.Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=0,
                                      initializer_range=0.2)
    torch.manual_seed(3)
    transformers.Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    return out


@pytest.fixture
def make_engine(tiny_model_dir):
    """Engine on the tiny checkpoint with small pages (4 tokens) so sequences span many pages."""
    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine

    def make(**overrides):
        kwargs = dict(model=str(tiny_model_dir), device="cpu", page_size=4, max_batched_tokens=256,
                      max_running=16, kv_pages=512)
        return LLMEngine(EngineConfig(**{**kwargs, **overrides}))

    return make


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A throwaway package `protopkg` with one module, imported: for a Reloader that must not touch the checkout."""
    import importlib
    import sys

    root = tmp_path / "protopkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("def f():\n    return 1\n\n\nkeep = f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    importlib.import_module("protopkg.a")
    yield root
    for name in [m for m in sys.modules if m == "protopkg" or m.startswith("protopkg.")]:
        del sys.modules[name]


@pytest.fixture(scope="session")
def tiny_server_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve") / "serve.log"


@pytest.fixture(scope="session")
def tiny_server_profile_dir(tmp_path_factory) -> Path:
    """Where tiny_server writes profiler traces (its --profile-dir)."""
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tiny_server_log, tiny_server_profile_dir):
    """URL of a `tsdev serve` subprocess on the tiny checkpoint, shared by the tests that only send requests."""
    from serve_process import serve

    args = [str(tiny_model_dir), "--device", "cpu", "--max-model-len", "1024", "--served-model-name", "tiny",
            "--profile-dir", str(tiny_server_profile_dir)]
    with serve(args, tiny_server_log) as url:
        yield url


@pytest.fixture(autouse=True)
def allocator_still_returns_memory(request):
    """After each GPU test, torch's caching allocator must still hand free memory back to the driver: a capture left
    underway (begun, never ended) silently stops `empty_cache` from releasing anything, and sleep from freeing."""
    yield
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        return
    gc.unfreeze()  # as LLMEngine's thaw_heap: an engine of this test still held in a reference cycle (frozen by
    gc.collect()  # freeze_heap) keeps parts of its segments in use
    torch.cuda.synchronize()
    torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # freed at once: a cached block
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    released = before - torch.cuda.memory_reserved()
    assert released >= 256 << 20, (f"after this test empty_cache released {released >> 20} MiB of a free 256 MiB block: "
                                   "a CUDA graph capture was begun and never ended")
