"""Prefill graphs on the H200 (`pytest -m gpu`): replay equals eager, padding writes no KV, a reload's edit
reaches the recaptured graphs, a failed capture falls back to eager."""
import asyncio

import pytest
import torch

from batches import CASES, make_batch, written_slots
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.control_protocol import ReloadRequest
from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.prefill_graphs import PrefillGraphs
from tsdev_runtime.engine.sequence import SamplingParams
from test_reload_gpu import STORE, EDITED, EditedSources
from tsdev.hotreload import Reloader

pytestmark = pytest.mark.gpu


def tiny_engine(tiny_model_dir, dtype="float32", **overrides) -> LLMEngine:
    kwargs = dict(model=str(tiny_model_dir), device="cuda", dtype=dtype, kv_pages=512, page_size=4,
                  max_batched_tokens=256, cudagraph_capture_sizes=[1, 4])
    return LLMEngine(EngineConfig(**{**kwargs, **overrides}))


def replayed(engine, batch) -> torch.Tensor:
    """Logits through the bucket's graph, failing if the forward would run eagerly instead."""
    graphs = engine.runner.prefill_graphs
    assert graphs.size_for(batch.total_tokens) in graphs.graphs
    eager = PrefillGraphs._forward_eager
    PrefillGraphs._forward_eager = lambda *a: pytest.fail("ran eagerly instead of replaying")
    try:
        return engine.runner.compute_logits(batch).clone()
    finally:
        PrefillGraphs._forward_eager = eager


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_replay_equals_eager_and_padding_writes_no_kv(tiny_model_dir, dtype, tol):
    engine = tiny_engine(tiny_model_dir, dtype)
    assert sorted(engine.runner.prefill_graphs.graphs) == engine.runner.prefill_graphs.buckets
    kv = engine.runner.kv_cache
    for i, (case, spec) in enumerate(sorted(CASES.items())):
        batch = make_batch(engine, spec, seed=i)
        kv.normal_()  # real-looking contents everywhere, so a stray write would show
        before = kv.clone()
        eager = engine.runner.compute_logits(batch, use_graphs=False).clone()
        eager_kv = kv.clone()
        kv.copy_(before)
        graph = replayed(engine, batch)
        torch.testing.assert_close(graph, eager, rtol=tol, atol=tol, msg=lambda m: f"{case}: {m}")
        if dtype == "float32":  # bf16 near-ties may flip the argmax; the logits tolerance above covers it
            assert torch.equal(graph.argmax(-1), eager.argmax(-1))
        torch.testing.assert_close(kv, eager_kv, rtol=tol, atol=tol)
        changed = (kv != before).flatten(4).any(-1).any(1).any(0)
        assert {tuple(x) for x in changed.nonzero().tolist()} == written_slots(engine, batch), case
        for seq in batch.seqs:
            engine.block_manager.free_pages(seq)


def test_default_model_replay_equals_eager_in_bf16():
    engine = LLMEngine(EngineConfig(model=None, device="cuda", max_running=8, max_model_len=2048, kv_pages=1024,
                                    max_batched_tokens=512, cudagraph_capture_sizes=[1, 8]))
    for i, spec in enumerate([[(200, 0)], [(37, 0), (100, 60), (12, 11)], [(64, 0)] * 8, [(511, 0)]]):
        batch = make_batch(engine, spec, seed=i)
        eager = engine.runner.compute_logits(batch, use_graphs=False).clone()
        graph = replayed(engine, batch)
        # bf16 over 28 layers: a different GEMM tiling for the padded M moves logits by a few hundredths
        assert (graph - eager).abs().max() < 0.1 * eager.abs().max()
        agree = (graph.argmax(-1) == eager.argmax(-1)).float().mean()
        assert agree >= 0.75, spec
        for seq in batch.seqs:
            engine.block_manager.free_pages(seq)


@pytest.mark.parametrize("recapture", [False, True], ids=["patched", "recaptured"])
def test_reload_edit_changes_the_prefill_graphs_output(tiny_model_dir, recapture):
    engine = tiny_engine(tiny_model_dir)
    edit = EditedSources(Reloader(["tsdev_kernels.ops", "tsdev_runtime.layers", "tsdev_runtime.models",
                                   "tsdev_runtime.sampling"]),
                         "tsdev_kernels.ops.activation", STORE, EDITED)
    spec = [(40, 0), (25, 10)]
    batch = make_batch(engine, spec)
    before = replayed(engine, batch)

    async def reload(rid):
        ae = AsyncEngine(engine)
        engine.control.allow_reloads(edit)
        await ae.start()
        try:
            return await engine.control.reload_forward(ReloadRequest(id=rid, recapture=recapture))
        finally:
            await ae.stop()

    reply = asyncio.run(reload("edit"))
    assert reply.ok, reply
    timings = reply.workers[0].timings
    if recapture:
        assert timings["recapture_prefill"] > 0 and timings["recapture_decode"] > 0
    else:  # a kernel-body edit: the prefill graphs' pieces (and the decode graphs) run the new binary, not captured
        assert reply.workers[0].graph_nodes_patched > 0 and "recapture_prefill" not in timings
    edited = replayed(engine, batch)
    assert (edited - before).abs().max() > 1e-3
    torch.testing.assert_close(edited, engine.runner.compute_logits(batch, use_graphs=False), rtol=1e-4, atol=1e-4)
    edit.active = False
    assert asyncio.run(reload("revert")).ok
    torch.testing.assert_close(replayed(engine, batch), before, rtol=1e-4, atol=1e-4)


def test_a_capture_failure_falls_back_to_eager_prefill_with_a_warning(tiny_model_dir, monkeypatch, capsys):
    from tsdev_runtime.layers.activation import SiluAndMul

    forward = SiluAndMul.forward

    def syncs_in_prefill(self, x):  # a layer that waits on the GPU: legal eagerly, illegal in a capture
        if x.shape[0] > 4:
            torch.cuda.synchronize()
        return forward(self, x)

    monkeypatch.setattr(SiluAndMul, "forward", syncs_in_prefill)
    engine = tiny_engine(tiny_model_dir)
    assert engine.runner.prefill_graphs.disabled and engine.runner.prefill_graphs.graphs == {}
    assert sorted(engine.runner.decode_graphs.graphs) == [1, 4]
    assert "prefill runs eagerly" in capsys.readouterr().err
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11, 12]]
    tokens = [r["token_ids"] for r in engine.generate(prompts, greedy)]
    eager = tiny_engine(tiny_model_dir, enforce_eager=True).generate(prompts, greedy)
    assert tokens == [r["token_ids"] for r in eager]
