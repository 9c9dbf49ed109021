"""Tune kernels/tsdev_kernels/ops/moe.py's block sizes for one MoE shape on this GPU over the full grid and write the
file `moe_config` reads. `tsdev tune` (tsdev/tune.py) is the tuner to use: a model's shapes, a fast search, the
user's cache; this script stays as the full-grid reference (and the only one that tries --fp8-wgmma).

    python3 benchmarks/tune_moe.py --experts 128 --intermediate 768 --hidden 2048      # Qwen3-30B-A3B, one rank
    python3 benchmarks/tune_moe.py --experts 128 --intermediate 384 --hidden 2048      # the same at --tp 2
    python3 benchmarks/tune_moe.py --experts 128 --intermediate 768 --hidden 2048 --fp8  # FP8 experts' file
    python3 benchmarks/tune_moe.py --experts 128 --intermediate 768 --hidden 2048 --block-fp8 --quick  # Qwen's *-FP8

For each token bucket (1, 16, 64, 256, 1024 by default) it times `fused_moe_triton` (alignment, both GEMMs, the sum)
on random routings, replayed from a CUDA graph (triton.testing.do_bench_cudagraph), for every config of a small
grid, and keeps the fastest: kernels/tsdev_kernels/moe_configs/E=..,I=..,H=..,dtype=..,device=...json (--out to write
elsewhere), written after each bucket; --resume goes on from the buckets a stopped run wrote. First every kernel the
run will time is compiled in --jobs processes at once (`precompile`; one process compiling the full grid's ~430
binaries at about a second each would take most of ten minutes of the device's time).
--intermediate is one rank's share of moe_intermediate_size under tensor parallelism. --fp8 tunes FP8 experts (e4m3
weights, a scale per row; activations in --dtype) into their own file (dtype=float8_e4m3fn); --block-fp8 the experts of
a block-FP8 checkpoint (a scale per 128 x 128 block; BLOCK_K 128 and BLOCK_N <= 128 are fixed by the blocks) into
theirs (dtype=float8_e4m3fn,block=128x128).
"""
import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tsdev_kernels.ops import fp8, fp8_block, moe

GRID = dict(BLOCK_M=(16, 32, 64, 128), BLOCK_N=(32, 64, 128), BLOCK_K=(64, 128, 256), num_warps=(4, 8),
            num_stages=(2, 3, 4))
QUICK_GRID = dict(BLOCK_M=(16, 64), BLOCK_N=(64, 128), BLOCK_K=(64, 128), num_warps=(4, 8), num_stages=(3,))


def candidates(tokens: int, topk: int, num_experts: int, grid: dict):
    """The grid, without BLOCK_M far above the slots an expert gets on average (most of such a block is padding)."""
    per_expert = tokens * topk / num_experts
    for values in itertools.product(*grid.values()):
        config = dict(zip(grid, values))
        if config["BLOCK_M"] > 16 and config["BLOCK_M"] > 4 * per_expert:
            continue
        if config.get("fp8_wgmma") and config["BLOCK_M"] < 64:  # below 64 rows Triton runs mma.sync either way
            continue
        yield config


def inputs(tokens: int, args, dtype: torch.dtype, generator: torch.Generator, experts: int | None = None):
    """x, w13, w2, router weights, ids and `fused_moe`'s scales for `tokens` tokens on the generator's device;
    `experts` (default --experts) fewer for `precompile`: the kernels' binaries do not depend on it."""
    E, I, H, K = experts or args.experts, args.intermediate, args.hidden, args.topk
    device = generator.device
    x = torch.randn(tokens, H, generator=generator, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=generator, device=device) * 0.02).to(dtype)
    w2 = (torch.randn(E, H, I, generator=generator, device=device) * 0.02).to(dtype)
    probs = torch.randn(tokens, E, generator=generator, device=device).softmax(-1)
    weights, ids = probs.topk(K, dim=-1)
    scales = {}
    if args.fp8:
        (w13, s13), (w2, s2) = fp8.quantize_fp8_rows(w13), fp8.quantize_fp8_rows(w2)
        scales = dict(w13_scale=s13.squeeze(-1), w2_scale=s2.squeeze(-1))
    if args.block_fp8:
        (w13, s13), (w2, s2) = ([torch.stack(t) for t in zip(*(fp8_block.quantize_fp8_blocks(m.float()) for m in w))]
                                for w in (w13, w2))
        scales = dict(w13_scale=s13, w2_scale=s2, block=fp8_block.BLOCK)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).float(), ids.int(), scales


def precompile(args, work: list[tuple[int, dict]], jobs: int, device: str = "cuda") -> int:
    """Compile the kernels of every (tokens, config) in `work` in `jobs` processes at once before anything is timed:
    compiling is most of a full grid's time on one process (two GEMM binaries per config, about a second each), and
    what the workers compile lands in Triton's cache on disk, which the timing process then loads. Each worker runs
    each launch once on experts of this shape but fewer of them (`compile_chunk`): the binaries depend on the
    shapes and strides, not on the count."""
    import concurrent.futures
    import multiprocessing
    import time

    start = time.perf_counter()
    chunks = [work[i::jobs] for i in range(jobs) if work[i::jobs]]
    context = multiprocessing.get_context("spawn")  # CUDA in every worker
    with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=context) as pool:
        failed = sum(pool.map(compile_chunk, [vars(args)] * len(chunks), chunks, [device] * len(chunks)))
    print(f"compiled {len(work)} launches in {time.perf_counter() - start:.0f} s on {len(chunks)} processes"
          f"{f' ({failed} failed: out of resources, skipped when timed)' if failed else ''}", flush=True)
    return failed


def compile_chunk(options: dict, chunk: list[tuple[int, dict]], device: str = "cuda") -> int:
    """Run each (tokens, config) of `chunk` once (so Triton compiles its kernels), on max(top k, 16) experts of the
    shape; the launches that fail (a config out of shared memory or registers). A `precompile` worker."""
    args = argparse.Namespace(**options)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    experts = min(args.experts, max(args.topk, 16))
    data, failed = {}, 0
    for tokens, config in chunk:
        if tokens not in data:
            data[tokens] = inputs(tokens, args, dtype, generator, experts)
        x, w13, w2, weights, ids, scales = data[tokens]
        try:
            moe.fused_moe_triton(x, w13, w2, weights, ids, config=config, **scales)
        except Exception:  # noqa: BLE001 -- out of resources: the timing skips it too
            failed += 1
    if device == "cuda":
        torch.cuda.synchronize()
    return failed


def time_ms(config: dict, rep: int, x, w13, w2, weights, ids, scales) -> float | None:
    import triton.testing

    def call():
        moe.fused_moe_triton(x, w13, w2, weights, ids, config=config, **scales)

    try:
        call()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(call, rep=rep)
    except Exception as exc:  # out of shared memory / registers: not a candidate
        print(f"  skip {config}: {type(exc).__name__}", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def main(args: argparse.Namespace) -> None:
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator(device="cuda").manual_seed(0)
    name = torch.cuda.get_device_name()
    weight_dtype = fp8.FP8_DTYPE if args.fp8 or args.block_fp8 else dtype  # moe_config's key: the weights' dtype
    block = fp8_block.BLOCK if args.block_fp8 else None
    path = args.out or str(moe.moe_config_path(args.experts, args.intermediate, args.hidden, weight_dtype, name,
                                               block))
    grid = QUICK_GRID if args.quick else GRID
    if block:  # the kernel takes BLOCK_K = block_k and BLOCK_N <= block_n: the other axes get the room
        grid = grid | dict(BLOCK_N=tuple(n for n in GRID["BLOCK_N"] if n <= block[0]), BLOCK_K=(block[1],),
                           num_stages=GRID["num_stages"] + (5,))
    if args.fp8_wgmma:
        grid = grid | dict(fp8_wgmma=(False, True))
    best_of = {}
    if args.resume and os.path.exists(path):
        with open(path) as f:
            best_of = json.load(f)
        print(f"resuming {path}: buckets {', '.join(best_of)} kept")
    if args.jobs > 1:
        precompile(args, [(tokens, config) for tokens in args.tokens if str(tokens) not in best_of
                          for config in [moe.default_moe_config(tokens), *candidates(tokens, args.topk, args.experts,
                                                                                     grid)]], args.jobs)
    for tokens in args.tokens:
        if str(tokens) in best_of:
            continue
        data = inputs(tokens, args, dtype, generator)
        untuned = moe.default_moe_config(tokens)
        default = time_ms(untuned, args.rep, *data)
        timed = [(ms, config)
                 for config in candidates(tokens, args.topk, args.experts, grid)
                 if (ms := time_ms(config, args.rep, *data)) is not None]
        block_shaped = not block or (untuned["BLOCK_K"] == block[1] and untuned["BLOCK_N"] <= block[0])
        if default is not None and block_shaped:  # the file never holds a config slower than the untuned default
            timed.append((default, untuned))
        ms, config = min(timed, key=lambda pair: pair[0])
        best_of[str(tokens)] = config
        print(f"T={tokens:5d}: {ms * 1e3:8.1f} us  (default {default * 1e3:8.1f} us)  {config}", flush=True)
        write(path, best_of)  # after each bucket: --resume goes on from here
    print(f"wrote {path}")


def write(path: str, best_of: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(dict(sorted(best_of.items(), key=lambda item: int(item[0]))), f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--experts", type=int, required=True, help="E, experts of a sparse layer")
parser.add_argument("--intermediate", type=int, required=True, help="I, one expert's (one rank's) intermediate size")
parser.add_argument("--hidden", type=int, required=True, help="H, the model's hidden size")
parser.add_argument("--topk", type=int, default=8, help="experts per token (Qwen3-MoE: 8)")
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
parser.add_argument("--tokens", type=int, nargs="+", default=list(moe.TOKEN_BUCKETS), help="token buckets")
parser.add_argument("--rep", type=int, default=50, help="ms of replays per measurement")
parser.add_argument("--quick", action="store_true", help="a 16-config grid (minutes, not an hour)")
parser.add_argument("--fp8", action="store_true", help="FP8 experts (e4m3 weights): their own file")
parser.add_argument("--block-fp8", action="store_true",
                    help="a block-FP8 checkpoint's experts (e4m3, a scale per 128 x 128 block): their own file")
parser.add_argument("--fp8-wgmma", action="store_true",
                    help="FP8 experts: also try BLOCK_M >= 64 on the e4m3 wgmma (`fp8_wgmma`, the sum promoted every K "
                         "block) -- only once benchmarks/fp8_moe_accuracy.py shows it keeps the reference's accuracy")
parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes compiling the grid's kernels before the timing (default: %(default)s; 1: compile "
                         "each as it is first timed)")
parser.add_argument("--out", help="where to write the JSON (default: the file moe_config reads)")
parser.add_argument("--resume", action="store_true", help="keep the buckets the file has (it is written after each "
                    "bucket) and tune the others")

if __name__ == "__main__":
    args = parser.parse_args()
    if args.fp8_wgmma and not (args.fp8 or args.block_fp8):
        sys.exit("--fp8-wgmma is for FP8 experts: add --fp8 or --block-fp8")
    if not torch.cuda.is_available():
        sys.exit("tune_moe.py times kernels on a CUDA GPU; none is visible")
    main(args)
