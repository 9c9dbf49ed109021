"""Issue 65's projection target: the served block-FP8 projection (`fp8_block.fp8_block_linear`, what a block-FP8
checkpoint's layers call: the activations' quantization, then the Triton kernel or torch._scaled_mm by the tuned
crossover) against the best library GEMM alone -- torch._scaled_mm with block scales (cuBLASLt, 1x128 activation
groups, 128x128 weight blocks) or with row-wise scales, the activations quantized beforehand -- at each M. Target:
served <= 1.15 x the best library GEMM at every M from 1 to 2048 on Qwen3-8B's four projections. Beside them the Triton
GEMM (the tuned or default configuration) quantizing its own activation tiles and the same GEMM after a quantization
launch: the A/B that `tsdev tune` records per M (`inside_us`, `triton_us`) and serving follows (`quantizes_inside`).

One timing method for all: each side runs in a CUDA graph over enough distinct copies of the weights and activations
(over twice the GPU's L2 in all) that every call reads its operands from memory, as a decode step's layers do; the
time is the replay's over the number of calls.

    python3 benchmarks/fp8_projection_target.py
    python3 benchmarks/fp8_projection_target.py --m 1 64 2048 --shape 576,7168   # other shapes (N,K: one rank's)
"""
import argparse
import datetime
import math
import shlex
import sys

import torch
import triton

from tsdev_kernels.ops import fp8, fp8_block

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
TARGET = 1.15


def per_call_us(calls: list) -> float:
    """µs per call of `calls` (closures over distinct operands), all replayed from one CUDA graph."""
    return triton.testing.do_bench_cudagraph(lambda: [call() for call in calls]) * 1e3 / len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 16, 64, 256, 1024, 2048])
    parser.add_argument("--shape", action="append", metavar="N,K", help="a projection's shape (default: Qwen3-8B's)")
    args = parser.parse_args()
    shapes = ({s: tuple(int(v) for v in s.split(",")) for s in args.shape} if args.shape else SHAPES)
    if not torch.cuda.is_available():
        sys.exit("fp8_projection_target.py times kernels on a CUDA GPU; none is visible")
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}, L2 {l2 >> 20} MiB. Command: `python3 benchmarks/fp8_projection_target.py "
          f"{shlex.join(sys.argv[1:])}`\n")
    print("| proj | M | served us | served takes | Triton GEMM quantizing inside us | Triton, quantization launch + "
          "GEMM us | block-scaled _scaled_mm us | row-wise _scaled_mm us | "
          f"served / best library | <= {TARGET} |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    fp8_block.scaled_mm_available(device)  # the probe, before any capture
    misses = 0
    for name, (n, k) in shapes.items():
        copies = max(2, math.ceil(2 * l2 / (n * k)))
        weights = []
        for _ in range(copies):
            w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).bfloat16()
            weights.append((fp8_block.quantize_fp8_blocks(w.float()), fp8.quantize_fp8_rows(w)))
        for m in args.m:
            xs = [torch.randn(m, k, generator=g, device="cuda").bfloat16() for _ in range(copies)]
            blocks = [fp8_block.quantize_fp8_token_groups_triton(x) for x in xs]
            rows = [fp8.quantize_fp8_rows(x) for x in xs]
            served = per_call_us([lambda x=x, w=w: fp8_block.fp8_block_linear(x, *w[0])
                                  for x, w in zip(xs, weights)])
            block_scaled = per_call_us([lambda a=a, w=w: fp8_block.fp8_block_scaled_mm(*a, *w[0])
                                        for a, w in zip(blocks, weights)])
            inside = per_call_us([lambda x=x, w=w: fp8_block.fp8_block_gemm_triton(x, None, *w[0])
                                  for x, w in zip(xs, weights)])
            two_launches = per_call_us([  # the Triton path served without a measurement of the other
                lambda x=x, w=w: fp8_block.fp8_block_gemm_triton(*fp8_block.quantize_fp8_token_groups_triton(x), *w[0])
                for x, w in zip(xs, weights)])
            row_wise = per_call_us([
                lambda a=a, w=w: torch._scaled_mm(a[0], w[1][0].t(), scale_a=a[1].float(),
                                                  scale_b=w[1][1].float().t(), out_dtype=torch.bfloat16)
                for a, w in zip(rows, weights)])
            takes = "_scaled_mm" if fp8_block.uses_scaled_mm(m, n, k, device) else (
                "Triton GEMV" if fp8_block.uses_gemv(m, n, k, device) else "Triton GEMM")
            ratio = served / min(block_scaled, row_wise)
            misses += ratio > TARGET
            print(f"| {name} {n}x{k} | {m} | {served:.1f} | {takes} | {inside:.1f} | {two_launches:.1f} | "
                  f"{block_scaled:.1f} | {row_wise:.1f} | "
                  f"{ratio:.2f} | {'yes' if ratio <= TARGET else 'NO'} |", flush=True)
        del weights
        torch.cuda.empty_cache()
    print(f"\n{misses} of {len(shapes) * len(args.m)} over {TARGET}x the best library GEMM")


if __name__ == "__main__":
    main()
