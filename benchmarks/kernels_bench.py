"""Each tsdev_kernels.ops op, Triton vs its torch reference, on the Qwen3-0.6B shape in bf16 (gpt-fast style:
attention reports the bandwidth it achieves next to its time).

    python3 benchmarks/kernels_bench.py            # everything, a markdown table on stdout
    python3 benchmarks/kernels_bench.py --only attention sampling --sweep
    python3 benchmarks/kernels_bench.py --sweep-rows 64 139 256   # the row-tiled Triton GEMM against cuBLAS

Times are per call, GPU time from CUDA events. "graph" replays a CUDA graph of the op's calls back to back,
on distinct inputs so that L2 holds about what a real step's would (4 inputs for the row ops, 28 weights
per projection, one KV cache per layer for attention up to 8 GiB in all): that is what a captured decode
step pays. "eager" launches them one by one, so small ops show launch cost. The attention reference syncs
with the host and cannot be captured (its column says eager). `--only` takes rows, linear, attention,
sampling.
"""
import argparse
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.decode_step import copy_bandwidth
from tsdev_kernels.ops import activation, attention, linear, norm, rope, sampling

HQ, HK, D, HIDDEN, INTER, VOCAB, LAYERS = 16, 8, 128, 1024, 3072, 151936, 28
BF16 = torch.bfloat16


def eager_ms(fns, iters=5) -> float:
    """Per call, calling each of fns once per iteration."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        for fn in fns:
            fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / len(fns)


def graph_ms(fns, iters=10) -> float | None:
    try:
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    except Exception:
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / len(fns)


ROWS: list[str] = []


def report(op: str, shape: str, ref_fns, new_fns, bytes_moved: int | None = None, bw: float = 0.0,
           ref_capturable: bool = True) -> None:
    ref_g, new_g = graph_ms(ref_fns) if ref_capturable else None, graph_ms(new_fns)
    ref_e, new_e = eager_ms(ref_fns), eager_ms(new_fns)
    ref, new = ref_g or ref_e, new_g or new_e
    extra = ""
    if bytes_moved:
        achieved = bytes_moved / (new * 1e-3)
        extra = f"{achieved / 1e9:.0f} GB/s ({achieved / bw:.0%} of copy bw)"
    fmt = lambda v: "-" if v is None else f"{v * 1e3:.1f}"
    row = (f"| {op} | {shape} | {fmt(ref_g)} | {fmt(ref_e)} | {fmt(new_g)} | {fmt(new_e)} | "
           f"{ref / new:.1f}x | {extra} |")
    ROWS.append(row)
    print(row, flush=True)


def rand(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def bench_rows() -> None:
    w = rand(HIDDEN)
    for T in (1, 256, 4096):
        xs = [rand(T, HIDDEN) for _ in range(4)]
        rs = [rand(T, HIDDEN) for _ in range(4)]
        report("rms_norm", f"{T}x{HIDDEN}", [lambda x=x: norm.rms_norm_ref(x, w, 1e-6) for x in xs],
               [lambda x=x: norm.rms_norm_triton(x, w, 1e-6) for x in xs])
        report("fused_add_rms_norm", f"{T}x{HIDDEN}",
               [lambda x=x, r=r: norm.fused_add_rms_norm_ref(x, r, w, 1e-6) for x, r in zip(xs, rs)],
               [lambda x=x, r=r: norm.rms_norm_triton(x, w, 1e-6, r) for x, r in zip(xs, rs)])
    cache = rope.rope_cos_sin_cache(D, 40960, 1e6).cuda()
    qw, kw = rand(D), rand(D)
    for T in (1, 256, 4096):
        qkv = rand(T, (HQ + 2 * HK) * D)
        q, k, _ = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
        q, k = q.view(T, HQ, D), k.view(T, HK, D)
        pos = torch.randint(0, 4096, (T,), device="cuda")
        report("qk_norm_rope (vs 2 rms_norm_ref + apply_rope_ref)", f"T={T}",
               [lambda: rope.qk_norm_rope_ref(q, k, qw, kw, 1e-6, pos, cache)],
               [lambda: rope.rope_triton(q, k, pos, cache, qw, kw, 1e-6)])
        report("apply_rope", f"T={T}", [lambda: rope.apply_rope_ref(q, k, pos, cache)],
               [lambda: rope.rope_triton(q, k, pos, cache)])
    for T in (1, 256, 4096):
        xs = [rand(T, 2 * INTER) for _ in range(4)]
        report("silu_and_mul", f"{T}x{2 * INTER}", [lambda x=x: activation.silu_and_mul_ref(x) for x in xs],
               [lambda x=x: activation.silu_and_mul_triton(x) for x in xs])
    kc, vc = rand(4096, 16, HK, D), rand(4096, 16, HK, D)
    for T in (1, 256, 4096):
        k, v = rand(T, HK, D), rand(T, HK, D)
        slots = torch.randperm(4096 * 16, device="cuda")[:T]
        report("store_kvcache", f"T={T}", [lambda: attention.store_kvcache_ref(k, v, kc, vc, slots)],
               [lambda: attention.store_kvcache_triton(k, v, kc, vc, slots)])


def layer_batches(seq_lens, q_lens, page_size=16, layers=LAYERS):
    """One KV cache per layer (distinct memory), a shared page table: like a real step."""
    pages_per_seq = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq)
    table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32)
    order = torch.randperm(num_pages).tolist()
    for i, n in enumerate(pages_per_seq):
        table[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = rand(sum(q_lens), HQ, D)
    caches = [(rand(num_pages, page_size, HK, D), rand(num_pages, page_size, HK, D)) for _ in range(layers)]
    return q, caches, cu, sl, table.cuda()


def bench_attention(bw: float, sweep: bool) -> None:
    scale = D**-0.5
    for B, ctx in [(1, 512), (8, 512), (64, 512), (256, 512), (1, 4096), (64, 4096)]:
        layers = max(1, min(LAYERS, (8 << 30) // (B * ctx * HK * D * 4)))
        q, caches, cu, sl, pt = layer_batches([ctx] * B, [1] * B, layers=layers)
        kv_bytes = B * ctx * HK * D * 2 * 2
        report("paged_attention decode", f"B={B} ctx={ctx}",
               [lambda kc=kc, vc=vc: attention.paged_attention_ref(q, kc, vc, cu, sl, pt, scale)
                for kc, vc in caches[:2]],
               [lambda kc=kc, vc=vc: attention.paged_attention(q, kc, vc, cu, sl, pt, scale, max_q_len=1)
                for kc, vc in caches], kv_bytes, bw, ref_capturable=False)
        if sweep:
            default = attention.decode_num_splits(B, HK, q.device)
            for splits, block_n, warps, stages in itertools.product(
                    (1, 4, 8, 16, 32, 64) if B <= 8 else (default,), (16, 32, 64) if B <= 8 else (32, 64, 128),
                    (4,) if B <= 8 else (4, 8), (2, 3, 4)):
                t = graph_ms([lambda kc=kc, vc=vc: attention.paged_decode_triton(
                    q, kc, vc, cu, sl, pt, scale, splits, block_n, num_warps=warps, num_stages=stages)
                              for kc, vc in caches])
                print(f"  sweep B={B} ctx={ctx} splits={splits} block_n={block_n} warps={warps} stages={stages}: "
                      f"{t * 1e3:.1f} us ({kv_bytes / (t * 1e-3) / bw:.0%} of copy bw)", flush=True)
    for B in (64, 139, 256):  # the offline workload's decode: contexts of 100-2048 tokens, admission order
        lens = torch.randint(100, 2049, (B,), generator=torch.Generator().manual_seed(B)).tolist()
        layers = max(1, min(LAYERS, (8 << 30) // (sum(lens) * HK * D * 4)))
        q, caches, cu, sl, pt = layer_batches(lens, [1] * B, layers=layers)
        order = torch.tensor(attention.longest_first(lens), device="cuda")
        kv_bytes = sum(lens) * HK * D * 2 * 2
        for label, o in (("admission order", None), ("longest first", order)):
            t = graph_ms([lambda kc=kc, vc=vc: attention.paged_decode_triton(q, kc, vc, cu, sl, pt, scale, order=o)
                          for kc, vc in caches])
            print(f"  decode B={B} ctx 100-2048 (sum {sum(lens)}), {label}: {t * 1e3:.1f} us "
                  f"({kv_bytes / (t * 1e-3) / bw:.0%} of copy bw)", flush=True)
    for name, seq_lens, q_lens in [("1 x 2048 fresh", [2048], [2048]),
                                   ("4 x 512 after 1024 cached", [1536] * 4, [512] * 4),
                                   ("16 x 128 fresh", [128] * 16, [128] * 16)]:
        q, caches, cu, sl, pt = layer_batches(seq_lens, q_lens, layers=4)
        flops = sum(4 * HQ * D * ql * (s - ql / 2) for s, ql in zip(seq_lens, q_lens))
        new = [lambda kc=kc, vc=vc: attention.paged_attention(q, kc, vc, cu, sl, pt, scale, max_q_len=max(q_lens))
               for kc, vc in caches]
        report("paged_attention prefill", name,
               [lambda kc=kc, vc=vc: attention.paged_attention_ref(q, kc, vc, cu, sl, pt, scale)
                for kc, vc in caches[:1]], new,
               ref_capturable=False)
        t = graph_ms(new)
        print(f"  prefill {name}: {flops / (t * 1e-3) / 1e12:.0f} TFLOP/s (causal flops)", flush=True)
        if sweep:
            for bm, bn, warps in itertools.product((32, 64, 128), (32, 64), (4, 8)):
                t = graph_ms([lambda kc=kc, vc=vc: attention.paged_prefill_triton(
                    q, kc, vc, cu, sl, pt, scale, max(q_lens), bm, bn, warps) for kc, vc in caches])
                print(f"  sweep prefill {name} block_m={bm} block_n={bn} warps={warps}: {t * 1e3:.1f} us, "
                      f"{flops / (t * 1e-3) / 1e12:.0f} TFLOP/s", flush=True)


def bench_sampling(bw: float) -> None:
    for S in (1, 16, 64, 256):
        logits = rand(S, VOCAB, dtype=torch.float32, scale=3)
        temps = torch.full((S,), 0.8, device="cuda")
        seeds = torch.randint(0, 2**62, (S,), device="cuda")
        off_k, off_p = torch.zeros(S, dtype=torch.int64, device="cuda"), torch.ones(S, device="cuda")
        top_ks, top_ps = torch.full((S,), 20, device="cuda"), torch.full((S,), 0.9, device="cuda")

        def old_no_filter():  # the runtime sampler's ops when no row filters
            greedy = logits.argmax(-1)
            probs = (logits / temps.unsqueeze(1)).softmax(-1)
            return torch.where(temps > 0, (probs / torch.empty_like(probs).exponential_()).argmax(-1), greedy)

        def old_filtered():
            return sampling.sample_ref(logits, temps, top_ks, top_ps, torch.empty_like(logits).exponential_())

        report("sample, no filters (old sampler ops vs race kernel)", f"S={S}", [old_no_filter],
               [lambda: sampling.sample(logits, temps, off_k, off_p, seeds, max_top_k=0)], S * VOCAB * 4, bw)
        report("sample, top_k=20 top_p=0.9 (sort vs topk+kernel)", f"S={S}", [old_filtered],
               [lambda: sampling.sample(logits, temps, top_ks, top_ps, seeds, max_top_k=20)])
        for chunks in (16, 256):
            report(f"sample, top_k=20 top_p=0.9: plain topk vs two-stage topk ({chunks} chunks)", f"S={S}",
                   [lambda: sampling.sample_top_k_triton(logits, temps, top_ks, top_ps, seeds, 20, 1)],
                   [lambda c=chunks: sampling.sample_top_k_triton(logits, temps, top_ks, top_ps, seeds, 20, c)])
        report("sample, top_k=20 top_p=0.9, no promise (sort+race)", f"S={S}", [old_filtered],
               [lambda: sampling.sample(logits, temps, top_ks, top_ps, seeds)])
        report("greedy floor: logits.argmax vs race kernel at T=0", f"S={S}", [lambda: logits.argmax(-1)],
               [lambda: sampling.race_triton(logits, torch.zeros_like(temps), seeds)], S * VOCAB * 4, bw)


# (name, N, K, calls per decode step)
PROJECTIONS = [("qkv_proj", (HQ + 2 * HK) * D, HIDDEN, LAYERS), ("o_proj", HIDDEN, HQ * D, LAYERS),
               ("gate_up_proj", 2 * INTER, HIDDEN, LAYERS), ("down_proj", HIDDEN, INTER, LAYERS),
               ("lm_head", VOCAB, HIDDEN, 1)]


def bench_linear(bw: float, sweep: bool) -> None:
    """cuBLAS (F.linear) vs the Triton GEMV at one row and the skinny kernel at 2/4/8/16 rows, 28 weights per
    projection like a step. With --sweep: both kernels' configurations (skinny at 2 and 8 rows) ranked by the
    time of one step's projections."""
    weights = {name: [rand(n, k, scale=k ** -0.5) for _ in range(min(calls, 28))] for name, n, k, calls in PROJECTIONS}
    inputs = {k: rand(1, k) for _, _, k, _ in PROJECTIONS}
    for name, n, k, _ in PROJECTIONS:
        x = inputs[k]
        report(f"linear {name}", f"1x{k} @ {k}x{n}", [lambda w=w: linear.linear_ref(x, w) for w in weights[name]],
               [lambda w=w: linear.gemv_triton(x, w) for w in weights[name]], n * k * 2, bw)
    for m in (2, 4, 8, 16):
        for name, n, k, _ in PROJECTIONS:
            x = rand(m, k)
            report(f"linear {name} (skinny)", f"{m}x{k} @ {k}x{n}",
                   [lambda w=w: linear.linear_ref(x, w) for w in weights[name]],
                   [lambda w=w: linear.skinny_triton(x, w) for w in weights[name]], n * k * 2, bw)
    if not sweep:
        return
    for m in (2, 8):
        rows = {k: rand(m, k) for _, _, k, _ in PROJECTIONS}
        skinny = {}
        for bn, bk, warps, stages in itertools.product((16, 32, 64), (64, 128, 256, 512), (2, 4), (2, 3, 4)):
            times = [graph_ms([lambda w=w, x=rows[k]: linear.skinny_triton(x, w, None, bn, bk, warps, stages)
                               for w in weights[name]]) for name, n, k, _ in PROJECTIONS]
            skinny[(bn, bk, warps, stages)] = (sum((t or float("inf")) * c for t, (*_, c) in zip(times, PROJECTIONS)),
                                               times)
        print_sweep(f"skinny M={m}", skinny,
                    [graph_ms([lambda w=w, x=rows[k]: linear.linear_ref(x, w) for w in weights[name]])
                     for name, n, k, _ in PROJECTIONS])
    configs = itertools.product((2, 4, 8, 16), (256, 512, 1024), (2, 4, 8), (2, 3))
    per_step = {}
    for bn, bk, warps, stages in configs:
        times = [graph_ms([lambda w=w, x=inputs[k]: linear.gemv_triton(x, w, None, bn, bk, warps, stages)
                           for w in weights[name]]) for name, n, k, _ in PROJECTIONS]
        total = sum((t if t is not None else float("inf")) * calls for t, (*_, calls) in zip(times, PROJECTIONS))
        per_step[(bn, bk, warps, stages)] = (total, times)
    print_sweep("GEMV", per_step, [graph_ms([lambda w=w, x=inputs[k]: linear.linear_ref(x, w) for w in weights[name]])
                                   for name, n, k, _ in PROJECTIONS])


def sweep_rows(batches: list[int]) -> None:
    """At decode batches past SKINNY_ROWS every projection goes to cuBLAS (~6-7 us each at 139 rows on the H200,
    ~0.73 ms a step, against a ~0.2 ms read of the weights: git show 5461bb2:docs/results.md): the skinny kernel
    tiled over rows (`skinny_triton(block_m=...)`, with programmatic dependent launch) over a small grid at each
    batch, against cuBLAS, 28 weights per projection, ranked by one step's projection time."""
    weights = {name: [rand(n, k, scale=k ** -0.5) for _ in range(min(calls, 28))] for name, n, k, calls in PROJECTIONS}
    for m in batches:
        rows = {k: rand(m, k) for _, _, k, _ in PROJECTIONS}
        per_step = {}
        for bm, bn, bk, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (64, 128), (4, 8), (3, 4)):
            if bm > 2 * triton.next_power_of_2(m) or (bm == 128 and warps == 4):
                continue
            times = [graph_ms([lambda w=w, x=rows[k]: linear.skinny_triton(x, w, None, bn, bk, warps, stages,
                                                                             block_m=bm) for w in weights[name]])
                     for name, n, k, _ in PROJECTIONS]
            per_step[(bm, bn, bk, warps, stages)] = (
                sum((t or float("inf")) * c for t, (*_, c) in zip(times, PROJECTIONS)), times)
        print_sweep(f"rows M={m} (block_m, block_n, block_k, warps, stages)", per_step,
                    [graph_ms([lambda w=w, x=rows[k]: linear.linear_ref(x, w) for w in weights[name]])
                     for name, n, k, _ in PROJECTIONS])


def print_sweep(title: str, per_step: dict, cublas: list[float]) -> None:
    """The best configurations by one step's projection time, the best per projection, and cuBLAS's."""
    names = " ".join(name for name, *_ in PROJECTIONS)
    print(f"  sweep {title}: (block_n, block_k, warps, stages): us per step ({names}: us each)")
    for config, (total, times) in sorted(per_step.items(), key=lambda kv: kv[1][0])[:6]:
        each = " ".join("-" if t is None else f"{t * 1e3:.1f}" for t in times)
        print(f"    {config}: {total * 1e3:.1f} us ({each})")
    for i, (name, *_rest) in enumerate(PROJECTIONS):
        config, (_, times) = min(per_step.items(), key=lambda kv: kv[1][1][i] or float("inf"))
        print(f"    best for {name}: {config} {times[i] * 1e3:.1f} us")
    print(f"    cuBLAS: {sum(t * calls for t, (*_, calls) in zip(cublas, PROJECTIONS)) * 1e3:.1f} us per step "
          f"({' '.join(f'{t * 1e3:.1f}' for t in cublas)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=["rows", "linear", "attention", "sampling"],
                        choices=["rows", "linear", "attention", "sampling"])
    parser.add_argument("--sweep", action="store_true",
                        help="time the configurations of the linear and attention kernels")
    parser.add_argument("--sweep-rows", type=int, nargs="*", metavar="M",
                        help="only the row-tiled Triton GEMM against cuBLAS at these decode batches (e.g. 64 139 256)")
    args = parser.parse_args()
    if args.sweep_rows:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
        return sweep_rows(args.sweep_rows)
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s\n")
    print("| op | shape | ref graph us | ref eager us | triton graph us | triton eager us | speedup | bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    if "rows" in args.only:
        bench_rows()
    if "linear" in args.only:
        bench_linear(bw, args.sweep)
    if "attention" in args.only:
        bench_attention(bw, args.sweep)
    if "sampling" in args.only:
        bench_sampling(bw)


if __name__ == "__main__":
    main()
