"""Weight update vs restart, and the checksum's cost (issue 16), on an in-process engine.

    python3 benchmarks/update_weights.py                       # the default model (CUDA: Qwen3-0.6B shape, bf16)
    python3 benchmarks/update_weights.py --quantization fp8 --rounds 5
    python3 benchmarks/update_weights.py --device cpu          # the tiny model (a smoke run)

Restart = building a fresh engine (load, warm-up, graph capture), the cost a server restart adds to the process
start. Each round updates A -> B -> A: `direct` (in place, graphs kept; the addresses are checked unchanged) and
`full` (graphs recaptured), then times GET weights_checksum's work (parameters and persistent buffers). Prints
one JSON line per measurement and a summary with the ratios (docs/benchmarks.md's rule: ratios from one run).
"""
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.weights.default_model import SHAPES, write_checkpoint


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = EngineConfig(model=None, device=args.device, quantization=args.quantization)
    times: dict[str, list[float]] = {"restart": [], "direct": [], "full": [], "checksum": []}

    def record(kind: str, seconds: float, detail: str = "") -> None:
        times[kind].append(seconds)
        print(json.dumps({"kind": kind, "seconds": round(seconds, 4), "device": args.device,
                          "quantization": args.quantization, **({"load": detail} if detail else {})}), flush=True)

    start = time.perf_counter()
    engine = LLMEngine(config)
    record("restart", time.perf_counter() - start)
    a = engine.model_dir
    with tempfile.TemporaryDirectory() as tmp:
        b = Path(tmp)
        write_checkpoint(b, SHAPES["qwen3-0.6b" if args.device.startswith("cuda") else "tiny"], seed=2)
        model = engine.model
        before = [t.data_ptr() for t in [*model.parameters(), *model.buffers()]]
        for _ in range(args.rounds):
            for target in (b, a):
                start = time.perf_counter()
                update = engine.control.load_weights(target, "direct")
                sync(args.device)
                record("direct", time.perf_counter() - start, str(update.load))
            assert [t.data_ptr() for t in [*model.parameters(), *model.buffers()]] == before, "an address moved"
            start = time.perf_counter()
            engine.control.load_weights(a, "full")
            sync(args.device)
            record("full", time.perf_counter() - start)
            start = time.perf_counter()
            engine.control.checksum(derived=False)
            record("checksum", time.perf_counter() - start)
        del engine
        for _ in range(args.rounds - 1):
            start = time.perf_counter()
            LLMEngine(config)
            record("restart", time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"summary": {k: round(v, 4) for k, v in med.items()},
                      "restart_over_direct": round(med["restart"] / med["direct"], 2),
                      "restart_over_full": round(med["restart"] / med["full"], 2)}))


if __name__ == "__main__":
    main()
