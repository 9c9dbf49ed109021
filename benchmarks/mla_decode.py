"""MLA decode attention (`tsdev_kernels.ops.mla`) against its floor: DeepSeek-V3's shapes (128 heads, latent 512, rope
64), a paged latent cache of bf16 or e4m3 (pages of 16), every sequence at --context tokens. The decode kernels side by
side: "gluon" (`mla_decode_gluon`, mla_decode_gluon.py's kernel: what TSDEV_MLA_DECODE=auto serves on Hopper),
"flash" (`mla_decode_triton`, mla_decode.py's Triton kernel in FlashMLA's structure), each of its tiles
(FLASH_TILES), and "tiles" (`mla_attention_triton`, `_mla_kernel`'s decode tiles, TSDEV_MLA_DECODE=tiles).

    python3 benchmarks/mla_decode.py                          # the kernels, batch 1, 64, 256 at context 4096, bf16
                                                              # and e4m3 caches
    python3 benchmarks/mla_decode.py --flash-splits 8 16 32 64   # + the flash kernel's default tile at these splits
    python3 benchmarks/mla_decode.py --kernels gluon --batch 1 4 --gluon-splits 8 16 64   # the Gluon kernel's too
    python3 benchmarks/mla_decode.py --kernels tiles --sweep  # each tile of `_mla_kernel` (heads, latent columns per
                                                              # program, KV rows, warps)
    python3 benchmarks/mla_decode.py --tile 64,512,32,8,t     # `_mla_kernel`'s default tile beside these (heads,
                                                              # columns, rows, warps[, t: transposed]) only
    python3 benchmarks/mla_decode.py --prefill 4096           # then one 4096-token prompt's attention (prefill tiles)

Issue 66's commands on the H100 (the kernels and the flash tiles at batch 1/64/256, bf16 and e4m3; then default-mla's
decode step with each kernel): scripts/device-wave5.sh mla.

floor: the larger of the KV-read time -- the cache rows every sequence reads (576 values x 2 bytes, 1 in an e4m3
cache, per token) at the copy bandwidth measured in the same run -- and the tensor-core time -- 2 x 128 heads x (576 +
512) FLOPs per cached row (the scores over the whole row, the output over its latent part) at the GPU's dense bf16 rate
(`checks.limits_of`; an e4m3 cache's rows are multiplied in bf16). At 128 heads the two are close: on the H100 (3.0
TB/s, 989 TFLOP/s) 0.38 against 0.28 ns per cached row with a bf16 cache, 0.19 against 0.28 with e4m3 (FlashMLA
reports ~3,000 GB/s memory-bound and ~580 TFLOP/s compute-bound on an H800). "of floor" is floor / kernel time
(`checks.share_of`). Each kernel is replayed from a CUDA graph (triton.testing.do_bench_cudagraph) as serving replays
it: the splits' launch (storing the step's rows), then the merge; its error against the torch reference is checked on
every configuration timed.
"""
import argparse
import datetime
import shlex
import sys
from dataclasses import replace

import torch
import triton
import triton.testing

from decode_step import copy_bandwidth
from tsdev_kernels.checks import Limits, limits_of, share_of
from tsdev_kernels.ops import mla

HEADS, LATENT, ROPE, PAGE = 128, 512, 64, 16
SCALE = (128 + ROPE) ** -0.5  # V3's softmax scale before YaRN (the kernels' speed does not depend on it)
# the flash kernel's tiles timed (mla_decode_triton's keywords): CUDA_FLASH_TILES' (bf16: 4 chunks, e4m3: 1) and
# their neighbours; 128 heads in one program do not fit (mla_decode.py's docstring): the last row says by how much
FLASH_TILES = [dict(heads=64, block_n=64, chunks=c, num_warps=8) for c in (1, 2, 4)] + [
    dict(heads=64, block_n=32, chunks=2, num_warps=8), dict(heads=128, block_n=16, chunks=2, num_warps=16)]


def decode_cost(sequences: int, context: int, kv_itemsize: int) -> tuple[int, int]:
    """(bytes, FLOPs) of a decode step's attention: every cached row read once, and per head and cached row the
    scores over the row (576) and the output over its latent part (512), 2 FLOPs a product."""
    rows = sequences * context
    return rows * (LATENT + ROPE) * kv_itemsize, 2 * HEADS * (LATENT + ROPE + LATENT) * rows


def floor_us(bytes_: int, flops: int, limits: Limits) -> tuple[float, float, float]:
    """(KV-read µs, tensor-core µs, the floor: the larger of the two) at the limits' bandwidth and dense bf16 rate."""
    read, tensor = bytes_ / limits.bandwidth * 1e6, flops / limits.bf16 * 1e6
    return read, tensor, max(read, tensor)


def measured_limits(bandwidth: float) -> Limits:
    """This GPU's limits (`checks.GPU_LIMITS`) with the copy bandwidth measured in this run; a GPU without a known
    tensor-core rate gets an infinite one (its floor is the KV read alone, and the header says so)."""
    name = torch.cuda.get_device_name()
    known = limits_of(name)
    if known is None:
        return Limits(name, bandwidth, float("inf"), float("inf"), "no tensor-core rate known: the KV read only")
    return replace(known, bandwidth=bandwidth, source=f"copy measured {bandwidth / 1e12:.2f} TB/s in this run; "
                                                     f"{known.bf16 / 1e12:.0f} TFLOP/s dense bf16 (datasheet)")


def step_inputs(sequences: int, context: int, kv_dtype) -> tuple[tuple, torch.Tensor]:
    """A decode step of `sequences` rows each behind context - 1 cached ones (pages in random order), its rows
    stored, and the reference's output."""
    g = torch.Generator(device="cuda").manual_seed(sequences)
    q, cache, cu, lens, table, rows, slots, order, _, latent = mla.mla_batch(
        [1] * sequences, [context - 1] * sequences, HEADS, LATENT, ROPE, PAGE, torch.bfloat16, "cuda", g, kv_dtype)
    mla.store_latent_triton(rows, cache, slots)
    want = mla.mla_attention_ref(q, cache, cu, lens, table, SCALE, latent)
    return (q, cache, cu, lens, table, rows, slots, order), want


def time_decode(kernel, inputs: tuple, want: torch.Tensor, **config) -> tuple[float, float]:
    """(microseconds per call, max error relative to the output's largest value) of `kernel` (mla_attention_triton
    or mla_decode_triton: one contract) on a step's inputs, called as serving calls it: the step's rows stored by the
    kernel (again: the same values)."""
    q, cache, cu, lens, table, rows, slots, order = inputs
    out = torch.empty_like(want)

    def call():
        kernel(q, cache, cu, lens, table, SCALE, LATENT, 1, out=out, order=order, store=(rows, slots), **config)
    call()
    error = float(((out.float() - want.float()).abs().max() / want.float().abs().max()))
    return triton.testing.do_bench_cudagraph(call, rep=100) * 1e3, error


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


def tiles_configs(args) -> list[dict]:
    """`_mla_kernel`'s decode tiles to time: the default, --tile's, and with --sweep its sweep."""
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
    return configs


def flash_configs(args, quantized: bool) -> list[dict]:
    """The flash kernel's configurations to time: its default tile first, the other FLASH_TILES, then the default
    tile at each of --flash-splits."""
    default = mla.CUDA_FLASH_TILES[quantized]
    configs = [{}] + [t for t in FLASH_TILES if t != default]
    return configs + [dict(num_splits=s) for s in args.flash_splits]


def label(config: dict, default: dict | None = None) -> str:
    if not config:
        return "default" + (f" ({', '.join(f'{k} {v}' for k, v in default.items())})" if default else "")
    return ", ".join(f"{k} {v}" for k, v in config.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--kernels", nargs="+", choices=["tiles", "flash", "gluon"],
                        default=["tiles", "flash", "gluon"])
    parser.add_argument("--sweep", action="store_true", help="time each of _mla_kernel's decode tiles at each batch")
    parser.add_argument("--tile", action="append", default=[], metavar="HEADS,COLUMNS,ROWS,WARPS[,t]",
                        help="time this _mla_kernel tile beside its default (t: transposed); repeatable")
    parser.add_argument("--flash-splits", type=int, nargs="*", default=[], metavar="SPLITS",
                        help="also time the flash kernel's default tile at these split counts (default: one wave)")
    parser.add_argument("--gluon-splits", type=int, nargs="*", default=[], metavar="SPLITS",
                        help="also time the Gluon kernel at these split counts (default: one wave)")
    parser.add_argument("--prefill", type=int, default=0, help="also time one prompt of this many tokens")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mla_decode.py times kernels on a CUDA GPU; none is visible")
    limits = measured_limits(copy_bandwidth("cuda"))
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; {HEADS} heads, latent {LATENT} + rope {ROPE}, context {args.context}, pages of "
          f"{PAGE}; {limits.source}. Command: `python3 benchmarks/mla_decode.py {shlex.join(sys.argv[1:])}`\n")
    print("| cache | batch | kernel | configuration | KV read us | tensor us | floor us | kernel us | of floor | bound "
          "| max rel err |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|")
    for kv_dtype, name in ((None, "bf16"), (torch.float8_e4m3fn, "fp8")):
        quantized = kv_dtype is not None
        runs = [("tiles", mla.mla_attention_triton, c, None) for c in tiles_configs(args) if "tiles" in args.kernels]
        runs += [("flash", mla.mla_decode_triton, c, mla.CUDA_FLASH_TILES[quantized])
                 for c in flash_configs(args, quantized) if "flash" in args.kernels]
        gluon_configs = [{}] + [dict(num_splits=n) for n in args.gluon_splits]
        runs += [("gluon", mla.mla_decode_gluon, c, None) for c in gluon_configs if "gluon" in args.kernels]
        for sequences in args.batch:
            inputs, want = step_inputs(sequences, args.context, kv_dtype)
            bytes_, flops = decode_cost(sequences, args.context, 1 if quantized else 2)
            read, tensor, floor = floor_us(bytes_, flops, limits)
            for kernel_name, kernel, config, default in runs:
                row = f"| {name} | {sequences} | {kernel_name} | {label(config, default)} | {read:.1f} | {tensor:.1f} "
                try:
                    us, error = time_decode(kernel, inputs, want, **config)
                except Exception as exc:  # a tile that does not compile (shared memory, registers): say so
                    print(f"{row}| {floor:.1f} | failed: {type(exc).__name__} | | | |")
                    continue
                share, bound = share_of(bytes_, flops, us, limits)
                print(f"{row}| {floor:.1f} | {us:.1f} | {share:.0%} | {bound} | {error:.2e} |")
            del inputs, want
            torch.cuda.empty_cache()
    if args.prefill:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, cache, cu, lens, table, rows, slots, order, max_q_len, latent = mla.mla_batch(
            [args.prefill], [0], HEADS, LATENT, ROPE, PAGE, torch.bfloat16, "cuda", g)
        mla.store_latent_triton(rows, cache, slots)
        ms = triton.testing.do_bench(lambda: mla.mla_attention_triton(q, cache, cu, lens, table, SCALE, latent,
                                                                       max_q_len), rep=200)
        flops = 2 * HEADS * (LATENT + ROPE + LATENT) * args.prefill * (args.prefill + 1) / 2
        print(f"\nprefill of one {args.prefill}-token prompt (absorbed form, causal): {ms:.2f} ms per layer, "
              f"{flops / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
