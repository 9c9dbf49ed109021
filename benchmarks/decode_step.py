"""Decode step time at several batch sizes against the memory-bandwidth floor (gpt-fast style).

    python3 benchmarks/decode_step.py                       # Qwen3-0.6B shape, bf16, context 512
    python3 benchmarks/decode_step.py --batch-sizes 1 8 --context 2048
    python3 benchmarks/decode_step.py --batch-sizes 256 --context 2048 --kv-cache-dtype fp8   # an e4m3 KV pool
    python3 benchmarks/decode_step.py --batch-sizes 1 128 --breakdown   # + GPU time per kernel of a replay
    nsys profile --trace=cuda,nvtx --sample=none --cuda-graph-trace=node --capture-range=nvtx \
        --nvtx-capture=decode-replay-1 -e NSYS_NVTX_PROFILER_REGISTER_ONLY=0 -o decode \
        python3 benchmarks/decode_step.py --batch-sizes 1        # the batch-1 replays alone (5 + --iters of them)
    (--nvtx-capture=engine-steps-256 takes the engine's timed steps at batch 256 instead: host and GPU together)

The floor is the time to read every weight once plus each sequence's KV cache, at the copy bandwidth measured in the
same run -- of a mixture of experts' routed experts only those the batch touches on average (`experts_touched`), of
an untied embedding table only the batch's rows (`unread_weight_bytes`, benchmarks/model_shapes.py's floor too).
"step" is what the runner pays per decode step (host prep, graph replay, sampling, copy back, one after the other);
"graph" is the replay alone; "engine" is the steady-state time of `LLMEngine.step` decoding that many requests with
async scheduling (host work overlapped with the GPU; the context grows by --iters tokens while it is timed,
`--context` on average, so that the same floor holds).

The engine is timed first, through its public methods only; "step" and "graph" then time a model runner
(and page manager) this benchmark builds and owns once the engine is freed.
"""
import argparse
import contextlib
import gc
import time

import nvtx
import torch

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.block_manager import BlockManager
from tsdev_runtime.engine.llm_engine import LLMEngine, thaw_heap
from tsdev_runtime.engine.model_runner import Checkpoint, ModelRunner
from tsdev_runtime.engine.scheduler import ScheduledBatch
from tsdev_runtime.engine.sequence import SamplingParams, Sequence
from tsdev_runtime.layers.embedding import LMHead, VocabEmbedding


def copy_bandwidth(device) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 20
    for _ in range(n):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * n / (time.perf_counter() - start)


def experts_touched(experts: int, top_k: int, batch: int) -> float:
    """The experts of one sparse layer that a uniform routing of `batch` tokens, `top_k` each, touches on average:
    E * (1 - (1 - k/E)^batch) (8 of 128 at batch 1, ~124 at 64 for Qwen3-30B-A3B)."""
    return experts * (1 - (1 - top_k / experts) ** batch)


def unread_weight_bytes(model, raw: dict, batch: int) -> float:
    """The bytes of `model`'s parameters that a decode step of `batch` tokens does not read: the routed experts (its
    parameters named `.experts.`) its tokens do not touch, by `experts_touched`, and an untied embedding table's rows
    but the batch's (a tied one is the logits' weight, read whole). `raw`: the checkpoint's config.json."""
    heads = {id(m.weight) for m in model.modules() if isinstance(m, LMHead)}
    tables = [m.weight for m in model.modules() if type(m) is VocabEmbedding and id(m.weight) not in heads]
    unread = sum(max(0, w.shape[0] - batch) * w.shape[1] * w.element_size() for w in tables)
    experts = int(raw.get("num_experts") or raw.get("n_routed_experts") or raw.get("num_local_experts") or 0)
    if experts:
        routed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
        unread += routed * (1 - experts_touched(experts, raw["num_experts_per_tok"], batch) / experts)
    return unread


def time_cuda(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--breakdown", action="store_true",
                        help="also print the GPU time per kernel name of one graph replay (torch profiler)")
    parser.add_argument("--prefill-graph-max-tokens", type=int, default=2048, help="0: no prefill graphs")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="fp8: e4m3 projections (compare with a run without it)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                        help="fp8: the KV pool in e4m3, half the KV bytes per token (its floor counts them)")
    args = parser.parse_args()

    config = EngineConfig(model=args.model, device="cuda", max_running=max(args.batch_sizes),
                          max_model_len=max(2 * args.context, 1024),
                          prefill_graph_max_tokens=args.prefill_graph_max_tokens,
                          quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    engine = LLMEngine(config)  # first: built after a freed runner, its host step at 256 rows measured ~1 ms slower
    decoding = lambda iters: SamplingParams(max_tokens=iters, temperature=args.temperature, ignore_eos=True)
    engine_times = {bs: engine_step_time(engine, bs, args.context, args.iters, decoding) for bs in args.batch_sizes}
    print("a full garbage collection: %.1f ms with the engine's startup heap frozen, %.1f ms thawed"
          % full_collection_ms())
    del engine  # the runner sizes its KV pool to the memory left
    thaw_heap(collect=True)
    torch.cuda.empty_cache()
    checkpoint = Checkpoint.open(config)
    runner = ModelRunner(config, checkpoint)
    runner.start()
    bm = BlockManager(runner.num_pages, config.page_size)
    bandwidth = copy_bandwidth(runner.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    for m in runner.model.modules():  # fp8 projections read their e4m3 copy and scales, not the kept weight
        if getattr(m, "quantization", None) == "fp8":
            weight_bytes += (m.weight_fp8.numel() + 4 * m.weight_scale.numel()
                             - m.weight.numel() * m.weight.element_size())
    kv_dtype = config.kv_torch_dtype(runner.dtype)
    # from the pool's layout: a key and a value per KV head, or (DeepSeek) one latent row, in every layer
    kv_bytes_per_token = runner.kv_cache[:, :, 0, 0].numel() * kv_dtype.itemsize
    print(f"{checkpoint.dir.name}{' fp8' if args.quantization else ''}, KV {str(kv_dtype).removeprefix('torch.')}: "
          f"{weight_bytes / 1e9:.2f} GB of weights (a step reads less: `unread_weight_bytes`), copy "
          f"bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"context {args.context}, graphs {runner.decode_graphs.sizes if runner.decode_graphs else 'off'}")
    print(f"{'batch':>5} {'step ms':>8} {'graph ms':>8} {'engine ms':>9} {'floor ms':>8} {'step/floor':>10} "
          f"{'tok/s':>9} {'GB/s':>7}")
    params = SamplingParams(max_tokens=1, temperature=args.temperature, ignore_eos=True)
    breakdown = []
    for bs in args.batch_sizes:
        seqs = []
        for i in range(bs):
            seq = Sequence(f"b{i}", [(i * 31 + j) % 1000 for j in range(args.context)], params)
            assert bm.allocate(seq, args.context), "KV pool too small for this batch"
            seq.num_computed_tokens = args.context - 1
            seqs.append(seq)
        batch = ScheduledBatch(seqs, [1] * bs)
        step = time_cuda(lambda: runner.run(batch), args.iters)
        size = (next(s for s in runner.decode_graphs.sizes if s >= bs)
                if runner.decode_graphs and bs <= runner.decode_graphs.max_size else None)
        with nvtx.annotate(f"decode-replay-{bs}"):  # what an nsys capture range can select (docstring)
            graph = (time_cuda(runner.decode_graphs.graphs[size].replay, args.iters)
                     if size in (runner.decode_graphs.graphs if runner.decode_graphs else {}) else float("nan"))
        if args.breakdown and size in runner.decode_graphs.graphs:
            breakdown.append((bs, kernel_breakdown(runner.decode_graphs.graphs[size].replay, args.iters)))
        for seq in seqs:
            bm.free_pages(seq)
        read = (weight_bytes - unread_weight_bytes(runner.model, runner.model_config.raw, bs)
                + bs * args.context * kv_bytes_per_token)
        floor = read / bandwidth
        print(f"{bs:>5} {step * 1e3:>8.3f} {graph * 1e3:>8.3f} {engine_times[bs] * 1e3:>9.3f} {floor * 1e3:>8.3f} "
              f"{step / floor:>10.2f} {bs / step:>9,.0f} {read / step / 1e9:>7.0f}")
    for bs, kernels in breakdown:
        total = sum(us for us, _ in kernels.values())
        print(f"\nbatch {bs}: {total:.1f} us of kernels per replay "
              f"({sum(n for _, n in kernels.values()):.0f} launches)")
        for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
            print(f"{us:>9.1f} us {us / total:>6.1%} {n:>6.0f}x  {name[:110]}")


def cuda_kernels(fn, iters: int) -> list:
    """The GPU kernels (and memsets) of `iters` calls of `fn` after one untimed call, in the order they ran:
    torch.profiler's events (`name`, `device_time_total` in us)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def kernel_breakdown(replay, iters: int) -> dict[str, tuple[float, float]]:
    """GPU microseconds and launches per replay, by kernel name."""
    kernels: dict[str, tuple[float, float]] = {}
    for event in cuda_kernels(replay, iters):
        us, n = kernels.get(event.name, (0.0, 0.0))
        kernels[event.name] = (us + event.device_time_total / iters, n + 1 / iters)
    return kernels


def engine_step_time(engine: LLMEngine, batch: int, context: int, iters: int, params) -> float:
    """Seconds per `engine.step()` while `batch` requests decode, their context `context` tokens on average over
    the timed steps, as the runner's graph is timed below; prints the collector's pauses during those steps.
    `params(max_tokens)`: the requests' SamplingParams (ignore_eos, enough max_tokens for the timed steps).
    The prompts are computed once first, so that their pages are in the prefix cache and every request starts
    decoding within a step or two of the others (a chunked prefill of them all would start the first admitted
    ones ~60 steps ahead: at batch 256 and context 512 their mean context was ~600 tokens, 18 % more KV to read)."""
    # 5 untimed steps, then iters timed ones: the mean context is `context`
    prompt_len = max(1, context - 5 - iters // 2)
    prompts = [[(i * 17 + j) % 1000 + 1 for j in range(prompt_len)] for i in range(batch)]
    engine.generate(prompts, SamplingParams(max_tokens=1))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"e{i}", prompt, params(iters + 64))
    engine.prefill_all()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    rows_before = engine.stats().decode_rows
    pauses = []
    with collector_pauses(pauses):
        start = time.perf_counter()
        with nvtx.annotate(f"engine-steps-{batch}"):  # an nsys capture range, as decode-replay-N
            for _ in range(iters):
                engine.step()
        seconds = (time.perf_counter() - start) / iters
    rows = engine.stats().decode_rows - rows_before
    assert rows == batch * iters, f"{rows} rows decoded in {iters} steps of {batch}: a request ended or was preempted"
    print(f"batch {batch}: {len(pauses)} garbage collections during the {iters} engine steps"
          + (f", {1e3 * sum(pauses):.1f} ms in all, longest {1e3 * max(pauses):.1f} ms" if pauses else ""))
    engine.abort_all()
    while engine.has_unfinished():
        engine.step()
    return seconds


def full_collection_ms() -> tuple[float, float]:
    """Milliseconds of one full garbage collection with the engine's startup heap frozen (as it serves), and
    with it thawed (what a full collection cost the step loop before the engine froze it)."""
    start = time.perf_counter()
    gc.collect()
    frozen = time.perf_counter() - start
    gc.unfreeze()
    start = time.perf_counter()
    gc.collect()
    thawed = time.perf_counter() - start
    gc.freeze()
    return 1e3 * frozen, 1e3 * thawed


@contextlib.contextmanager
def collector_pauses(pauses: list[float]):
    """Append the duration of each cyclic garbage collection run meanwhile to `pauses` (seconds)."""
    started = []

    def record(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    gc.callbacks.append(record)
    try:
        yield
    finally:
        gc.callbacks.remove(record)


if __name__ == "__main__":
    main()
