"""A block-FP8 projection (`fp8_block_linear_triton`: the per-token-group quantization of x, then the block GEMM) at
Qwen3-8B's four projection shapes, beside torch._scaled_mm with row-wise scales (cuBLASLt; x already quantized) and
bf16 F.linear (cuBLAS) in the same run, each replayed from a CUDA graph. Then the GEMV (`fp8_block_gemv_triton`, its
quantization inside) up to 16 rows, and each of `--configs` (BLOCK_M, BLOCK_N, num_warps, and the shares K is split
into: 1 none, left out the served rule, `block_gemm_split`) of the block GEMM alone (x quantized beforehand), to read
off GEMV_MAX_ROWS, the best configuration by M and whether the split pays.

    python3 benchmarks/fp8_block_linear.py
    python3 benchmarks/fp8_block_linear.py --m 1 16 64 256 2048 --configs 16,64,4 16,128,4 64,128,4 64,64,4 128,128,8
    python3 benchmarks/fp8_block_linear.py --tune --shape 2048,4096 --shape 4096,1024   # write the tuned files

--tune then runs `tsdev tune --gemm N,K` for each shape (tsdev/tune.py: the fast search at each M bucket and the
crossover against torch._scaled_mm), writing the user's cache (<cache>/tuned/gemm_configs/N=..,K=..,dtype=
float8_e4m3fn,block=128x128,device=...json), which `block_gemm_config` reads first; without a file the block GEMM
runs (64, 128, 4) at every M. --shape N,K (repeatable) replaces Qwen3-8B's four projections: a
projection's output and input features on one rank.
"""
import argparse
import datetime
import shlex
import sys

import torch
import triton

from tsdev_kernels.ops import fp8, fp8_block

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 16, 64, 256, 2048])
    parser.add_argument("--configs", nargs="*", default=["16,64,4,1", "64,64,4,1", "64,128,4,1", "64,128,4,2",
                                                         "64,128,4,4", "64,128,4,8", "64,128,4", "128,128,8"],
                        help="BLOCK_M,BLOCK_N,num_warps[,shares of K]; without the fourth, block_gemm_split's")
    parser.add_argument("--shape", action="append", metavar="N,K", help="a projection's shape (default: Qwen3-8B's)")
    parser.add_argument("--tune", action="store_true", help="then tune each shape (tsdev tune --gemm N,K) into the "
                                                            "user's cache, which the block GEMM reads first")
    args = parser.parse_args()
    shapes = ({s: tuple(int(v) for v in s.split(",")) for s in args.shape} if args.shape else SHAPES)
    if not torch.cuda.is_available():
        sys.exit("fp8_block_linear.py times kernels on a CUDA GPU; none is visible")
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}. Command: `python3 benchmarks/fp8_block_linear.py {shlex.join(sys.argv[1:])}`\n")
    print("| proj | M | ours us (quant + GEMM) | _scaled_mm row-wise us | ours / scaled_mm | bf16 us | GEMV us | "
          "best config | best GEMM us | " + " | ".join(f"{c}" for c in configs) + " |")
    print("|" + "---:|" * (9 + len(configs)))
    g = torch.Generator(device="cuda").manual_seed(0)
    graphed = lambda fn: triton.testing.do_bench_cudagraph(fn) * 1e3  # noqa: E731
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).bfloat16()
        wq, w_scale = fp8_block.quantize_fp8_blocks(w.float())
        w_rows, w_row_scale = fp8.quantize_fp8_rows(w)
        for m in args.m:
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            ours = graphed(lambda: fp8_block.fp8_block_linear_triton(x, wq, w_scale))
            xq_rows, x_row_scale = fp8.quantize_fp8_rows(x)
            scaled = graphed(lambda: torch._scaled_mm(xq_rows, w_rows.t(), scale_a=x_row_scale.float(),
                                                      scale_b=w_row_scale.float().t(), out_dtype=torch.bfloat16))
            bf16 = graphed(lambda: torch.nn.functional.linear(x, w))
            gemv = graphed(lambda: fp8_block.fp8_block_gemv_triton(x, wq, w_scale)) if m <= 16 else float("nan")
            xq, x_scale = fp8_block.quantize_fp8_token_groups_triton(x)
            per_config = [graphed(lambda c=c: fp8_block.fp8_block_gemm_triton(xq, x_scale, wq, w_scale, config=c))
                          for c in configs]
            best = min(range(len(configs)), key=per_config.__getitem__)
            print(f"| {name} | {m} | {ours:.1f} | {scaled:.1f} | {ours / scaled:.2f} | {bf16:.1f} | {gemv:.1f} | "
                  f"{configs[best]} | "
                  f"{per_config[best]:.1f} | " + " | ".join(f"{t:.1f}" for t in per_config) + " |", flush=True)
    if args.tune:
        from tsdev.tune import Job, tune, tuned_dir
        from tsdev.tune_gpu import CudaTimer

        timer = CudaTimer()
        try:
            tune([Job("gemm", shape, name) for name, shape in shapes.items()], timer, tuned_dir(),
                 torch.cuda.get_device_name())
        finally:
            timer.close()


if __name__ == "__main__":
    main()
