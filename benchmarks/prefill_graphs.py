"""Prefill forward time, eager vs breakable prefill graphs, in one run; capture time and pool memory.

    python3 benchmarks/prefill_graphs.py              # default model on CUDA, default ladder (16..2048)
    python3 benchmarks/prefill_graphs.py --ttft       # also TTFT with `tsdev bench` against two servers

Each forward is one model-runner `compute_logits` of fresh prompts (host prep, forward, logits of the
sampled rows) followed by a sync, so launch overhead counts as it does when serving. "batch 8" splits the
same token count over 8 prompts. The runner and its page manager are this benchmark's own (no engine).
"""
import argparse
import gc
import statistics
import subprocess
import sys
import time

import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.block_manager import BlockManager
from tsdev_runtime.engine.model_runner import Checkpoint, ModelRunner
from tsdev_runtime.engine.scheduler import ScheduledBatch
from tsdev_runtime.engine.sequence import SamplingParams, Sequence


def fresh_batch(pages: BlockManager, total: int, num_seqs: int) -> ScheduledBatch:
    seqs = []
    for i in range(num_seqs):
        n = total // num_seqs + (i < total % num_seqs)
        seq = Sequence(f"b{i}", [(7 * i + 13 * j) % 20000 + 1 for j in range(n)], SamplingParams(max_tokens=1))
        assert pages.allocate(seq, n)
        seqs.append(seq)
    return ScheduledBatch(seqs, [len(s) for s in seqs])


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)


def ttft(extra: list[str], port: int, args) -> str:
    """Mean/median TTFT line of `tsdev bench` at concurrency 1 against a fresh server."""
    import tempfile
    from pathlib import Path

    from tsdev.launch.child import ServerProcess

    model = [args.model] if args.model else []
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess([*model, *extra], port, log_path=Path(tmp) / "serve.log")
        with server.running(stop_timeout=60):
            out = subprocess.run([sys.executable, "-m", "tsdev", "bench", "--url", server.url,
                                  "--num-prompts", str(args.ttft_prompts), "--input-len", str(args.ttft_input_len),
                                  "--output-len", "8", "--max-concurrency", "1", "--warmup", "3"],
                                 capture_output=True, text=True, timeout=600, check=True).stdout
    return "\n".join(line for line in out.splitlines() if "TTFT" in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024, 2048])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--ttft", action="store_true", help="also compare TTFT in `tsdev bench` (two server starts)")
    parser.add_argument("--ttft-prompts", type=int, default=32)
    parser.add_argument("--ttft-input-len", type=int, default=200)
    parser.add_argument("--mla-expanded-min-rows", type=int, default=None,
                        help="a DeepSeek model's LatentAttention.EXPANDED_MIN_ROWS for this run (a huge value: every "
                             "prefill absorbed), to measure the two forms of MLA prefill against each other")
    args = parser.parse_args()
    if args.mla_expanded_min_rows is not None:
        from tsdev_runtime.layers.attention import LatentAttention

        LatentAttention.EXPANDED_MIN_ROWS = args.mla_expanded_min_rows

    config = EngineConfig(model=args.model, device="cuda", max_running=16, max_model_len=4096,
                          cudagraph_capture_sizes=[1, 8])
    checkpoint = Checkpoint.open(config)
    runner = ModelRunner(config, checkpoint)
    startup = runner.start()
    graphs, pages = runner.prefill_graphs, BlockManager(runner.num_pages, config.page_size)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {checkpoint.dir.name}, "
          f"{str(runner.dtype).removeprefix('torch.')}, {len(graphs.buckets)} buckets "
          f"({graphs.buckets[0]}..{graphs.max_tokens} tokens)")
    print(f"startup: prefill capture {startup['capture_prefill']:.2f} s (decode graphs: {startup['capture']:.2f} s)")
    graphs.graphs, graphs.pool = {}, torch.cuda.graph_pool_handle()  # measure a capture into an empty pool
    gc.collect()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    timings = graphs.capture(strict=True)
    print(f"recapture into a fresh pool: {sum(timings.values()):.2f} s, pool memory "
          f"{(torch.cuda.memory_reserved() - reserved) / 2**20:.0f} MiB; slowest bucket "
          f"{max(timings, key=timings.get)} tokens ({1e3 * max(timings.values()):.0f} ms)")

    print("\n| tokens | prompts | bucket | eager ms | graph ms | eager / graph |\n|---:|---:|---:|---:|---:|---:|")
    for total in args.tokens:
        for num_seqs in (1, 8):
            batch = fresh_batch(pages, total, num_seqs)
            eager = time_ms(lambda: runner.compute_logits(batch, use_graphs=False), args.iters)
            graph = time_ms(lambda: runner.compute_logits(batch), args.iters)
            print(f"| {total} | {num_seqs} | {graphs.size_for(total)} | {eager:.2f} | {graph:.2f} | "
                  f"{eager / graph:.2f}x |",
                  flush=True)
            for seq in batch.seqs:
                pages.free_pages(seq)
    if args.ttft:
        del runner, graphs, pages
        gc.collect()
        torch.cuda.empty_cache()
        for name, extra in (("prefill graphs", []), ("--disable-prefill-graph", ["--disable-prefill-graph"])):
            print(f"\ntsdev bench, concurrency 1, {args.ttft_input_len} prompt tokens, {name}:\n"
                  f"{ttft(extra, 8177, args)}", flush=True)


if __name__ == "__main__":
    main()
