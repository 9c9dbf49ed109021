"""Does programmatic dependent launch (PDL) shorten a captured decode step at batch 1? A probe on the
Qwen3-0.6B projection shapes: 28 layers x (qkv, o, gate_up, down) one-row GEMVs chained as in a step, in a
CUDA graph, with the runtime's GEMV against one that loads its first weight chunk before waiting on the
previous kernel (`gdc_wait`) and is launched with `launch_pdl=True`; then a chain of 300 tiny row kernels
with and without PDL (what a norm or an activation costs per launch).

    python3 benchmarks/pdl_probe.py          # CUDA, Hopper or newer
"""
import itertools
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kernels.ops import linear  # noqa: E402

LAYERS, HIDDEN, INTER, Q, KV = 28, 1024, 3072, 2048, 1024
SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}


@triton.jit
def _gemv_pdl(X, W, OUT, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EARLY: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    rows = W + cols[:, None].to(tl.int64) * stride_wn
    if EARLY:
        gdc_launch_dependents()
    w = tl.load(rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + k0 + ks, mask=(k0 + ks) < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        nk = k0 + BLOCK_K + ks
        w = tl.load(rows + nk[None, :], mask=col_ok[:, None] & (nk < K)[None, :], other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=1).to(OUT.dtype.element_ty), mask=col_ok)


@triton.jit
def _row_kernel(X, OUT, N: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    i = tl.arange(0, N)
    x = tl.load(X + i).to(tl.float32)
    tl.store(OUT + i, (x / tl.sqrt(tl.sum(x * x) / N + 1e-6)).to(OUT.dtype.element_ty))


def graph_us(fn, iters=50) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main() -> None:
    torch.manual_seed(0)
    weights = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}
               for _ in range(LAYERS)]
    x = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    outs = {name: torch.empty(n, device="cuda", dtype=torch.bfloat16) for name, (n, _) in SHAPES.items()}
    inputs = {"qkv": x, "o": outs["qkv"][:Q], "gate_up": outs["o"], "down": outs["gate_up"][:INTER]}
    gb = sum(w.numel() * 2 for layer in weights for w in layer.values()) / 1e9

    def chain(project):
        def run():
            for layer in weights:
                for name in SHAPES:
                    project(name, inputs[name], layer[name], outs[name])
        return run

    def base(name, x, w, out):
        linear._gemv_kernel[(triton.cdiv(w.shape[0], 4),)](
            x, w, w, w, out, w.shape[0], w.shape[1], w.stride(0), HAS_BIAS=False, HAS_SCALE=False, BLOCK_N=4,
            BLOCK_K=min(1024, w.shape[1]), num_warps=2, num_stages=3)

    def pdl(block_n, block_k, warps, early, launch=True):
        def project(name, x, w, out):
            _gemv_pdl[(triton.cdiv(w.shape[0], block_n),)](x, w, out, w.shape[0], w.shape[1], w.stride(0),
                                                            BLOCK_N=block_n, BLOCK_K=min(block_k, w.shape[1]),
                                                            EARLY=early, num_warps=warps, launch_pdl=launch)
        return project

    # correctness of the probe kernel against torch, on this run's random inputs
    for name, (n, k) in SHAPES.items():
        w, xx = weights[0][name], torch.randn(k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        pdl(4, 1024, 2, True)(name, xx, w, out)
        torch.testing.assert_close(out.float(), (w.float() @ xx.float()), atol=0.5, rtol=2e-2)

    t = graph_us(chain(base))
    print(f"runtime GEMV chain (112 launches, {gb:.2f} GB): {t:.1f} us, {gb * 1e3 / t:.2f} TB/s", flush=True)
    for (block_n, block_k, warps), early, launch in itertools.product(
            [(4, 1024, 2), (2, 1024, 2), (8, 512, 4), (4, 512, 2), (8, 1024, 4), (16, 256, 4)], (False, True), (False, True)):
        t = graph_us(chain(pdl(block_n, block_k, warps, early, launch)))
        print(f"prefetch GEMV block_n={block_n} block_k={block_k} warps={warps} early_trigger={early} pdl={launch}: "
              f"{t:.1f} us, {gb * 1e3 / t:.2f} TB/s", flush=True)
    for name, (n, k) in SHAPES.items():
        for block_n, block_k, warps in [(2, 1024, 2), (4, 1024, 2), (4, 1024, 4), (8, 1024, 4), (8, 512, 4), (16, 512, 8)]:
            def one(name=name, block_n=block_n, block_k=block_k, warps=warps):
                for layer in weights:
                    pdl(block_n, block_k, warps, True)(name, inputs[name], layer[name], outs[name])
            t = graph_us(one) / LAYERS
            print(f"  {name} [{n}x{k}] block_n={block_n} block_k={block_k} warps={warps} pdl: {t:.2f} us "
                  f"({n * k * 2 / t / 1e6:.2f} TB/s)", flush=True)
    a, b = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16), torch.empty(HIDDEN, device="cuda", dtype=torch.bfloat16)
    for use in (False, True):
        def tiny(use=use):
            for i in range(300):
                src, dst = (a, b) if i % 2 == 0 else (b, a)
                _row_kernel[(1,)](src, dst, N=HIDDEN, PDL=use, num_warps=4, launch_pdl=use)
        print(f"300 tiny row kernels, pdl={use}: {graph_us(tiny):.1f} us", flush=True)


if __name__ == "__main__":
    main()
