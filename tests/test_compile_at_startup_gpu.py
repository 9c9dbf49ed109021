"""Startup compiles every Triton binary serving can reach (run on the H200: `pytest -m gpu`): after the engine
has started (warm-up and graph captures), a mix of requests that takes every path compiles nothing. A compile
while serving stalls the step it happens in (the H200 runs of 2026-12-01 saw Triton compiling inside timed
engine steps)."""
import importlib
import pkgutil
from contextlib import contextmanager

import pytest
import torch
import triton
from batches import make_batch

from tsdev_runtime.engine.compiles import jit_compiles
from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.weights.default_model import default_model_dir

pytestmark = pytest.mark.gpu


def binaries() -> dict[str, int]:
    """How many binaries each tsdev_kernels.ops kernel has compiled in this process, over all devices."""
    import tsdev_kernels.ops

    counts = {}
    for info in pkgutil.iter_modules(tsdev_kernels.ops.__path__):
        module = importlib.import_module(f"tsdev_kernels.ops.{info.name}")
        for name, kernel in vars(module).items():
            if hasattr(kernel, "device_caches"):
                counts[f"{info.name}.{name}"] = sum(len(cache[0]) for cache in kernel.device_caches.values())
    return counts


@contextmanager
def triton_compiles():
    """The Triton compiles inside the block: each kernel's name and specialisation as Triton's post-compile hook
    reports it (Triton 3.6 and later), else, at the end of the block, the tsdev_kernels.ops kernels with new
    binaries."""
    compiled: list[str] = []
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
        previous = runtime.jit_post_compile_hook

        def hook(**kwargs):
            compiled.append(kwargs["repr"])
            return previous(**kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        try:
            yield compiled
        finally:
            runtime.jit_post_compile_hook = previous
    else:
        before = binaries()
        yield compiled
        compiled += [f"{name}: {count - before.get(name, 0)} new binaries" for name, count in binaries().items()
                     if count > before.get(name, 0)]


def prompt(length: int, seed: int) -> list[int]:
    """Token ids that share no prefix with another seed's (the prefix cache would skip their prefill)."""
    return [(997 * seed + 31 * i) % 50000 + 1 for i in range(length)]


def test_serving_compiles_no_triton_kernel_after_startup():
    engine = LLMEngine(EngineConfig(model=str(default_model_dir("cuda")), device="cuda"))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=1, ignore_eos=True)
    seeds = iter(range(1, 10_000))
    counted = jit_compiles()
    assert sum(counted.values()) > 0  # startup's compiles, counted (tsdev_jit_compiles_total)
    with triton_compiles() as compiled:
        # decode at 1, 17 and 35 sequences outside the graphs (the engine steps eagerly e.g. with a prompt chunk
        # in the batch, or before the graphs are recaptured) and in them (padded to captured sizes); the cached
        # prefixes computed first fit one step's token budget, as a served step's do
        for lengths in ([100], [30 + 5 * i for i in range(17)], [20 + 2 * i for i in range(35)]):
            batch = make_batch(engine, [(n, n - 1) for n in lengths], seed=next(seeds))
            for use_graphs in (False, True):
                engine.runner.sample(engine.runner.compute_logits(batch, use_graphs=use_graphs), batch.seqs)
            for seq in batch.seqs:
                engine.block_manager.free_pages(seq)
        # prefill steps that mix decodes, fresh prompts and cached prefixes, in the prefill graphs and eagerly
        for spec in ([(30, 29), (12, 11), (37, 0), (9, 8)], [(90, 64), (50, 49), (70, 0)], [(16, 0)] * 3):
            batch = make_batch(engine, spec, seed=next(seeds))
            for use_graphs in (True, False):
                engine.runner.compute_logits(batch, use_graphs=use_graphs)
            for seq in batch.seqs:
                engine.block_manager.free_pages(seq)
        # requests: one prompt of ordinary length (7 pages), then decode at batch 1
        engine.generate([prompt(100, next(seeds))], greedy)
        # a prompt within one page; a batch of such prompts; a batch of mixed lengths and sampling
        engine.generate([prompt(5, next(seeds))], sampled)
        engine.generate([prompt(3 + i, next(seeds)) for i in range(8)], greedy)
        engine.generate([prompt(n, next(seeds)) for n in (17, 40, 100, 300, 1000)], [greedy, sampled] * 2 + [greedy])
        # a prompt longer than a step's token budget: chunked, the second chunk after a cached prefix
        engine.generate([prompt(engine.config.max_batched_tokens + 100, next(seeds))], greedy)
        # batched prefill, then decode in the graphs at 17 and 35 sequences
        for size in (17, 35):
            engine.generate([prompt(20 + 7 * i, next(seeds)) for i in range(size)],
                            [greedy, sampled] * (size // 2) + [greedy])
        torch.cuda.synchronize()
    assert not compiled, "Triton compiled while serving:\n" + "\n".join(compiled)
    assert jit_compiles() == counted


def random_params(rng) -> SamplingParams:
    """Greedy or sampled, and now and then logprobs, penalties or a bias: each takes its own kernels."""
    extra = rng.choice([{}, {}, {"logprobs": rng.randint(0, 5)}, {"presence_penalty": 0.5, "repetition_penalty": 1.1},
                        {"logit_bias": {rng.randint(0, 1000): 2.0}}])
    sampled = rng.random() < 0.5
    return SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.8 if sampled else 0, top_k=rng.choice([0, 20]),
                          top_p=rng.choice([1.0, 0.9]), seed=rng.randint(0, 99), ignore_eos=True, **extra)


def test_randomized_requests_after_startup_compile_nothing():
    """Issue 31, point 3: after startup, batches of random sizes with random prompt and output lengths and random
    sampling options compile no Triton kernel -- the engine's own counter (tsdev_jit_compiles_total, every compile
    in the process) does not move. The seed is printed (`-s`) so a failure can be replayed."""
    import random

    seed = random.SystemRandom().randrange(1 << 30)
    print(f"\nseed {seed}")
    rng = random.Random(seed)
    engine = LLMEngine(EngineConfig(model=str(default_model_dir("cuda")), device="cuda"))
    before = jit_compiles()
    seeds = iter(range(20_000, 40_000))
    for _ in range(8):
        size = rng.choice([1, 2, 3, 5, 8, 13, 17, 31, 48, 64, 100, 150])
        budget = 60_000 // size  # tokens a round may prefill: a few seconds at most
        prompts = [prompt(rng.randint(1, min(1500, budget)), next(seeds)) for _ in range(size)]
        engine.generate(prompts, [random_params(rng) for _ in range(size)])
    after = jit_compiles()
    assert after == before, {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
