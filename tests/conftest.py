import gc
import os

import torch

# Without a GPU, Triton kernels run in its interpreter. Triton reads this when a kernel is decorated,
# so it must be set before anything imports tsdev_kernels.ops (or tsdev.hotreload's Triton scenarios).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

# Tests never write into the user's real cache directory.
os.environ.setdefault("TSDEV_CACHE_DIR", str(Path(__file__).parent.parent / ".pytest_cache" / "tsdev-cache"))
# A developer's API key would close every server the tests start (tests that want one set it themselves).
from tsdev_runtime.config import API_KEY_ENV_VARS  # noqa: E402
from written import save_with_tiny_tokenizer

for _name in API_KEY_ENV_VARS:
    os.environ.pop(_name, None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 checkpoint whose random weights give varied (not repetitive) greedy output."""
    from tsdev_runtime.weights.default_model import SHAPES, write_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen3")
    write_checkpoint(out, {**SHAPES["tiny"], "max_position_embeddings": 1024}, seed=1, std=0.2)
    return out


@pytest.fixture(scope="session")
def hf_written_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny Qwen3 checkpoint that transformers itself wrote (`save_pretrained` of a seeded random model, float32),
    with the tiny model's tokenizer: the oracle for what the runtime computes from a Hugging Face directory."""

    import transformers

    out = tmp_path_factory.mktemp("hf-qwen3")
    config = transformers.Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=0,
                                      initializer_range=0.2)
    torch.manual_seed(3)
    return save_with_tiny_tokenizer(transformers.Qwen3ForCausalLM(config).to(torch.float32), out, tiny_model_dir)


def _randomize_norms_and_biases(model, seed: int) -> None:
    """Give the RMSNorm weights (transformers initialises them to ones) and any biases (zeros) random values of a
    visible scale, so a loader that skipped them, or a model that ignored them, computes other tokens."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))


# A Llama-3-style chat template (header markers, <|eot_id|> after each turn, the bos token first): not ChatML. The
# tiny byte-level tokenizer has none of these as special tokens, so they are text to it.
LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = 'You are a tiny model.' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
# What the Llama checkpoint's generation_config.json lists as end-of-sequence (Llama 3 lists several too); its
# config.json names only the first (as Llama 3's does).
LLAMA_EOS_IDS = [2, 0]


@pytest.fixture(scope="session")
def hf_llama_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny LlamaForCausalLM that transformers wrote (`save_pretrained`, float32): llama3 rope scaling (factor 8
    from 64 original positions, theta 5e5, 1024 positions), untied lm_head, 2 of 4 heads for key/value, no
    head_dim in its config.json (64 / 4 = 16 is implied), random norm weights; the tiny tokenizer saved by
    transformers with a Llama-3-style chat template (chat_template.jinja); a generation_config.json whose
    eos_token_id is a list of two ids."""
    import json

    import transformers

    out = tmp_path_factory.mktemp("hf-llama")
    # rope_theta and rope_scaling as Llama 3.x's Hub configs have them: every transformers version reads these
    # (transformers 5 turns them into its rope_parameters, and writes that)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=LLAMA_EOS_IDS[0], initializer_range=0.2)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    _randomize_norms_and_biases(model, 6)
    model.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    written.pop("head_dim", None)  # as older Llama checkpoints: the runtime must derive it
    (out / "config.json").write_text(json.dumps(written, indent=2))
    generation = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": LLAMA_EOS_IDS}, indent=2))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = LLAMA3_STYLE_TEMPLATE
    tokenizer.bos_token = "<|endoftext|>"
    tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    return out


@pytest.fixture(scope="session")
def hf_qwen2_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny Qwen2ForCausalLM that transformers wrote (float32): random (non-zero) q/k/v biases, ONE key/value
    head for 4 query heads (so --tp 2 must replicate it), tied embeddings, random norm weights; the tiny tokenizer."""

    import transformers

    out = tmp_path_factory.mktemp("hf-qwen2")
    config = transformers.Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
                                      tie_word_embeddings=True, eos_token_id=0, initializer_range=0.2)
    torch.manual_seed(7)
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32)
    _randomize_norms_and_biases(model, 8)  # transformers initialises the q/k/v biases to zero
    return save_with_tiny_tokenizer(model, out, tiny_model_dir)


@pytest.fixture(scope="session")
def hf_qwen3_moe_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny Qwen3MoeForCausalLM that transformers wrote (float32; it saves the experts per expert, under the hub's
    names): 8 experts, top 2, renormalised; layer 1 dense (`mlp_only_layers`) between two sparse ones; random
    router, experts and norms (so routing varies from token to token); untied; the tiny tokenizer."""

    import transformers

    out = tmp_path_factory.mktemp("hf-qwen3-moe")
    config = transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=64, intermediate_size=96,
                                         moe_intermediate_size=32,
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                         decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=1024,
                                         tie_word_embeddings=False, eos_token_id=0, initializer_range=0.2)
    torch.manual_seed(11)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp.experts." in name or ".mlp.gate." in name:
                param.normal_(0.0, 0.2)
    _randomize_norms_and_biases(model, 12)
    return save_with_tiny_tokenizer(model, out, tiny_model_dir)


DEEPSEEK_SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                      num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                      max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=0)


def _deepseek_dir(tmp_path_factory, tiny_model_dir, name: str, config) -> Path:
    """`config`'s model as transformers writes it (float32, per-expert names), every weight random at 0.2 (routing
    and attention vary from token to token), the norms near one, the routing bias random; the tiny tokenizer."""

    import transformers

    out = tmp_path_factory.mktemp(name)
    torch.manual_seed(21)
    model = getattr(transformers, config.architectures[0])(config).to(torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if not param_name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    _randomize_norms_and_biases(model, 22)
    return save_with_tiny_tokenizer(model, out, tiny_model_dir)


@pytest.fixture(scope="session")
def hf_deepseek_v2_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny DeepseekV2ForCausalLM (V2-Lite's form): q_proj without q LoRA, softmax top-2 of 8 experts scaled by
    1.5, two shared experts, every layer sparse."""
    import transformers

    config = transformers.DeepseekV2Config(**DEEPSEEK_SHAPE, q_lora_rank=None, n_shared_experts=2,
                                           first_k_dense_replace=0, routed_scaling_factor=1.5,
                                           architectures=["DeepseekV2ForCausalLM"])
    return _deepseek_dir(tmp_path_factory, tiny_model_dir, "hf-deepseek-v2", config)


@pytest.fixture(scope="session")
def hf_deepseek_v3_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny DeepseekV3ForCausalLM: q LoRA, sigmoid routing with the correction bias in 2 groups of 4 experts (the
    best group allowed), renormalised and scaled by 2.5, one shared expert, layer 0 dense, YaRN (factor 4 over 256
    positions, mscale 0.9 over mscale_all_dim 1.0: both the rotary table's factor and the softmax scale change)."""
    import transformers

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.9,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    config = transformers.DeepseekV3Config(**DEEPSEEK_SHAPE, q_lora_rank=32, n_shared_experts=1, n_group=2,
                                           topk_group=1, first_k_dense_replace=1, rope_parameters=yarn,
                                           architectures=["DeepseekV3ForCausalLM"])
    return _deepseek_dir(tmp_path_factory, tiny_model_dir, "hf-deepseek-v3", config)


@pytest.fixture
def make_engine(tiny_model_dir):
    """Engine on the tiny checkpoint with small pages (4 tokens) so sequences span many pages."""
    from tsdev_runtime.config import EngineConfig
    from tsdev_runtime.engine.llm_engine import LLMEngine

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
    torch.cuda.empty_cache()
    # a block larger than any free space left in the segments still partly in use (cuBLAS workspaces, a test's
    # module-scoped engine), so it gets a segment of its own, which only a capture underway keeps from going back
    size = min(torch.cuda.memory_reserved() + (256 << 20), torch.cuda.mem_get_info()[0] // 2)
    torch.empty(size, dtype=torch.uint8, device="cuda")  # freed at once: a cached block
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    released = before - torch.cuda.memory_reserved()
    assert released >= size, (f"after this test empty_cache released {released >> 20} MiB of a free {size >> 20} MiB "
                              "block: a CUDA graph capture was begun and never ended")


def pytest_runtest_logreport(report):
    """TSDEV_FAILURES=FILE: each failure's report appended as it happens, so that a device run cut off by its time
    limit (before pytest's summary) still says why (scripts/device-suite.sh sets it). Written by the controller
    only: xdist's workers send it their reports."""
    path = os.environ.get("TSDEV_FAILURES")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as out:
            out.write(f"===== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n")
            for name, text in report.sections:  # captured output: a server's last lines (tests/serve_process.py)
                out.write(f"----- {name}\n{text[-8000:]}\n")
