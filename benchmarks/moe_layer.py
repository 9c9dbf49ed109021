"""One fused MoE layer (alignment, the gate|up GEMM with SiLU-and-mul, the down GEMM with the router weights, the sum
over k: `kernels.ops.moe.fused_moe_triton`) against its weight-read floor and against the torch reference.

    python3 benchmarks/moe_layer.py                                  # Qwen3-30B-A3B's layer: E 128, top 8, I 768, H 2048
    python3 benchmarks/moe_layer.py --tokens 1 16 64 256 --experts 128 --intermediate 768 --hidden 2048

floor: the bytes of the experts the routing touched (w13 and w2 of each, once) at the copy bandwidth measured in the
run. The Triton layer is replayed from a CUDA graph (triton.testing.do_bench_cudagraph), as serving replays it; the
reference (a loop over the chosen experts, with a host sync) runs eagerly. Configurations: `moe_config` (the tuned
file for this shape and GPU when there is one: benchmarks/tune_moe.py). Random bf16 weights and routings.
"""
import argparse
import datetime
import shlex
import sys

import torch
import triton
import triton.testing

from decode_step import copy_bandwidth
from kernels.ops import moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_layer.py times kernels on a CUDA GPU; none is visible")
    E, K, I, H = args.experts, args.topk, args.intermediate, args.hidden
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") * I**-0.5).bfloat16()
    bandwidth = copy_bandwidth("cuda")
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    print(f"{datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; E {E}, top {K}, I {I}, H {H}, bf16; copy bandwidth {bandwidth / 1e12:.2f} TB/s. "
          f"Command: `python3 benchmarks/moe_layer.py {shlex.join(sys.argv[1:])}`\n")
    print("| tokens | experts touched | floor us | triton us | triton / floor | torch ref us | ref / triton | max rel err |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T in args.tokens:
        x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
        weights, ids = torch.randn(T, E, generator=g, device="cuda").softmax(-1).topk(K, dim=-1)
        weights, ids = (weights / weights.sum(-1, keepdim=True)).float(), ids.int()
        touched = int(ids.unique().numel())
        floor_us = touched * expert_bytes / bandwidth * 1e6
        triton_us = triton.testing.do_bench_cudagraph(lambda: moe.fused_moe_triton(x, w13, w2, weights, ids)) * 1e3
        ref_us = triton.testing.do_bench(lambda: moe.fused_moe_ref(x, w13, w2, weights, ids)) * 1e3
        ours, ref = moe.fused_moe_triton(x, w13, w2, weights, ids).float(), moe.fused_moe_ref(x, w13, w2, weights, ids).float()
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        print(f"| {T} | {touched} | {floor_us:.1f} | {triton_us:.1f} | {triton_us / floor_us:.2f} | {ref_us:.1f} | "
              f"{ref_us / triton_us:.1f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
