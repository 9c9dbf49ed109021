"""DeepSeek-V2 (q_proj, softmax routing, two shared experts) and -V3 (q LoRA, grouped sigmoid routing with the
correction bias, YaRN with mscale, a dense first layer) on tiny checkpoints that transformers itself wrote serve
transformers' greedy tokens (float32, CPU): alone, batched, across chunked prefill, behind a warm prefix cache and
under --tp 2 on gloo; the KV pool holds one latent row per token and layer, and W_UK / W_UV are kv_b_proj's rows."""
import pytest
import torch
from safetensors.torch import load_file

from ranks import on_rank0_engine, run_ranks
from test_model_families import engine_config, hf_greedy, hf_model
from tsdev_runtime.context import get_context
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.layers.attention import LatentAttention
from tsdev_runtime.models.deepseek import DeepseekMoE

FAMILIES = {"v2": "hf_deepseek_v2_dir", "v3": "hf_deepseek_v3_dir"}
PROMPTS = [[5, 17, 300, 42, 9, 77, 123, 4, 8, 15, 16, 23], [200, 201, 202],
           [(13 * j + 1) % 1000 + 3 for j in range(40)]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
CHUNKED = [PROMPTS[2] + [7, 8, 9], PROMPTS[2] + list(range(10, 22))]  # the second: a cached prefix, a two-chunk tail


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, request.getfixturevalue(FAMILIES[request.param])


@pytest.fixture(scope="module")
def oracle(family):
    return hf_model(family[1])


@pytest.fixture(scope="module")
def expected(oracle) -> list[list[int]]:
    return [hf_greedy(oracle, p, GREEDY.max_tokens) for p in PROMPTS]


def test_the_pool_keeps_one_latent_row_per_token_and_layer_and_w_uk_w_uv_are_kv_b_projs_rows(family):
    name, model_dir = family
    engine = LLMEngine(engine_config(model_dir))
    layers, pool = engine.runner.model.model.layers, engine.runner.kv_cache
    assert pool.shape[:2] == (2, 1) and pool.shape[3:] == (4, 1, 32 + 8)  # layers, one cache, page 4, latent | rope
    assert all(isinstance(layer.self_attn.attn, LatentAttention) for layer in layers)
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in layers] == ([True, True] if name == "v2" else [False, True])
    attention = layers[1].self_attn
    kv_b = load_file(model_dir / "model.safetensors")["model.layers.1.self_attn.kv_b_proj.weight"].view(4, 32, 32)
    assert torch.equal(attention.w_uk, kv_b[:, :16]) and torch.equal(attention.w_uv, kv_b[:, 16:].transpose(1, 2))


def test_greedy_tokens_equal_transformers_alone_and_batched(family, expected):
    assert len({tuple(e) for e in expected}) == len(expected)
    engine = LLMEngine(engine_config(family[1]))
    for prompt, want in zip(PROMPTS, expected):
        assert engine.generate([prompt], GREEDY)[0]["token_ids"] == want
    assert [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)] == expected


def test_chunked_prefill_and_a_warm_prefix_cache_serve_transformers_tokens(family, oracle):
    engine = LLMEngine(engine_config(family[1], max_batched_tokens=7))
    chunks, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        chunks.append(batch.total_tokens)
        return batch

    engine.scheduler.schedule = recording_schedule
    first, second = CHUNKED
    assert engine.generate([first], GREEDY)[0]["token_ids"] == hf_greedy(oracle, first, GREEDY.max_tokens)
    assert chunks[:6] == [7, 7, 7, 7, 7, 7]  # 43 prompt tokens in chunks of at most 7
    hits, chunks[:] = engine.block_manager.hits, []
    out = engine.generate([second], GREEDY)[0]["token_ids"]
    assert engine.block_manager.hits - hits >= len(PROMPTS[2]) // 4 - 1  # the shared prefix's pages, from the cache
    assert chunks[0] == 7 and chunks[1] > 1  # the uncached tail took two prefill chunks
    assert out == hf_greedy(oracle, second, GREEDY.max_tokens)


def tp_rank(model_dir: str) -> dict | None:
    def inspect(engine):
        attention = engine.runner.model.model.layers[1].self_attn
        tokens = [r["token_ids"] for r in engine.generate(PROMPTS, GREEDY)]
        hits = engine.block_manager.hits
        chunked = [engine.generate([prompt], GREEDY)[0]["token_ids"] for prompt in CHUNKED]
        return dict(tokens=tokens, chunked=chunked, hits=engine.block_manager.hits - hits,
                    heads=attention.num_heads, w_uk=tuple(attention.w_uk.shape),
                    pool=tuple(engine.runner.kv_cache.shape[3:]))
    config = engine_config(model_dir, world_size=2, cudagraph_capture_sizes=[1, 4], max_batched_tokens=16)
    return on_rank0_engine(config, inspect)


@pytest.mark.slow
def test_two_ranks_split_the_heads_and_serve_the_greedy_tokens_of_transformers(family, oracle, expected):
    """Also in chunks of at most 16 tokens and behind a warm prefix cache."""
    rank0, _ = run_ranks(tp_rank, 2, str(family[1]), timeout=240)
    assert rank0["heads"] == 2 and rank0["w_uk"] == (2, 16, 32)  # half of the 4 heads; the whole latent
    assert rank0["pool"] == (4, 1, 40)  # every rank caches the same latent rows
    assert rank0["tokens"] == expected
    assert rank0["hits"] >= 2 * (len(PROMPTS[2]) // 4 - 1)  # both CHUNKED prompts found the shared prefix's pages
    assert rank0["chunked"] == [hf_greedy(oracle, prompt, GREEDY.max_tokens) for prompt in CHUNKED]


# --- what reloads: an edit of the MLA kernel module, and weights after sleep(2) --------------------------------------


@pytest.mark.slow
def test_an_edit_of_the_mla_kernel_changes_the_output_and_its_revert_restores_it_bit_for_bit(hf_deepseek_v3_dir):
    """The edit halves the attention's softmax scale in the MLA module's reference (what the CPU runs)."""
    from test_moe_model import logits_edited_and_reverted

    old = 'torch.einsum("qhd,kd->hqk", q[start:end].float(), rows) * scale'
    engine = LLMEngine(engine_config(hf_deepseek_v3_dir))
    before, edited, after = logits_edited_and_reverted(engine, "tsdev_kernels.ops.mla", old, old + " * 0.5",
                                                       PROMPTS[0], [7, 8, 9])
    assert not torch.allclose(edited, before, atol=1e-3)
    assert torch.equal(after, before)


@pytest.mark.slow
def test_the_drill_holds_on_deepseek_and_catches_absorbed_tensors_rebuilt_into_new_storage(hf_deepseek_v3_dir,
                                                                                          monkeypatch):
    """Three rounds of sleep(2) -> wake -> reload_weights: every parameter and buffer (W_UK and W_UV too) equal to
    the fresh load, greedy output equal. The negative control derives W_UK / W_UV into new tensors at the reload, as
    an MLA backend that rebuilds them would (graphs would go on reading the freed ones): the drill must fail."""
    from tsdev_runtime.engine.weights_drill import DrillFailed, drill
    from tsdev_runtime.weights.processing import DEBUG_DERIVED_ENV

    engine = LLMEngine(engine_config(hf_deepseek_v3_dir))
    assert any(name.endswith("self_attn.w_uk") for name in engine.control.checksum())  # the drill compares them
    report = drill(engine, rounds=3)
    assert report.rounds == 3
    monkeypatch.setenv(DEBUG_DERIVED_ENV, "rebuild")
    with pytest.raises(DrillFailed, match="rebound w_uk, w_uv"):
        drill(engine, rounds=1)


def test_the_embedded_mla_default_serves_without_a_checkpoint_as_transformers_reads_it(monkeypatch, tmp_path):
    from test_cli import engine_config as serve_config

    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path))
    assert serve_config(monkeypatch, "--model", "default-mla").model == "default-mla"
    engine = LLMEngine(engine_config("default-mla", max_model_len=256))
    assert engine.model_config.architecture == "DeepseekV3ForCausalLM" and engine.model_dir.parent == tmp_path
    ours = engine.generate([PROMPTS[0]], GREEDY)[0]["token_ids"]
    assert ours == hf_greedy(hf_model(engine.model_dir), PROMPTS[0], GREEDY.max_tokens)


def test_long_prompts_attend_in_the_expanded_form_to_the_same_tokens(family, oracle, monkeypatch):
    """A step whose every sequence brings at least EXPANDED_MIN_ROWS rows expands the cached rows into per-head keys
    and values (here from 4 rows): prompts alone and behind a warm prefix give transformers' tokens."""
    expanded = []
    original = LatentAttention.attend_expanded

    def counting(self, *args):
        expanded.append(get_context().max_q_len)
        return original(self, *args)

    monkeypatch.setattr(LatentAttention, "EXPANDED_MIN_ROWS", 4)
    monkeypatch.setattr(LatentAttention, "attend_expanded", counting)
    engine = LLMEngine(engine_config(family[1]))
    shared = PROMPTS[2]
    for prompt in (PROMPTS[0], shared + [7, 8, 9], shared + [10, 11, 12, 13, 14]):
        expanded.clear()
        assert engine.generate([prompt], GREEDY)[0]["token_ids"] == hf_greedy(oracle, prompt, GREEDY.max_tokens)
        assert expanded and min(expanded) >= 4  # the prefill expanded (in every layer), the decodes absorbed
    assert engine.block_manager.hits > 0  # the last prompt's prefix came from the cache


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_the_v2_router_chooses_and_weighs_as_transformers(method):
    """DeepSeek-V2's softmax routing (the full V2 routes within its best groups): the same experts and weights as
    transformers' router on fresh random tokens, in float32."""
    import transformers

    from tsdev_runtime.moe.router import SoftmaxRouter

    config = transformers.DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                                           topk_method=method, n_group=4, topk_group=2, routed_scaling_factor=1.5)
    theirs = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, 32, generator=g))
    ours = SoftmaxRouter(32, 16, 4, 1.5, method, 4, 2)
    ours.weight.data.copy_(theirs.weight.data)
    x = torch.randn(64, 32, generator=g)
    _, want_weights, want_ids = theirs(x)
    weights, ids = ours(x)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values.long(), want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))
