"""MLA decode attention (`tsdev_kernels.ops.mla`) against its KV-read floor: DeepSeek-V3's shapes (128 heads, latent
512, rope 64), a paged latent cache of bf16 or e4m3, every sequence at --context tokens.

    python3 benchmarks/mla_decode.py                          # batch 1, 64, 256 at context 4096, bf16 and fp8 cache
    python3 benchmarks/mla_decode.py --sweep                  # each tile (heads, latent columns per program, KV
                                                              # rows, warps) too
    python3 benchmarks/mla_decode.py --tile 64,512,32,8,t     # the default tile beside these (heads, columns, rows,
                                                              # warps[, t: transposed]) only
    python3 benchmarks/mla_decode.py --prefill 4096           # then one 4096-token prompt's attention (prefill tiles)

floor: the cache rows every sequence reads (576 values x 2 bytes, 1 in an e4m3 cache, per token) at the copy bandwidth
measured in the same run (FlashMLA reports ~3,000 GB/s for this read on an H800). The kernel is replayed from a CUDA
graph (triton.testing.do_bench_cudagraph) as serving replays it: the splits' launch (storing the step's rows), then the
merge; the error against the torch reference is checked on every configuration timed.
"""
import argparse
import datetime
import shlex
import sys

import torch
import triton
import triton.testing

from decode_step import copy_bandwidth
from tsdev_kernels.ops import mla

HEADS, LATENT, ROPE, PAGE = 128, 512, 64, 16


def batch(sequences: int, q_len: int, context: int, kv_dtype, generator):
    return mla.mla_batch([q_len] * sequences, [context - q_len] * sequences, HEADS, LATENT, ROPE, PAGE,
                         torch.bfloat16, "cuda", generator, kv_dtype)


def time_decode(args, sequences: int, kv_dtype, **config) -> tuple[float, float]:
    """(microseconds per call, max relative error) of one decode step's attention."""
    g = torch.Generator(device="cuda").manual_seed(sequences)
    q, cache, cu, lens, table, rows, slots, order, max_q_len, latent = batch(sequences, 1, args.context, kv_dtype, g)
    mla.store_latent_triton(rows, cache, slots)
    scale = (128 + ROPE) ** -0.5
    want = mla.mla_attention_ref(q, cache, cu, lens, table, scale, latent)
    out = torch.empty_like(want)

    def call():  # as serving calls it: the step's rows stored by the kernel (again: the same values)
        mla.mla_attention_triton(q, cache, cu, lens, table, scale, latent, 1, out=out, order=order,
                                 store=(rows, slots), **config)
    call()
    error = float(((out.float() - want.float()).abs().max() / want.float().abs().max()))
    return triton.testing.do_bench_cudagraph(call, rep=100 if config else 200) * 1e3, error


def tile(spec: str) -> dict:
    """--tile's "64,512,32,8,t" as mla_attention_triton's keywords."""
    *numbers, last = spec.split(",")
    transposed = last == "t"
    if not transposed:
        numbers.append(last)
    if len(numbers) != 4 or not all(n.isdigit() for n in numbers):
        raise SystemExit(f"--tile {spec!r}: want HEADS,COLUMNS,ROWS,WARPS with an optional ,t (e.g. 64,512,32,8,t)")
    heads, columns, rows, warps = map(int, numbers)
    config = dict(heads=heads, columns=columns, block_n=rows, num_warps=warps)
    return config | dict(transposed=True) if transposed else config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--sweep", action="store_true", help="time each tile configuration at each batch")
    parser.add_argument("--tile", action="append", default=[], metavar="HEADS,COLUMNS,ROWS,WARPS[,t]",
                        help="time this tile beside the default (t: transposed); repeatable; a few of --sweep's")
    parser.add_argument("--prefill", type=int, default=0, help="also time one prompt of this many tokens")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mla_decode.py times kernels on a CUDA GPU; none is visible")
    bandwidth = copy_bandwidth("cuda")
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; {HEADS} heads, latent {LATENT} + rope {ROPE}, context {args.context}, pages of "
          f"{PAGE}; copy bandwidth {bandwidth / 1e12:.2f} TB/s. Command: "
          f"`python3 benchmarks/mla_decode.py {shlex.join(sys.argv[1:])}`\n")
    configs = [{}] + [tile(spec) for spec in args.tile]
    if args.sweep:
        # heads per program x latent columns each sums; those that compile for sm_90 without register spills
        # (64 or 128 heads only with 8 warps and at most 256 columns; 64 KV rows only with 128 columns: 128 heads
        # 196 registers with a bf16 cache and 176 with e4m3, 64 heads 225 with bf16 and spilling with e4m3, by
        # tests/test_kernel_configs.py's `compile_sm90`, 2026-12-05)
        configs = [dict(heads=h, columns=c, block_n=n, num_warps=w) for h, c, w in (
            (16, 512, 4), (16, 512, 8), (16, 256, 4), (16, 256, 8), (64, 256, 8), (64, 128, 8), (128, 256, 8),
            (128, 128, 8)) for n in (16, 32)]
        configs += [dict(heads=h, columns=128, block_n=64, num_warps=8) for h in (64, 128)]
        # every column of 64 heads, 16 rows: the scores computed once per head (with 256 columns two programs compute
        # them): 246 registers with a bf16 cache, no spill (2026-12-05, second session); with e4m3 272 bytes spill
        configs += [dict(heads=64, columns=512, block_n=16, num_warps=8)]
        # transposed (cache rows x heads: the scores' tile 32 rows by 64 heads, computed once, not once per warpgroup
        # or per column half as above): 245 registers with 8 warps, 128 and a 56-byte spill with 16 (bf16 cache); an
        # e4m3 cache spills with both (2026-12-05, fifth session)
        configs += [dict(heads=64, columns=512, block_n=32, num_warps=w, transposed=True) for w in (8, 16)]
    print("| cache | batch | configuration | floor us | kernel us | floor / kernel | max rel err |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for kv_dtype, name in ((None, "bf16"), (torch.float8_e4m3fn, "fp8")):
        for sequences in args.batch:
            floor = sequences * args.context * (LATENT + ROPE) * (1 if kv_dtype else 2) / bandwidth * 1e6
            for config in configs:
                try:
                    us, error = time_decode(args, sequences, kv_dtype, **config)
                except Exception as exc:  # a tile that does not compile (shared memory, registers): say so
                    print(f"| {name} | {sequences} | {config or 'default'} | {floor:.1f} | failed: "
                          f"{type(exc).__name__} | | |")
                    continue
                print(f"| {name} | {sequences} | {config or 'default'} | {floor:.1f} | {us:.1f} | "
                      f"{floor / us:.0%} | {error:.2e} |")
    if args.prefill:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, cache, cu, lens, table, rows, slots, order, max_q_len, latent = batch(1, args.prefill, args.prefill, None,
                                                                                 g)
        mla.store_latent_triton(rows, cache, slots)
        scale = (128 + ROPE) ** -0.5
        ms = triton.testing.do_bench(lambda: mla.mla_attention_triton(q, cache, cu, lens, table, scale, latent,
                                                                       max_q_len), rep=200)
        flops = 2 * HEADS * (LATENT + ROPE + LATENT) * args.prefill * (args.prefill + 1) / 2
        print(f"\nprefill of one {args.prefill}-token prompt (absorbed form, causal): {ms:.2f} ms per layer, "
              f"{flops / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
