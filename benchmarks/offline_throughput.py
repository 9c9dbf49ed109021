"""Offline throughput of the engine: the nano-vllm workload (random prompt and output lengths, ignore_eos).

    python3 benchmarks/offline_throughput.py --device cuda            # 256 requests, lengths 100..1024
    python3 benchmarks/offline_throughput.py --num-requests 16 --max-len 128   # a quick CPU run
    python3 benchmarks/offline_throughput.py --device cuda --compare-transformers

--compare-transformers also times Hugging Face `generate` on the same checkpoint, at batch 1 and batched
(fixed prompt and output lengths, so padding does not flatter or penalise it), and prints the ratios.
"""
import argparse
import random
import time

import nvtx
import torch
from decode_step import collector_pauses

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                        help="the KV pool's dtype (fp8: e4m3, half the bytes per token)")
    parser.add_argument("--compare-transformers", action="store_true")
    parser.add_argument("--compare-sync", action="store_true",
                        help="run the workload again with synchronous scheduling (no overlap), same engine")
    parser.add_argument("--hf-batch", type=int, default=64, help="batch size of the batched transformers run")
    parser.add_argument("--hf-len", type=int, default=128, help="prompt and output length of the transformers runs")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_running=args.max_running,
                                    max_model_len=2 * args.max_len + 1, kv_cache_dtype=args.kv_cache_dtype))
    rng = random.Random(args.seed)
    vocab = min(engine.model_config.vocab_size, 10_000)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.num_requests)]
    params = [SamplingParams(max_tokens=rng.randint(args.min_len, args.max_len), temperature=0.6, ignore_eos=True)
              for _ in range(args.num_requests)]
    engine_dir = engine.model_dir
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    ours = run_workload(engine, prompts, params, args.device)
    if args.compare_sync:
        engine.config.async_scheduling = False
        shifted = [[(t + 1) % vocab for t in p] for p in prompts]  # the same lengths, no prefix-cache hits
        sync = run_workload(engine, shifted, params, args.device, " (synchronous scheduling)")
        print(f"async / synchronous scheduling = {ours / sync:.2f}x")
    if args.compare_transformers:
        del engine
        for batch in (1, args.hf_batch):
            theirs = transformers_throughput(engine_dir, args.device, batch, args.hf_len)
            print(f"transformers generate, batch {batch}, {args.hf_len} in + {args.hf_len} out: {theirs:,.0f} output "
                  f"tok/s; tsdev / transformers = {ours / theirs:.1f}x")


def run_workload(engine: LLMEngine, prompts, params, device: str, label: str = "") -> float:
    """Generate, print the throughput and the time per kind of step; returns output tokens per second."""
    steps = time_steps(engine)
    pauses = []
    clock = (engine.num_steps, engine.step_seconds, engine.gpu_wait_seconds)
    gpu = (engine.gpu_busy_seconds, engine.gpu_idle_seconds)
    with collector_pauses(pauses), nvtx.annotate("offline-workload"):  # an nsys capture range
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    engine.step = steps.pop("_restore")
    out_tokens = sum(len(r["token_ids"]) for r in results)
    in_tokens = sum(map(len, prompts))
    print(f"  garbage collections: {len(pauses)}" + (f", {1e3 * sum(pauses):.1f} ms in all, longest "
                                                       f"{1e3 * max(pauses):.1f} ms" if pauses else ""))
    for kind, (count, secs, rows, times) in steps.items():
        if count:
            print(f"  {kind} steps: {count}, {secs:.2f} s, {1e3 * secs / count:.2f} ms/step, "
                  f"{rows / count:.0f} sequences/step")
            print(f"    {histogram(times)}")
    launched = engine.num_steps - clock[0]
    host = (engine.step_seconds - clock[1]) - (engine.gpu_wait_seconds - clock[2])
    if launched:
        print(f"  host per step: {1e3 * host / launched:.2f} ms (the steps' time less their waits for the GPU's "
              f"results; {1e3 * (engine.gpu_wait_seconds - clock[2]) / launched:.2f} ms waited)")
    busy, idle = engine.gpu_busy_seconds - gpu[0], engine.gpu_idle_seconds - gpu[1]
    if busy:
        print(f"  GPU: busy {busy:.2f} s, waiting for the host {idle:.2f} s = {100 * idle / seconds:.1f} % of the run "
              f"(CUDA timing events: between steps and while a step's inputs were prepared; GPU work alone: "
              f"{out_tokens / (seconds - idle):,.0f} output tok/s without those gaps)")
    # last, so that the tail of a log holds it
    print(f"tsdev{label}: {len(prompts)} requests, {in_tokens} prompt + {out_tokens} output tokens in {seconds:.2f} s: "
          f"{out_tokens / seconds:,.0f} output tok/s, {(in_tokens + out_tokens) / seconds:,.0f} total tok/s "
          f"({device}, {engine.model_dir.name}{'' if engine.config.kv_cache_dtype == 'auto' else ', fp8 KV'})")
    return out_tokens / seconds


def time_steps(engine: LLMEngine) -> dict[str, list]:
    """Wrap engine.step to sum wall time per kind of step. A step's time goes to the batch it read (with
    async scheduling, the one launched by the call before), since reading waits for the GPU. What each call
    launched shows in the engine's step counters (`stats()`)."""
    totals = {"decode": [0, 0.0, 0, []], "prefill or mixed": [0, 0.0, 0, []]}
    step = engine.step
    totals["_restore"] = step
    kind = []

    def timed_step():
        before = engine.stats()
        start = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - start
        after = engine.stats()
        if after.steps > before.steps:  # it launched a batch
            decode = after.decode_steps > before.decode_steps
            kind.append(("decode" if decode else "prefill or mixed", after.rows - before.rows))
        while len(kind) > (1 if engine.in_flight else 0):  # the batches this call read
            name, rows = kind.pop(0)
            totals[name][0] += 1
            totals[name][1] += seconds
            totals[name][2] += rows
            totals[name][3].append(seconds)
            seconds = 0.0
        return out

    engine.step = timed_step
    return totals


def histogram(times: list[float], bins: int = 8) -> str:
    """Step times in ms: percentiles, then counts in `bins` equal-width bins from the fastest to the slowest."""
    ms = sorted(t * 1e3 for t in times)
    pick = [ms[min(len(ms) - 1, int(q * len(ms)))] for q in (0.1, 0.5, 0.9, 0.99)]
    low, width = ms[0], (ms[-1] - ms[0]) / bins or 1.0
    counts = [0] * bins
    for t in ms:
        counts[min(bins - 1, int((t - low) / width))] += 1
    cells = " ".join(f"{low + i * width:.1f}:{n}" for i, n in enumerate(counts))
    return (f"ms p10 {pick[0]:.2f} p50 {pick[1]:.2f} p90 {pick[2]:.2f} p99 {pick[3]:.2f} max {ms[-1]:.2f}; "
            f"histogram (bin start ms:steps) {cells}")


def transformers_throughput(model_dir, device: str, batch: int, length: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
    model.generation_config.eos_token_id = None
    prompts = torch.randint(0, 1000, (batch, length), device=device)
    kwargs = dict(max_new_tokens=length, min_new_tokens=length, do_sample=False, pad_token_id=0)
    model.generate(prompts[:, :8], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompts, **kwargs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return batch * (out.shape[1] - length) / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
