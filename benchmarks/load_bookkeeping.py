"""The weight loader's per-tensor bookkeeping, apart from moving bytes: a checkpoint with the default model's
structure (28 layers, 311 tensors) but tiny widths, loaded plain on the CPU, so the copies cost next to nothing.

    python3 benchmarks/load_bookkeeping.py            # median of 5 loads, in ms
    python3 benchmarks/load_bookkeeping.py --profile  # and cProfile's top functions of one more load
"""
import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tsdev_runtime.config import ModelConfig
from tsdev_runtime.models import build_model
from tsdev_runtime.weights.default_model import SHAPES, write_checkpoint
from tsdev_runtime.weights.loader import load_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        write_checkpoint(model_dir, {**SHAPES["tiny"], "num_hidden_layers": SHAPES["qwen3-0.6b"]["num_hidden_layers"],
                                     "max_position_embeddings": 1024}, seed=1)
        model = build_model(ModelConfig.from_dir(model_dir), "cpu", torch.float32)
        weights = load_weights(model, model_dir, "plain")  # the first load records the layout
        times = []
        for _ in range(5):
            start = time.perf_counter()
            weights.load(model_dir, "plain")
            times.append(time.perf_counter() - start)
        print(f"{len(list(model.parameters()))} parameters: a load takes {statistics.median(times) * 1e3:.1f} ms "
              f"(median of 5; {', '.join(f'{t * 1e3:.1f}' for t in times)})")
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(weights.load, model_dir, "plain")
            pstats.Stats(profile).sort_stats("cumtime").print_stats(15)


if __name__ == "__main__":
    main()
