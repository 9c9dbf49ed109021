"""reload_forward on the GPU: an edited Triton kernel runs in the patched graphs; nothing recompiles after; a layer's
__init__ edit rebuilds the default model in place of a restart."""
import asyncio
import sys
import time

import pytest

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.control_protocol import ReloadRequest
from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev.hotreload import Reloader

pytestmark = pytest.mark.gpu
STORE = "    return act * up\n"
EDITED = "    return -act * up\n"


class EditedSources:
    """A reloader whose sources carry an edit (`old` -> `new`, then each of `more` pairs), as if the file had been
    saved."""

    def __init__(self, reloader: Reloader, module: str, old: str, new: str, *more: tuple[str, str]):
        self.reloader, self.module, self.edits = reloader, module, [(old, new), *more]
        self.active = True

    def read_sources(self):
        sources = self.reloader.read_sources()
        if self.active:
            text = sources[self.module].decode()
            for old, new in self.edits:
                assert old in text
                text = text.replace(old, new)
            sources[self.module] = text.encode()
        return sources

    def plan(self, sources=None, modules=None):
        return self.reloader.plan(sources=sources, modules=modules)

    def reload(self, modules=None, sources=None):
        return self.reloader.reload(modules=modules, sources=sources)

    def modules(self):
        return self.reloader.modules()

    def compile_ahead(self, sources=None, modules=None):
        return self.reloader.compile_ahead(sources, modules)


def compiled_kernels() -> int:
    """Binaries in the in-memory caches of every Triton kernel in tsdev_kernels.ops."""
    total = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("tsdev_kernels.ops"):
            continue
        for obj in vars(module).values():
            for cache in getattr(obj, "device_caches", {}).values():
                total += len(cache[0])
    return total


async def greedy(ae: AsyncEngine, rid: str) -> list[int]:
    tokens = []
    async for out in ae.generate(rid, [5, 17, 300, 42, 9, 77],
                                 SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)):
        tokens += out.new_token_ids
    return tokens


def replay_and_eager(engine: LLMEngine, lengths: list[int]):
    """A decode batch's logits from its graph (which must exist) and eagerly; its pages freed after."""
    from batches import decode_batch

    graphs = engine.runner.decode_graphs
    batch, used = decode_batch(engine, lengths), set(graphs.used)
    size = next(s for s in graphs.sizes if s >= len(lengths))
    assert size in graphs.graphs
    graph = engine.runner.compute_logits(batch).clone()
    eager = engine.runner.compute_logits(batch, use_graphs=False).clone()
    graphs.used = used  # a check, not the workload: the next reload must not count this size as used
    for seq in batch.seqs:
        engine.block_manager.free_pages(seq)
    return graph, eager


@pytest.mark.parametrize("full_recapture", [False, True], ids=["deferred", "full"])
def test_edited_kernel_runs_in_the_captured_graphs_and_nothing_recompiles(tiny_model_dir, full_recapture):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", kv_pages=256,
                                    cudagraph_capture_sizes=[1, 2, 4], full_recapture=full_recapture))
    edit = EditedSources(Reloader(["tsdev_kernels.ops", "tsdev_runtime.layers", "tsdev_runtime.models",
                                   "tsdev_runtime.sampling"]),
                         "tsdev_kernels.ops.activation", STORE, EDITED)

    async def scenario():
        ae = AsyncEngine(engine)
        await ae.start()
        engine.control.allow_reloads(edit)
        reload = engine.control.reload_forward
        before = await greedy(ae, "a")
        old_graph, _ = await ae.run_on_engine_thread(lambda: replay_and_eager(engine, [5, 9, 14]))  # size 4
        reply = await reload(ReloadRequest(id="r1"))
        assert reply.ok, reply
        assert reply.workers[0].reloaded == ["tsdev_kernels.ops.activation"]
        assert reply.workers[0].jit_kernels >= 1  # the edited kernel was compiled ahead, before the drain
        assert reply.workers[0].warnings == []
        assert reply.workers[0].kernels_only  # a kernel body edit: binaries loaded in the reload, no warm-up run
        # ... and no capture (unless full_recapture): the captured graphs' nodes of the edited kernel now launch its
        # new binary
        patched = reply.workers[0].graph_nodes_patched
        assert (patched == 0) == full_recapture and ("recapture_decode" in reply.workers[0].timings) == full_recapture
        compiled = compiled_kernels()
        after = await greedy(ae, "b")  # decode steps replay the recaptured batch-1 graph
        await ae.run_on_engine_thread(engine.control.ranked.warmup)  # every kernel of every shape startup warms
        assert compiled_kernels() == compiled  # the reload loaded every binary they need: none compiled
        for _ in range(500):  # deferred: the sizes the steps did not use are captured while the engine idles
            if not engine.runner.graphs_pending:
                break
            await asyncio.sleep(0.01)
        assert engine.runner.graphs_pending == 0
        new_graph, new_eager = await ae.run_on_engine_thread(lambda: replay_and_eager(engine, [5, 9, 14]))
        # the size-4 graph (patched; captured after serving resumed with full_recapture) runs the edited kernel
        gap = (new_graph - new_eager).abs().max()
        assert gap <= 0.02 * new_eager.abs().max() and (new_graph - old_graph).abs().max() > 10 * gap
        edit.active = False
        reverted = await reload(ReloadRequest(id="r2"))
        assert reverted.ok and (reverted.workers[0].graph_nodes_patched == 0) == full_recapture
        restored = await greedy(ae, "c")
        await ae.stop()
        return before, after, restored

    before, after, restored = asyncio.run(scenario())
    assert after != before
    assert restored == before


NORM_WEIGHT = "        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)\n"
NORM_SCALED = NORM_WEIGHT + '        self.register_buffer("scale", torch.full((hidden_size,), 2.0), persistent=False)\n'
NORM_FORWARD = "            return norm_ops.rms_norm(x, self.weight, self.eps)\n"


def test_layer_init_edit_rebuilds_the_default_model_without_a_restart():
    """A buffer added in RMSNorm.__init__ (and used by forward): the reload rebuilds the model with the new code, loads
    the served weights again, recaptures, and serves the edit; reverting rebuilds back to the original output."""
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=None, device="cuda", kv_pages=4096, max_running=64))
    restart = time.perf_counter() - start
    edit = EditedSources(Reloader(["tsdev_kernels.ops", "tsdev_runtime.layers", "tsdev_runtime.models",
                                   "tsdev_runtime.sampling"]),
                         "tsdev_runtime.layers.norm", NORM_WEIGHT, NORM_SCALED,
                         (NORM_FORWARD,
                          "            return norm_ops.rms_norm(x, self.weight * self.scale, self.eps)\n"))

    async def scenario():
        ae = AsyncEngine(engine)
        await ae.start()
        engine.control.allow_reloads(edit)
        reload = engine.control.reload_forward
        before = await greedy(ae, "a")
        start = time.perf_counter()
        reply = await reload(ReloadRequest(id="r1"))
        seconds = time.perf_counter() - start
        assert reply.ok, reply
        worker = reply.workers[0]
        assert "model.norm" in worker.rebuilt and worker.needs_restart == [] and "rebuild" in worker.timings
        after = await greedy(ae, "b")
        edit.active = False
        back = await reload(ReloadRequest(id="r2"))
        assert back.ok and back.workers[0].rebuilt, back
        restored = await greedy(ae, "c")
        await ae.stop()
        print(f"\nlayer __init__ edit on the default model: reload {seconds:.3f} s (rebuild "
              f"{worker.timings['rebuild']:.3f} s; steps {worker.timings}) vs an in-process restart {restart:.3f} s "
              f"({restart / seconds:.1f}x)")
        return before, after, restored

    before, after, restored = asyncio.run(scenario())
    assert after != before
    assert restored == before
