"""Where an engine's start goes, by function: cProfile of `LLMEngine(config)` on the default model (checkpoint, load,
warm-up, capture), in this process. Run it twice: a machine's first start compiles every kernel; the next reads
them from Triton's disk cache, as a standby's restart does.

    python3 benchmarks/startup_profile.py; python3 benchmarks/startup_profile.py --top 40
"""
import argparse
import cProfile
import pstats
import time

import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    engine = LLMEngine(EngineConfig(model=None, device=device))
    profile.disable()
    split = ", ".join(f"{name} {seconds:.2f}" for name, seconds in engine.startup_timings.items()
                      if isinstance(seconds, float))
    print(f"LLMEngine(...) in {time.perf_counter() - start:.2f} s under cProfile: {split}")
    for order in ("cumulative", "tottime"):
        print(f"\n=== by {order}")
        pstats.Stats(profile).sort_stats(order).print_stats(args.top)


if __name__ == "__main__":
    main()
