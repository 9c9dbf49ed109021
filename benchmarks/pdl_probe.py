"""The batch-1 projections in a CUDA graph: programmatic dependent launch (PDL) on and off, the norm and the
SwiGLU activation fused into the GEMV or run as kernels of their own, and a sweep of the GEMV's block sizes per
Qwen3-0.6B projection shape (what kernels/tsdev_kernels/ops/linear.py's gemv_config reproduces). Every timing is a graph
of 28 layers' launches, each layer's weights distinct (as in a decode step, nothing stays in L2), replayed.

    python3 benchmarks/pdl_probe.py              # CUDA, Hopper or newer for PDL
    python3 benchmarks/pdl_probe.py --no-sweep
"""
import argparse
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.kernels_bench import graph_ms  # noqa: E402
from tsdev_kernels.ops import activation, linear, norm  # noqa: E402

LAYERS, HIDDEN, INTER, Q, KV = 28, 1024, 3072, 2048, 1024
SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
BF16 = torch.bfloat16


def graph_us(fn) -> float:
    """Microseconds per replay of a graph of fn's launches."""
    return graph_ms([fn], iters=50) * 1e3


def set_pdl(on: bool) -> None:
    os.environ["TSDEV_PDL"] = "1" if on else "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [{name: torch.randn(n, k, device="cuda", dtype=BF16) * k ** -0.5 for name, (n, k) in SHAPES.items()}
              for _ in range(LAYERS)]
    norms = [(torch.randn(HIDDEN, device="cuda", dtype=BF16), torch.randn(HIDDEN, device="cuda", dtype=BF16))
             for _ in range(LAYERS)]
    x = torch.randn(1, HIDDEN, device="cuda", dtype=BF16)
    gb = sum(w.numel() * 2 for layer in layers for w in layer.values()) / 1e9

    def plain():  # the four projections, the norms and the activation as kernels of their own
        h, r = x, x
        for w, (n1, n2) in zip(layers, norms):
            h, r = norm.rms_norm_triton(h, n1, 1e-6, r)
            h = linear.gemv_triton(linear.gemv_triton(h, w["qkv"])[:, :Q], w["o"])
            h, r = norm.rms_norm_triton(h, n2, 1e-6, r)
            h = linear.gemv_triton(activation.silu_and_mul_triton(linear.gemv_triton(h, w["gate_up"])), w["down"])

    def fused():  # the norms inside the q|k|v and gate|up GEMVs, the activation after gate|up's
        h, r = x, x
        for w, (n1, n2) in zip(layers, norms):
            qkv, r = linear.gemv_triton(h, w["qkv"], residual=r, norm_weight=n1, eps=1e-6)
            h = linear.gemv_triton(qkv[:, :Q], w["o"])
            act, r = linear.gemv_triton(h, w["gate_up"], residual=r, norm_weight=n2, eps=1e-6, gated=True)
            h = linear.gemv_triton(act, w["down"])

    for name, fn, launches in (("separate kernels", plain, 8), ("norm + activation fused", fused, 4)):
        for on in (False, True):
            set_pdl(on)
            t = graph_us(fn)
            print(f"{name:<24} pdl={on!s:<5}: {t:7.1f} us for {launches * LAYERS} launches ({gb:.2f} GB of weights, "
                  f"{gb * 1e3 / t:.2f} TB/s)", flush=True)
    set_pdl(True)
    a, b = torch.randn(1, HIDDEN, device="cuda", dtype=BF16), torch.randn(HIDDEN, device="cuda", dtype=BF16)
    for on in (False, True):
        set_pdl(on)
        print(f"300 rms_norm launches, pdl={on}: "
              f"{graph_us(lambda: [norm.rms_norm_triton(a, b, 1e-6) for _ in range(300)]):.1f} us",
              flush=True)
    if args.no_sweep:
        return
    set_pdl(True)
    inputs = {name: torch.randn(1, k, device="cuda", dtype=BF16) for name, (_, k) in SHAPES.items()}
    best = {}
    for name, (n, k) in SHAPES.items():
        fuse = name in ("qkv", "gate_up")
        results = []
        block_ks = ([triton.next_power_of_2(k)] if fuse
                    else [bk for bk in (512, 1024, 2048, 4096) if bk <= triton.next_power_of_2(k)])
        for block_n, block_k, warps in itertools.product((1, 2, 4, 8, 16), block_ks, (1, 2, 4, 8)):
            if block_n * block_k > 16384:
                continue
            kwargs = (dict(residual=inputs[name], norm_weight=norms[0][0], eps=1e-6, gated=name == "gate_up") if fuse
                      else {})
            t = graph_us(lambda: [linear.gemv_triton(inputs[name], w[name], block_n=block_n, block_k=block_k,
                                                     num_warps=warps, **kwargs)
                                  for w in layers]) / LAYERS
            results.append((t, block_n, block_k, warps))
            print(f"  {name} [{n}x{k}]{' fused' if fuse else ''} block_n={block_n} block_k={block_k} warps={warps}: "
                  f"{t:.2f} us ({n * k * 2 / t / 1e6:.2f} TB/s)", flush=True)
        best[(n, k)] = min(results)[1:]
        print(f"best {name}: {min(results)[0]:.2f} us with {min(results)[1:]}", flush=True)
    print(f"GEMV_CONFIGS = {best}")


if __name__ == "__main__":
    main()
