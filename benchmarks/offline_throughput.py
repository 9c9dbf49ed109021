"""Offline throughput of the engine: the nano-vllm workload (random prompt and output lengths, ignore_eos).

    python3 benchmarks/offline_throughput.py --device cuda            # 256 requests, lengths 100..1024
    python3 benchmarks/offline_throughput.py --num-requests 16 --max-len 128   # a quick CPU run
"""
import argparse
import random
import time

import torch

from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.sequence import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_running=args.max_running,
                                    max_model_len=2 * args.max_len + 1))
    rng = random.Random(args.seed)
    vocab = min(engine.model_config.vocab_size, 10_000)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))] for _ in range(args.num_requests)]
    params = [SamplingParams(max_tokens=rng.randint(args.min_len, args.max_len), temperature=0.6, ignore_eos=True)
              for _ in range(args.num_requests)]
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out_tokens = sum(len(r["token_ids"]) for r in results)
    in_tokens = sum(map(len, prompts))
    print(f"{args.num_requests} requests, {in_tokens} prompt + {out_tokens} output tokens in {seconds:.2f} s: "
          f"{out_tokens / seconds:,.0f} output tok/s, {(in_tokens + out_tokens) / seconds:,.0f} total tok/s "
          f"({args.device}, {engine.model_dir.name})")


if __name__ == "__main__":
    main()
