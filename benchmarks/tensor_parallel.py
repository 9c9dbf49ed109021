"""Tensor parallelism in one run (issue 17): the decode step at each batch size, the engine's build time (what a
restart costs besides the process start) and the reload pause per rank, for --tp 1, for one rank through the
distributed path ("tp1-group": a process group of one, every collective and the per-step broadcast run) and for
--tp N; ratios to --tp 1 from the same run (docs/benchmarks.md's rule).

    python3 benchmarks/tensor_parallel.py                      # CUDA: the default model, TP=1 vs TP=2 (two GPUs)
    python3 benchmarks/tensor_parallel.py --tp 1               # one GPU: TP=1 vs TP=1 through the distributed path
    python3 benchmarks/tensor_parallel.py --device cpu --batch-sizes 1 4 --steps 3 --reloads 1   # gloo smoke run
    nsys profile --trace=cuda,nvtx --sample=none -o tp python3 benchmarks/tensor_parallel.py --tp 2
        # then `nsys stats --report cuda_gpu_kern_sum tp.nsys-rep`: the NCCL kernels' share of each
        # "tp-decode-B" NVTX range is the all-reduce share

Each configuration runs in fresh processes, one per rank (torchrun's environment): rank 0 builds the engine and
measures; the others follow it (`tsdev_runtime.engine.llm_engine.serve_rank`). Prints one JSON line per measurement,
then a summary.
"""
import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time

from tsdev.launch.child import free_port

RELOADED = "tsdev_kernels.ops.activation"  # forced: re-executed unchanged, so every reload does the same work


def engine_config(args, tp: int):
    from tsdev_runtime.config import EngineConfig

    sizes = sorted({*args.batch_sizes, 1})
    return EngineConfig(model=args.model, device=args.device, world_size=tp, max_running=max(sizes),
                        cudagraph_capture_sizes=sizes, kv_pages=None if args.device.startswith("cuda") else 2048,
                        prefill_graph_max_tokens=0 if args.device == "cpu" else 2048)


def decode_ms(engine, batch: int, steps: int) -> float:
    """Median wall time of one decode step with `batch` sequences running (prompts of 16 tokens, prefilled first)."""
    import nvtx

    from tsdev_runtime.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [(7 * i + j) % 1000 + 1 for j in range(16)], params)
    while engine.stats().decode_steps == 0 or engine.stats().waiting:
        engine.step()
    times = []
    with nvtx.annotate(f"tp-decode-{batch}"):
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    engine.abort_all()
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def reload_pauses(engine, reloads: int) -> list[dict]:
    """Each forced reload's pause on rank 0 and every rank's reload + warm + recapture seconds."""
    from tsdev_runtime.control_protocol import ReloadRequest
    from tsdev_runtime.engine.async_engine import AsyncEngine
    from tsdev.hotreload import Reloader, default_packages

    async def run():
        ae = AsyncEngine(engine)
        await ae.start()
        engine.control.allow_reloads(Reloader(default_packages()))
        reload = engine.control.reload_forward
        out = []
        for n in range(reloads):
            reply = await reload(ReloadRequest(id=f"bench-{n}", modules=[RELOADED]))
            assert reply.ok, reply
            out.append({"pause": reply.workers[0].timings["pause"],
                        "ranks": [round(sum(w.timings.get(k, 0.0) for k in ("reload", "warm", "recapture")), 6)
                                  for w in reply.workers]})
        await ae.stop()
        return out

    return asyncio.run(run())


def rank_main(args, tp: int, grouped: bool, rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp),
                      LOCAL_RANK=str(rank))
    from tsdev_runtime import distributed
    from tsdev_runtime.engine.llm_engine import LLMEngine
    from tsdev_runtime.engine.llm_engine import serve_rank
    from tsdev.hotreload import Reloader, default_packages

    config = engine_config(args, tp)
    if grouped:
        distributed.init(rank, tp, args.device)
    try:
        if rank:
            serve_rank(config, lambda: Reloader(default_packages()))
            return
        start = time.perf_counter()
        engine = LLMEngine(config)
        out = {"tp": tp, "build_s": time.perf_counter() - start,
               "decode_ms": {b: decode_ms(engine, b, args.steps) for b in args.batch_sizes},
               "reloads": reload_pauses(engine, args.reloads)}
        engine.control.close()
        results.put(out)
    finally:
        distributed.shutdown()


def measure(args, tp: int, grouped: bool) -> dict:
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(args, tp, grouped, r, port, results)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded model)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tp", type=int, default=2, help="compared with --tp 1 (1: only one rank, plain and grouped)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per batch size")
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    configs = {"tp1": (1, False), "tp1-group": (1, True)}
    if args.tp > 1:
        configs[f"tp{args.tp}"] = (args.tp, True)
    runs = {}
    for name, (tp, grouped) in configs.items():
        runs[name] = measure(args, tp, grouped)
        print(json.dumps({"config": name, **runs[name]}), flush=True)
    one, last = runs["tp1"], runs[list(configs)[-1]]
    pause = {name: statistics.median(r["pause"] for r in run["reloads"]) for name, run in runs.items()}
    summary = {
        "decode_ms": {b: {**{name: round(run["decode_ms"][b], 3) for name, run in runs.items()},
                          **{f"{name}/tp1": round(run["decode_ms"][b] / one["decode_ms"][b], 3)
                             for name, run in runs.items() if name != "tp1"}} for b in args.batch_sizes},
        "build_s": {name: round(run["build_s"], 3) for name, run in runs.items()},
        "reload_pause_s": {name: round(p, 4) for name, p in pause.items()},
        "reload_rank_seconds": last["reloads"][-1]["ranks"],
        f"build_over_pause_{list(configs)[-1]}": round(last["build_s"] / pause[list(configs)[-1]], 1),
    }
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
