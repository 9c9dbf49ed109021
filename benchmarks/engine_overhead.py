"""The host work per step with the model stubbed out: the engine's loop (scheduling, bookkeeping, token ids out) and,
apart, what consumes its outputs (detokenizing, stop strings, the requests' outputs: off the loop).

    python3 benchmarks/engine_overhead.py                  # batch 256, tiny checkpoint, CPU
    python3 benchmarks/engine_overhead.py --profile        # plus the top functions (cProfile)
    python3 benchmarks/engine_overhead.py --unknown-tokens # ids beyond the tokenizer: nothing to decode
    python3 benchmarks/engine_overhead.py --gpu-ms 3       # LLMEngine.generate against a GPU that takes 3 ms a step
                                                           # and the served engine's loop (AsyncEngine) the same

The model runner's `launch` is replaced (on its class, after the engine has started) by one that returns
random tokens of the tokenizer at once (decoded as text, as a real model's are), so what is left is the Python that
every real step also pays before and after the GPU's work; on a GPU it adds to each step's time unless overlapped.

With --gpu-ms, a step's tokens are ready that long after its launch (reading them sleeps until then, releasing the
interpreter lock as waiting on a CUDA event does), and the figure is offline `LLMEngine.generate`'s time per step:
what the host adds to the GPU's time once the two overlap; then the same requests through the engine process's
loop (AsyncEngine, each step's StepOutputs pickled as for the API process).
"""
import argparse
import asyncio
import cProfile
import pstats
import random
import tempfile
import time
from pathlib import Path

import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine import llm_engine
from tsdev_runtime.engine.async_engine import AsyncEngine
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.model_runner import ModelRunner
from tsdev_runtime.engine.outputs import OutputProcessor
from tsdev_runtime.engine.sequence import SamplingParams
from tsdev_runtime.engine.wire import frame
from tsdev_runtime.sampling.sampler import Sampled
from tsdev_runtime.weights.default_model import SHAPES, write_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--unknown-tokens", action="store_true",
                        help="the stub samples an id beyond the tokenizer (decodes to nothing) instead of random text")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--gpu-ms", type=float, default=None,
                        help="time LLMEngine.generate against a simulated GPU taking this long per step")
    args = parser.parse_args()

    model_dir = Path(tempfile.mkdtemp(prefix="tsdev-overhead-"))
    write_checkpoint(model_dir, {**SHAPES["tiny"], "max_position_embeddings": 2048})
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", max_running=args.batch, max_model_len=2048,
                                    kv_pages=args.batch * 130, enforce_eager=True))
    rng, processor = random.Random(0), OutputProcessor(engine.tokenizer)
    if args.gpu_ms is not None:
        return simulated_gpu(engine, args, rng)
    for i in range(args.batch):
        params = SamplingParams(max_tokens=args.steps + 50, temperature=0.6, ignore_eos=True)
        engine.add_request(str(i), [rng.randrange(800) for _ in range(100)], params)
        processor.add(str(i), 100, params)
    vocab, draws = engine.tokenizer.get_vocab_size(), torch.Generator().manual_seed(0)

    def stub(self, batch, in_flight=None):
        rows = sum(batch.sample_rows)
        if args.unknown_tokens:
            return Sampled(torch.full((rows,), vocab + 100))
        return Sampled(torch.randint(3, vocab, (rows,), generator=draws))  # 0-2: the tiny tokenizer's specials

    ModelRunner.launch = stub
    for _ in range(10):
        processor.process(engine.step())
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    loop = consume = 0.0
    for _ in range(args.steps):
        start = time.perf_counter()
        step = engine.step()
        middle = time.perf_counter()
        processor.process(step)
        loop, consume = loop + middle - start, consume + time.perf_counter() - middle
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    print(f"engine loop: {loop / args.steps * 1e3:.2f} ms per step at batch {args.batch} (model stubbed out); "
          f"its outputs' consumer (detokenizing, stop strings, request outputs): "
          f"{consume / args.steps * 1e3:.2f} ms per step")


def simulated_gpu(engine: LLMEngine, args, rng: random.Random) -> None:
    """LLMEngine.generate's time per step when each step's GPU work takes `args.gpu_ms`, one step after another."""
    vocab, draws, gpu = engine.tokenizer.get_vocab_size(), torch.Generator().manual_seed(0), {"free_at": 0.0}

    def stub(self, batch, in_flight=None):
        sampled = Sampled(torch.randint(3, vocab, (sum(batch.sample_rows),), generator=draws))
        gpu["free_at"] = max(time.perf_counter(), gpu["free_at"]) + args.gpu_ms / 1e3
        sampled.ready_at = gpu["free_at"]
        return sampled

    read = llm_engine._Launched.read

    def wait_then_read(self):
        if self.sampled is not None:
            time.sleep(max(0.0, self.sampled.ready_at - time.perf_counter()))  # (a CUDA event's wait)
        return read(self)

    ModelRunner.launch, llm_engine._Launched.read = stub, wait_then_read
    prompts = [[rng.randrange(800) for _ in range(100)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.steps, temperature=0.6, ignore_eos=True)
    engine.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm
    steps, start = engine.num_steps, time.perf_counter()
    engine.generate(prompts, params)
    ms = (time.perf_counter() - start) / (engine.num_steps - steps) * 1e3
    print(f"LLMEngine.generate: {ms:.2f} ms per step at batch {args.batch} against a simulated GPU of "
          f"{args.gpu_ms:.2f} ms per step: the host adds {ms - args.gpu_ms:+.2f} ms")
    ms = asyncio.run(served(engine, prompts, params))
    print(f"the served engine's loop (AsyncEngine, outputs pickled for the API process): {ms:.2f} ms per step: the "
          f"host adds {ms - args.gpu_ms:+.2f} ms")


async def served(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Milliseconds per step of the engine process's loop running `prompts` as the API process's requests."""
    engine_loop = AsyncEngine(engine)
    await engine_loop.start()
    left, done = {str(i) for i in range(len(prompts))}, asyncio.Event()

    def to_the_api_process(step, failed) -> None:
        frame(("step", step))
        left.difference_update(step.finished)
        if not left:
            done.set()

    engine_loop.remote = to_the_api_process
    steps, start = engine.num_steps, time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine_loop.add_request(str(i), prompt, params, time.monotonic(), None, print)
    await done.wait()
    ms = (time.perf_counter() - start) / (engine.num_steps - steps) * 1e3
    await engine_loop.shutdown()
    await engine_loop.stop()
    return ms


if __name__ == "__main__":
    main()
