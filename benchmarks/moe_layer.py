"""One fused MoE layer (alignment, the gate|up GEMM with SiLU-and-mul, the down GEMM with the router weights, the sum
over k: `tsdev_kernels.ops.moe.fused_moe_triton`) against its weight-read floor and against the torch reference.

    python3 benchmarks/moe_layer.py                                 # Qwen3-30B-A3B's layer: E 128, top 8, I 768, H 2048
    python3 benchmarks/moe_layer.py --tokens 1 16 64 256 --experts 128 --intermediate 768 --hidden 2048

floor: the bytes of the experts the routing touched (w13 and w2 of each, once) at the copy bandwidth measured in the
run. The Triton layer is replayed from a CUDA graph (triton.testing.do_bench_cudagraph), as serving replays it: as
`fused_moe_triton` dispatches (the GEMV path up to GEMV_MAX_TOKENS tokens), and each of its two paths forced (the
GEMV path up to 16 tokens), so the threshold can be read off; the same with FP8 experts (e4m3 + a scale per row,
floor = their bytes). The reference (a loop over the chosen experts, with a host sync) runs eagerly. Then the router
before the layer: the torch one against the fused kernel (tsdev_kernels.ops.router), against its weight-read floor.
Then the layer's launches one by one (torch.profiler over eager calls: each kernel's own time), bf16 and FP8, the
GEMMs (or GEMVs) against the read of their weights.
Configurations: `moe_config` (the tuned file for this shape and GPU when there is one: benchmarks/tune_moe.py). Random
bf16 weights and routings.
"""
import argparse
import datetime
import shlex
import sys

import torch
import triton
import triton.testing

from decode_step import copy_bandwidth, cuda_kernels
from tsdev_kernels.ops import fp8, fp8_block, moe, router


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--block-fp8", action="store_true",
                        help="only the layer with block-FP8 experts (e4m3 + a scale per 128 x 128 block, as Qwen's "
                             "*-FP8 checkpoints store them; activations quantized per token and group of 128 inside)")
    parser.add_argument("--sweep-gemv", action="store_true",
                        help="time the GEMV path's two kernels over a grid of block sizes and warps at each --tokens")
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
    if args.sweep_gemv:
        return sweep_gemv(args, w13, w2, g)
    if args.block_fp8:
        return block_fp8_table(args, w13, w2, bandwidth, g)
    print("| tokens | experts touched | floor us | layer us | layer / floor | aligned GEMMs us | GEMV path us | "
          "fp8 floor us | fp8 layer us | fp8 / its floor | torch ref us | ref / layer | "
          "max rel err | fp8 max rel err |")
    print("|" + "---:|" * 14)
    (q13, s13), (q2, s2) = fp8.quantize_fp8_rows(w13), fp8.quantize_fp8_rows(w2)
    scales = dict(w13_scale=s13.squeeze(-1), w2_scale=s2.squeeze(-1))
    fp8_bytes = expert_bytes // 2 + (w13.shape[1] + w2.shape[1]) * 4  # e4m3 values and a float32 scale per row
    for T in args.tokens:
        x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
        weights, ids = torch.randn(T, E, generator=g, device="cuda").softmax(-1).topk(K, dim=-1)
        weights, ids = (weights / weights.sum(-1, keepdim=True)).float(), ids.int()
        touched = int(ids.unique().numel())
        floor_us, fp8_floor_us = (touched * b / bandwidth * 1e6 for b in (expert_bytes, fp8_bytes))
        graphed = lambda fn: triton.testing.do_bench_cudagraph(fn) * 1e3  # noqa: E731
        layer_us = graphed(lambda: moe.fused_moe_triton(x, w13, w2, weights, ids))
        config = moe.moe_config(E, I, H, x.dtype, T)
        gemm_us = graphed(lambda: moe.fused_moe_triton(x, w13, w2, weights, ids, config=config))
        gemv_us = graphed(lambda: moe.fused_moe_gemv_triton(x, w13, w2, weights, ids)) if T <= 16 else float("nan")
        fp8_us = graphed(lambda: moe.fused_moe_triton(x, q13, q2, weights, ids, **scales))
        ref_us = triton.testing.do_bench(lambda: moe.fused_moe_ref(x, w13, w2, weights, ids)) * 1e3
        errors = []
        for a, b, extra in ((w13, w2, {}), (q13, q2, scales)):
            ours, ref = (f(x, a, b, weights, ids, **extra).float() for f in (moe.fused_moe_triton, moe.fused_moe_ref))
            errors.append(((ours - ref).abs().max() / ref.abs().max()).item())
        print(f"| {T} | {touched} | {floor_us:.1f} | {layer_us:.1f} | {layer_us / floor_us:.2f} | {gemm_us:.1f} | "
              f"{gemv_us:.1f} | {fp8_floor_us:.1f} | {fp8_us:.1f} | {fp8_us / fp8_floor_us:.2f} | {ref_us:.1f} | "
              f"{ref_us / layer_us:.1f} | {errors[0]:.1e} | {errors[1]:.1e} |", flush=True)
    router_table(args, bandwidth, g)
    launch_table(args, w13, w2, (q13, q2, scales), bandwidth, g)


def block_fp8_table(args, w13, w2, bandwidth: float, g: torch.Generator) -> None:
    """The layer with block-FP8 experts, graphed, as `fused_moe` runs it (the activations' group quantization
    included), against the read of the touched experts' e4m3 weights and block scales, and its error against
    `fused_moe_ref(block=)`."""
    E, K, H = args.experts, args.topk, args.hidden
    block = fp8_block.BLOCK
    (q13, s13), (q2, s2) = ([torch.stack(t) for t in zip(*(fp8_block.quantize_fp8_blocks(m) for m in w))]
                            for w in (w13, w2))
    scales = dict(w13_scale=s13, w2_scale=s2, block=block)
    expert_bytes = q13[0].numel() + q2[0].numel() + (s13[0].numel() + s2[0].numel()) * 4
    print("| tokens | experts touched | block-FP8 floor us | layer us | layer / floor | max rel err |")
    print("|" + "---:|" * 6)
    for T in args.tokens:
        x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
        weights, ids = torch.randn(T, E, generator=g, device="cuda").softmax(-1).topk(K, dim=-1)
        weights, ids = (weights / weights.sum(-1, keepdim=True)).float(), ids.int()
        touched = int(ids.unique().numel())
        floor_us = touched * expert_bytes / bandwidth * 1e6
        layer_us = triton.testing.do_bench_cudagraph(lambda: moe.fused_moe_triton(x, q13, q2, weights, ids,
                                                                                    **scales)) * 1e3
        ours = moe.fused_moe_triton(x, q13, q2, weights, ids, **scales).float()
        ref = moe.fused_moe_ref(x, q13, q2, weights, ids, **scales).float()
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        print(f"| {T} | {touched} | {floor_us:.1f} | {layer_us:.1f} | {layer_us / floor_us:.2f} | {err:.1e} |",
              flush=True)


def launches_us(fn, iters: int = 20) -> list[tuple[str, float]]:
    """Each GPU kernel (or memset) one call of `fn` runs, in order, and its mean duration in us over `iters` eager
    calls under torch.profiler: the kernels' own time, without the launch gaps a graph replay removes."""
    kernels = cuda_kernels(fn, iters)
    per_call, left = divmod(len(kernels), iters)
    if left or not per_call:
        sys.exit(f"the profiler saw {len(kernels)} kernels over {iters} calls: not one sequence per call")
    return [(kernels[i].name, sum(kernels[c * per_call + i].device_time_total for c in range(iters)) / iters)
            for i in range(per_call)]


def launch_table(args, w13, w2, fp8_experts, bandwidth: float, g: torch.Generator) -> None:
    """The layer's launches one by one at each token count, bf16 then FP8, the two GEMMs against their floors (the
    touched experts' w13, then w2, read once at the copy bandwidth)."""
    E, K, H = args.experts, args.topk, args.hidden
    q13, q2, scales = fp8_experts
    print("\n| tokens | experts in | launch | kernel | us | floor us |")
    print("|---:|---|---:|---|---:|---:|")
    for T in args.tokens:
        x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
        weights, ids = torch.randn(T, E, generator=g, device="cuda").softmax(-1).topk(K, dim=-1)
        weights, ids = (weights / weights.sum(-1, keepdim=True)).float(), ids.int()
        touched = int(ids.unique().numel())
        for kind, a, b, extra in (("bf16", w13, w2, {}), ("fp8", q13, q2, scales)):
            gemm_floors = iter(touched * w[0].numel() * w.element_size() / bandwidth * 1e6 for w in (a, b))
            for i, (name, us) in enumerate(launches_us(lambda: moe.fused_moe_triton(x, a, b, weights, ids, **extra))):
                is_gemm = "gemm" in name or "gemv" in name
                floor = f"{next(gemm_floors, float('nan')):.1f}" if is_gemm else ""
                print(f"| {T} | {kind} | {i + 1} | {name[:60]} | {us:.1f} | {floor} |", flush=True)


def torch_router(x: torch.Tensor, w: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What runtime/tsdev_runtime/moe/router.py's TopKRouter launches (softmax, top k, renormalised, rounded)."""
    probs = torch.softmax(torch.nn.functional.linear(x, w), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype).float(), ids.to(torch.int32)


def router_table(args, bandwidth: float, g: torch.Generator) -> None:
    """The router before the layer: the torch one (about seven launches) against the fused kernel
    (tsdev_kernels.ops.router), each replayed from a CUDA graph; floor: the router's weights read once."""
    E, K, H = args.experts, args.topk, args.hidden
    w = (torch.randn(E, H, generator=g, device="cuda") * H**-0.5).bfloat16()
    floor_us = w.numel() * w.element_size() / bandwidth * 1e6
    print("\n| tokens | router floor us | torch router us | fused router us | fused / torch | same experts |")
    print("|" + "---:|" * 6)
    for T in args.tokens:
        x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
        torch_us = triton.testing.do_bench_cudagraph(lambda: torch_router(x, w, K)) * 1e3
        fused_us = triton.testing.do_bench_cudagraph(lambda: router.route_triton(x, w, K, True)) * 1e3
        same = torch.equal(router.route_triton(x, w, K, True)[1], router.route_ref(x, w, K, True)[1])
        print(f"| {T} | {floor_us:.1f} | {torch_us:.1f} | {fused_us:.1f} | {fused_us / torch_us:.2f} | {same} |",
              flush=True)


def sweep_gemv(args, w13, w2, g) -> None:
    """The GEMV path at each token count with its up and down kernels' (BLOCK_N, BLOCK_K, num_warps) swept (the
    other kernel at its current config, moe.GEMV_CONFIGS), then the best pair together, against the current pair and
    the aligned GEMMs."""
    import itertools

    E, K, I, H = args.experts, args.topk, args.intermediate, args.hidden
    grid = list(itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8)))
    for T in args.tokens:
        x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
        weights, ids = torch.randn(T, E, generator=g, device="cuda").softmax(-1).topk(K, dim=-1)
        weights, ids = (weights / weights.sum(-1, keepdim=True)).float(), ids.int()
        rule = moe.GEMV_CONFIGS

        def timed(configs):
            fn = lambda: moe.fused_moe_gemv_triton(x, w13, w2, weights, ids, configs=configs)  # noqa: E731
            try:
                fn()
                return triton.testing.do_bench_cudagraph(fn) * 1e3
            except Exception:  # out of registers / shared memory
                return float("inf")

        best = []
        for which in (0, 1):
            times = {c: timed((c, rule[1]) if which == 0 else (rule[0], c)) for c in grid}
            c = min(times, key=times.get)
            best.append(c)
            top = sorted(times.items(), key=lambda kv: kv[1])[:5]
            print(f"T={T} {'up' if which == 0 else 'down'}: current {rule[which]} "
                  f"{times.get(rule[which], float('nan')):.1f} "
                  f"us; best {', '.join(f'{k} {v:.1f}' for k, v in top)}", flush=True)
        gemm = triton.testing.do_bench_cudagraph(lambda: moe.fused_moe_triton(
            x, w13, w2, weights, ids, config=moe.moe_config(E, I, H, x.dtype, T))) * 1e3
        print(f"T={T}: GEMV current {timed(rule):.1f} us, best pair {tuple(best)} {timed(tuple(best)):.1f} us, aligned "
              f"GEMMs {gemm:.1f} us", flush=True)


if __name__ == "__main__":
    main()
