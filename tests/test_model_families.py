"""Each served family (Llama, Qwen2, Qwen3) on a tiny checkpoint that transformers itself wrote computes what
transformers computes (float32, CPU): greedy tokens alone and batched, across position 64 (where the Llama
checkpoint's llama3 rope scaling leaves its pretraining length), and under --tp 2 on gloo (Qwen2's one key/value
head replicated on both ranks). On the Llama checkpoint: its generation_config.json's list of eos ids ends
generation, its Llama-3-style chat template renders as transformers renders it, and fp8, sleep/wake, a direct weight
update and the weight checksum hold. Fixtures: tests/conftest.py (hf_llama_dir, hf_qwen2_dir, hf_written_dir)."""
import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from tsdev_kernels.ops import fp8
from ranks import run_ranks
from tsdev_runtime.config import EngineConfig, ModelConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.layers.linear import Linear
from tsdev_runtime.server.app import build_app
from test_fp8 import prefill_and_decode_logits as teacher_forced_logits
from tolerances import FP8_ROW, assert_logits_close, row_tolerance

FAMILIES = {"llama": "hf_llama_dir", "qwen2": "hf_qwen2_dir", "qwen3": "hf_written_dir"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PROMPTS = [
    [5, 17, 300, 42, 9, 77, 123, 4, 8, 15, 16, 23],
    [200, 201, 202],
    [(13 * j + 1) % 1000 + 3 for j in range(58)],  # its decode steps cross position 64
    [(7 * j + 5) % 1000 + 3 for j in range(70)],  # its prefill does
]
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def engine_config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(**{**dict(model=str(model_dir), device="cpu", dtype="float32", page_size=4, kv_pages=256,
                                  max_running=8, max_batched_tokens=256), **overrides})


def hf_model(model_dir) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # full lengths: the engine runs with ignore_eos
    return model


def hf_greedy(model, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    """transformers' greedy continuation. The attention mask is explicit: generate() would otherwise mask every
    prompt token equal to pad_token_id (id 0 is the chat template's bos token)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(FAMILIES[request.param])


@pytest.fixture(scope="module")
def expected(request) -> dict:
    """family -> transformers' greedy tokens for PROMPTS on that family's checkpoint (computed once each)."""
    cache = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            model = hf_model(request.getfixturevalue(FAMILIES[name]))
            cache[name] = [hf_greedy(model, p) for p in PROMPTS]
        return cache[name]

    return get


def test_the_checkpoints_are_what_transformers_wrote_for_each_family(hf_llama_dir, hf_qwen2_dir, hf_written_dir):
    llama, qwen2 = (json.loads((d / "config.json").read_text()) for d in (hf_llama_dir, hf_qwen2_dir))
    assert "head_dim" not in llama and ModelConfig.from_dir(hf_llama_dir).head_dim == 16
    rope = llama.get("rope_scaling") or llama["rope_parameters"]
    assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 64
    assert not llama["tie_word_embeddings"] and "lm_head.weight" in load_file(hf_llama_dir / "model.safetensors")
    weights = load_file(hf_qwen2_dir / "model.safetensors")
    assert qwen2["num_key_value_heads"] == 1 and qwen2["tie_word_embeddings"]
    biases = [n for n in weights if n.endswith("_proj.bias")]
    assert len(biases) == 3 * 2 and all(weights[n].abs().min() > 0 for n in biases)  # q, k, v per layer
    for name, model_dir in zip(FAMILIES, (hf_llama_dir, hf_qwen2_dir, hf_written_dir)):
        assert ModelConfig.from_dir(model_dir).architecture == ARCHITECTURES[name]


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_alone_and_batched(family, expected):
    name, model_dir = family
    want = expected(name)
    assert len({tuple(w) for w in want}) == len(want)  # varied output: equality says something
    engine = LLMEngine(engine_config(model_dir))
    for prompt, tokens in zip(PROMPTS, want):
        assert engine.generate([prompt], GREEDY)[0]["token_ids"] == tokens
    lengths = [MAX_TOKENS, 5, MAX_TOKENS, 7]
    mixed = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    batched = engine.generate(PROMPTS, mixed)
    assert [b["token_ids"] for b in batched] == [w[:n] for w, n in zip(want, lengths)]


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_across_chunked_prefill(family, expected):
    """The 70-token prompt in chunks of at most 16 tokens (positions 64..69 in the last chunk)."""
    name, model_dir = family
    engine = LLMEngine(engine_config(model_dir, max_batched_tokens=16))
    assert engine.generate([PROMPTS[3]], GREEDY)[0]["token_ids"] == expected(name)[3]


def test_llama3_scaling_and_qwen2_biases_change_the_tokens(hf_llama_dir, hf_qwen2_dir, expected, tmp_path):
    """The equalities above test the scaling and the biases: without them transformers' own tokens differ."""
    unscaled = shutil.copytree(hf_llama_dir, tmp_path / "unscaled")
    config = json.loads((unscaled / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (unscaled / "config.json").write_text(json.dumps(config))
    model = hf_model(unscaled)
    assert [hf_greedy(model, p) for p in PROMPTS[2:]] != expected("llama")[2:]
    unbiased = hf_model(hf_qwen2_dir)
    with torch.no_grad():
        for n, p in unbiased.named_parameters():
            if n.endswith(".bias"):
                p.zero_()
    assert [hf_greedy(unbiased, p) for p in PROMPTS] != expected("qwen2")


def test_a_hub_style_llama_config_with_rope_scaling_and_rope_theta_serves_the_same_tokens(hf_llama_dir, expected,
                                                                                        tmp_path):
    """Llama 3.x on the Hub writes `rope_scaling` and `rope_theta` (transformers 5 writes `rope_parameters`)."""
    legacy = shutil.copytree(hf_llama_dir, tmp_path / "legacy")
    config = json.loads((legacy / "config.json").read_text())
    params = config.pop("rope_parameters", None) or config.pop("rope_scaling")
    config["rope_theta"] = params.pop("rope_theta", config.get("rope_theta"))
    config["rope_scaling"] = params
    assert config["rope_theta"] == 500000.0 and params["rope_type"] == "llama3"
    (legacy / "config.json").write_text(json.dumps(config))
    assert hf_greedy(hf_model(legacy), PROMPTS[3]) == expected("llama")[3]  # transformers reads it the same
    engine = LLMEngine(engine_config(legacy))
    assert [r["token_ids"] for r in engine.generate(PROMPTS[2:], GREEDY)] == expected("llama")[2:]


# --- --tp 2 on gloo ----------------------------------------------------------------------------------------


def tp_rank(model_dirs: dict[str, str]) -> dict:
    """On this rank, for each family: the layer-0 q|k|v projection this rank loaded (weight, bias, where each
    shard's rows start, its head counts), then (rank 0) greedy tokens of a two-rank engine for PROMPTS; the
    other rank follows that engine."""
    from tsdev_runtime import distributed
    from tsdev_runtime.engine.model_runner import Checkpoint, ModelRunner
    from tsdev_runtime.engine.llm_engine import serve_rank

    out = {}
    for name, model_dir in model_dirs.items():
        config = engine_config(model_dir, enforce_eager=True, kv_pages=32, max_model_len=128)
        runner = ModelRunner(config, Checkpoint.open(config))
        attn = runner.model.model.layers[0].self_attn
        qkv = attn.qkv_proj
        out[name] = dict(weight=qkv.weight.tolist(), bias=None if qkv.bias is None else qkv.bias.tolist(),
                         offsets=dict(qkv.shard_offsets), heads=attn.num_heads, kv_heads=attn.num_kv_heads)
        del runner, attn, qkv
        tp = engine_config(model_dir, world_size=2, cudagraph_capture_sizes=[1, 4])
        if distributed.rank() == 0:
            engine = LLMEngine(tp)
            try:
                out[name]["tokens"] = [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)]
            finally:
                engine.control.close()
        else:
            serve_rank(tp)
    return out


@pytest.fixture(scope="module")
def tp2(hf_llama_dir, hf_qwen2_dir, hf_written_dir) -> list[dict]:
    """Both ranks' results (tp_rank) for the three families, from one pair of spawned processes."""
    dirs = {name: str(d) for name, d in zip(FAMILIES, (hf_llama_dir, hf_qwen2_dir, hf_written_dir))}
    return run_ranks(tp_rank, 2, dirs, timeout=240)


@pytest.mark.slow
def test_two_ranks_serve_the_greedy_tokens_of_transformers(family, tp2, expected):
    name, _ = family
    assert tp2[0][name]["tokens"] == expected(name)


def test_each_rank_holds_the_q_rows_of_its_heads_and_the_rows_of_its_key_value_heads(family, tp2):
    """4 query heads of 16: 2 per rank. Key/value heads: Llama's and Qwen3's 2 split (one per rank); Qwen2's one is
    replicated: both ranks hold all of its k and v rows (and biases)."""
    name, model_dir = family
    weights = load_file(model_dir / "model.safetensors")
    layer = "model.layers.0.self_attn"
    kv = ModelConfig.from_dir(model_dir).num_key_value_heads
    d = 16
    for rank, result in enumerate(tp2):
        got = result[name]
        assert got["heads"] == 2 and got["kv_heads"] == 1
        kv_head = rank * kv // 2  # this rank's (first) key/value head: its own of 2, the shared one of 1
        rows = {"q": slice(rank * 2 * d, (rank + 1) * 2 * d), "k": slice(kv_head * d, (kv_head + 1) * d),
                "v": slice(kv_head * d, (kv_head + 1) * d)}
        want_w = torch.cat([weights[f"{layer}.{s}_proj.weight"][r] for s, r in rows.items()])
        assert got["offsets"] == {"q": (0, 2 * d), "k": (2 * d, d), "v": (3 * d, d)}
        assert torch.equal(torch.tensor(got["weight"]), want_w)
        if name == "qwen2":
            want_b = torch.cat([weights[f"{layer}.{s}_proj.bias"][r] for s, r in rows.items()])
            assert torch.equal(torch.tensor(got["bias"]), want_b)
        else:
            assert got["bias"] is None
    kv_rows = [result[name]["weight"][2 * d:] for result in tp2]
    assert (kv_rows[0] == kv_rows[1]) == (kv == 1)  # replicated, or each rank's own head


# --- the Llama checkpoint: eos list, chat template, fp8, sleep/wake, weight updates ----------------------------


def first_free_choice(g1: list[int], g2: list[int]) -> tuple[int, int, int, int]:
    """(a, k1, b, k2): g1 first meets a (of {a, b}) at k1, g2 first meets b at k2, both at 3 or later."""
    for k1 in range(3, len(g1)):
        a = g1[k1]
        if a in g1[:k1]:
            continue
        for k2 in range(3, len(g2)):
            b = g2[k2]
            if b != a and b not in g1[:k1] and b not in g2[:k2] and a not in g2[: k2 + 1]:
                return a, k1, b, k2
    raise AssertionError(f"no pair of eos ids fits these continuations: {g1}, {g2}")


@pytest.mark.slow
def test_the_generation_configs_eos_list_ends_generation_at_either_id(hf_llama_dir, tmp_path):
    assert ModelConfig.from_dir(hf_llama_dir).eos_token_ids == tuple(
        transformers.GenerationConfig.from_pretrained(hf_llama_dir).eos_token_id)
    assert len(ModelConfig.from_dir(hf_llama_dir).eos_token_ids) == 2
    prompts = [PROMPTS[0], PROMPTS[1]]
    free = [hf_greedy(hf_model(hf_llama_dir), p, 16) for p in prompts]
    a, k1, b, k2 = first_free_choice(*free)
    # a copy whose generation_config.json lists [a, b], and whose config.json names another id, one that the first
    # continuation reaches earlier: generation_config.json must win, as in transformers
    other = next(t for t in free[0][:k1] if t not in (a, b))
    copy = shutil.copytree(hf_llama_dir, tmp_path / "eos")
    for file, value in (("generation_config.json", [a, b]), ("config.json", other)):
        data = json.loads((copy / file).read_text())
        (copy / file).write_text(json.dumps({**data, "eos_token_id": value}))
    model = transformers.AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()
    theirs = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
              for p in prompts]
    assert theirs == [free[0][: k1 + 1], free[1][: k2 + 1]]  # transformers stops at a, then at b
    engine = LLMEngine(engine_config(copy))
    until_eos = SamplingParams(max_tokens=16, temperature=0)
    alone = [engine.generate([p], until_eos)[0] for p in prompts]
    batched = engine.generate(prompts, until_eos)
    for out in (alone, batched):
        assert [o["token_ids"] for o in out] == theirs
        assert [o["finish_reason"] for o in out] == ["stop", "stop"]
    ignoring = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o["token_ids"] for o in ignoring] == free


CHAT = [{"role": "system", "content": "Answer in one word. "}, {"role": "user", "content": "What is a llama?"},
        {"role": "assistant", "content": "An animal."}, {"role": "user", "content": "And a qwen?"}]


@pytest.mark.slow
def test_a_chat_requests_prompt_is_the_checkpoints_template_as_transformers_renders_and_tokenizes_it(hf_llama_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_llama_dir)
    assert tokenizer.chat_template == (hf_llama_dir / "chat_template.jinja").read_text()
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|endoftext|><|start_header_id|>system<|end_header_id|>") and "<|im_start|>" not in text
    want = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert len(want) > 64  # the reply's positions are past the llama3 scaling's original length
    model = hf_model(hf_llama_dir)
    reply = hf_greedy(model, want, 8)
    engine = LLMEngine(engine_config(hf_llama_dir))
    with TestClient(build_app(engine, "tiny-llama")) as client:
        tokens = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
        chat = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, "temperature": 0,
                                                         "ignore_eos": True, "return_token_ids": True})
    assert tokens == want
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["usage"]["prompt_tokens"] == len(want)
    assert body["choices"][0]["token_ids"] == reply


def hf_fp8_model(model_dir) -> transformers.PreTrainedModel:
    """transformers' model with every projection (q, k, v, o, gate, up, down; not the embedding or lm_head) running
    the numerics `--quantization fp8` documents: its weight quantized per output row (`quantize_fp8_rows`), the
    product by the CPU references of kernels/tsdev_kernels/ops/fp8.py (weight-only up to SKINNY_ROWS rows, else
    activations quantized per token), through `fp8_linear` itself."""
    model = hf_model(model_dir)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
            values, scales = fp8.quantize_fp8_rows(module.weight.detach())
            module.forward = functools.partial(fp8.fp8_linear, weight=values, weight_scale=scales.view(-1),
                                               bias=module.bias)
    return model


@pytest.mark.slow
def test_fp8_on_the_llama_checkpoint_is_transformers_with_fp8_projections_and_close_to_float32(hf_llama_dir,
                                                                                             expected):
    """Fed the same tokens, the fp8 engine's logits per step (a prefill of 12, 3, 58 and 70 rows: weight-only for
    the 3, activations quantized for the others; then one-row decodes: weight-only) are those of transformers
    with fp8 projections, and so are its greedy tokens: the runtime quantizes exactly the projections, per row of
    each q|k|v and gate|up shard. Against float32 (as tests/test_fp8.py's gates): not equal (quantized), but
    close (cosine similarity of the logits >= 0.98 on average; the top-1 token often the same)."""
    oracle = hf_fp8_model(hf_llama_dir)
    eager = LLMEngine(engine_config(hf_llama_dir, quantization="fp8", enforce_eager=True))
    served = LLMEngine(engine_config(hf_llama_dir, quantization="fp8"))  # prefill graphs' buckets (eager on CPU)
    full = LLMEngine(engine_config(hf_llama_dir))
    linears = [m for m in served.runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 2 and all(m.quantization == "fp8" for m in linears)
    cosines, same, total = [], 0, 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        theirs, their_logits = out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)
        # a prefill of 2-8 tokens runs padded to its prefill bucket (16 rows), where fp8_linear takes the
        # activation-quantized branch: the served engine is compared on the longer prompts only
        for engine in (eager, served) if len(prompt) > fp8.SKINNY_ROWS else (eager,):
            assert engine.generate([prompt], GREEDY)[0]["token_ids"] == theirs
            assert_logits_close(teacher_forced_logits(engine, prompt, theirs[:-1]), their_logits, FP8_ROW)
        ours = teacher_forced_logits(eager, prompt, theirs[:-1])
        exact = teacher_forced_logits(full, prompt, theirs[:-1])
        assert ((ours - exact).abs() > 3 * row_tolerance(exact, FP8_ROW)).any()  # the tolerance tells fp8 apart
        cosines.append(F.cosine_similarity(ours, exact, dim=-1))
        same, total = same + (ours.argmax(-1) == exact.argmax(-1)).sum().item(), total + len(theirs)
    assert torch.cat(cosines).mean() >= 0.98, cosines
    assert same >= 0.5 * total, (same, total)  # measured 34 of 48: random weights of std 0.2, flat logits
    assert [r["token_ids"] for r in full.generate(PROMPTS, GREEDY)] == expected("llama")


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_and_reload_on_the_llama_checkpoint_restore_its_weights_and_tokens(hf_llama_dir, expected, level):
    """Level 1 keeps the weights in host memory, level 2 discards them (reload_weights brings them back); either
    way the checksum (parameters and derived tensors: the llama3-scaled rotary table among them) and the greedy
    tokens are those before sleep."""
    engine = LLMEngine(engine_config(hf_llama_dir))
    checksum = engine.control.checksum()
    assert any("cos_sin" in name for name in checksum) and any(name.startswith("lm_head") for name in checksum)
    assert [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)] == expected("llama")
    freed = engine.control.free_memory(level)
    assert engine.control.memory.sleeping and freed["freed"] > 0
    engine.control.restore_memory()
    assert not engine.control.memory.sleeping
    if level == 2:
        assert not engine.control.weights_loaded and "reload_weights" in engine.control.cannot_step()
        engine.control.load_weights()
    else:
        assert engine.control.checksum() == checksum  # back from host memory, before any reload
        engine.control.load_weights()  # an in-place reload of the same checkpoint changes nothing
    assert engine.control.weights_loaded and engine.control.cannot_step() is None
    assert engine.control.checksum() == checksum
    assert [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)] == expected("llama")


@pytest.mark.slow
def test_a_direct_update_on_the_llama_checkpoint_serves_transformers_tokens_of_the_new_weights(hf_llama_dir,
                                                                                              expected, tmp_path):
    """Every tensor perturbed (the untied lm_head too): after a direct update (no address moves) the engine's
    checksum is a fresh engine's on the new checkpoint and its greedy tokens are transformers' on it; updating
    back restores the original checksum and tokens."""
    b = shutil.copytree(hf_llama_dir, tmp_path / "B")
    tensors = load_file(hf_llama_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(16)
    save_file({n: t + 0.05 * torch.randn(t.shape, generator=generator) for n, t in sorted(tensors.items())},
              b / "model.safetensors", metadata={"format": "pt"})
    on_b = [hf_greedy(hf_model(b), p) for p in PROMPTS]
    assert on_b != expected("llama")
    engine = LLMEngine(engine_config(hf_llama_dir))
    model = engine.runner.model
    addresses = {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    original = engine.control.checksum()
    update = engine.control.load_weights(b, "direct")
    assert update.mode == "direct"
    assert {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]} == addresses
    updated = engine.control.checksum()
    assert updated == LLMEngine(engine_config(b)).control.checksum()
    assert updated["lm_head.weight"] != original["lm_head.weight"]
    assert [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)] == on_b
    engine.control.load_weights(hf_llama_dir, "direct")
    assert engine.control.checksum() == original
    assert [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)] == expected("llama")
