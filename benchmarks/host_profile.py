"""Where the host time of an engine step goes: cProfile of eager prefill forwards and of decode steps.

    python3 benchmarks/host_profile.py            # default model on CUDA
    python3 benchmarks/host_profile.py --top 40

Prints the functions with the most own time (tottime) for (1) eager forwards of a 16-token prompt
(launch-bound: what prefill graphs save), on a model runner this benchmark builds and owns, and (2)
engine steps decoding a batch of --batch sequences, on an engine built once that runner is freed.
"""
import argparse
import cProfile
import gc
import pstats
import time

import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.model_runner import Checkpoint, ModelRunner
from tsdev_runtime.engine.scheduler import ScheduledBatch
from tsdev_runtime.engine.sequence import SamplingParams, Sequence


def report(profile: cProfile.Profile, title: str, top: int) -> None:
    print(f"\n=== {title}")
    pstats.Stats(profile).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = EngineConfig(model=None, device=device, max_running=args.batch, max_model_len=2048)

    runner = ModelRunner(config, Checkpoint.open(config))
    runner.warmup()
    seq = Sequence("p", list(range(1, 17)), SamplingParams(max_tokens=1))
    seq.pages = runner.scratch_pages[:1]  # 16 tokens: one page of a runner with no page manager
    batch = ScheduledBatch([seq], [16])
    for _ in range(3):
        runner.compute_logits(batch, use_graphs=False)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(20):
        runner.compute_logits(batch, use_graphs=False)
    profile.disable()
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"eager 16-token forward: {1e3 * (time.perf_counter() - start) / 20:.2f} ms each (under cProfile)")
    report(profile, "eager 16-token prefill forward x 20", args.top)
    del runner, batch, seq  # the engine sizes its KV pool to the memory left
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    engine = LLMEngine(config)
    prompts = [[(i * 7 + j) % 5000 + 1 for j in range(200)] for i in range(args.batch)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=args.steps + 50, temperature=0.6, ignore_eos=True))
    engine.prefill_all()
    for _ in range(5):
        engine.step()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    print(f"\ndecode step at batch {args.batch}: {1e3 * (time.perf_counter() - start) / args.steps:.2f} ms each "
          "(under cProfile)")
    report(profile, f"engine.step x {args.steps}, batch {args.batch}", args.top)


if __name__ == "__main__":
    main()
