"""Where the GPU's time went in an nsys capture: busy and idle time, the longest idle gaps, GPU time by kind of kernel,
and (given the NVTX trace) each step's period against the GPU time inside it.

    nsys stats --report cuda_gpu_trace,nvtx_pushpop_trace --format csv -o run run.nsys-rep
    python3 benchmarks/nsys_timeline.py run_cuda_gpu_trace.csv [--nvtx run_nvtx_pushpop_trace.csv --step tsdev:schedule]

A step runs from one start of the `--step` range to the next (the engine opens `tsdev:schedule` first in each step);
with async scheduling the host is a step ahead, so a window's GPU time is what the GPU ran meanwhile, whichever step
it belongs to: in steady state the two columns differ by the GPU's idle time per step. The trace may be gzipped.
"""
import argparse
import csv
import gzip
from collections import Counter

KINDS = (("decode attention", ("_decode_kernel",)), ("prefill attention", ("_prefill_kernel",)),
         ("GEMM", ("nvjet", "gemm", "cublas", "_skinny_kernel", "_gemv_kernel", "_gemv_norm_kernel", "splitKreduce")),
         ("copies", ("[CUDA memcpy", "[CUDA memset")))


def read_rows(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path, newline="")) as f:
        return list(csv.DictReader(f))


def gpu_ops(rows: list[dict]) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of every kernel, copy and memset, by start."""
    return sorted((int(r["Start (ns)"]), int(r["Start (ns)"]) + int(r["Duration (ns)"]), r["Name"]) for r in rows)


def kind(name: str) -> str:
    return next((k for k, marks in KINDS if any(m in name for m in marks)), "other")


def idle_gaps(ops: list[tuple[int, int, str]]) -> tuple[int, list[tuple[int, int, str]]]:
    """GPU-busy nanoseconds (overlaps counted once) and the idle gaps: (length, start, the op that ended it)."""
    busy, gaps, end = 0, [], ops[0][0]
    for start, stop, name in ops:
        if start > end:
            gaps.append((start - end, end, name))
        busy += max(0, stop - max(start, end))
        end = max(end, stop)
    return busy, gaps


def step_table(ops: list[tuple[int, int, str]], starts: list[int]) -> list[tuple[int, int]]:
    """(period, GPU-busy) nanoseconds of each step between consecutive step starts."""
    table = []
    for begin, end in zip(starts, starts[1:]):
        inside = [(max(s, begin), min(e, end), n) for s, e, n in ops if e > begin and s < end]
        table.append((end - begin, idle_gaps(inside)[0] if inside else 0))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gpu_trace", help="nsys stats cuda_gpu_trace CSV (.csv or .csv.gz)")
    parser.add_argument("--nvtx", help="nsys stats nvtx_pushpop_trace CSV: per-step periods")
    parser.add_argument("--step", default="tsdev:schedule", help="the NVTX range that opens each step")
    parser.add_argument("--gaps", type=int, default=10, help="how many of the longest idle gaps to list")
    args = parser.parse_args()
    ops = gpu_ops(read_rows(args.gpu_trace))
    span = max(e for _, e, _ in ops) - ops[0][0]
    busy, gaps = idle_gaps(ops)
    print(f"span {span / 1e9:.3f} s, GPU busy {busy / 1e9:.3f} s ({busy / span:.1%}), idle {(span - busy) / 1e9:.3f} s")
    buckets = Counter()
    for length, _, _ in gaps:
        buckets[next(label for limit, label in ((1e6, "> 1 ms"), (1e5, "100 us - 1 ms"), (2e4, "20 - 100 us"),
                                                (5e3, "5 - 20 us"), (0, "< 5 us")) if length > limit)] += length
    print("idle by gap length: " + ", ".join(f"{label} {ns / 1e6:.1f} ms" for label, ns in buckets.most_common()))
    for length, at, name in sorted(gaps, reverse=True)[: args.gaps]:
        print(f"  {length / 1e6:8.3f} ms idle at {(at - ops[0][0]) / 1e6:10.3f} ms, ended by {name[:80]}")
    by_kind = Counter()
    for start, stop, name in ops:
        by_kind[kind(name)] += stop - start
    print("GPU time by kind: " + ", ".join(f"{k} {ns / 1e9:.3f} s" for k, ns in by_kind.most_common()))
    if args.nvtx:
        starts = sorted(int(r["Start (ns)"]) for r in read_rows(args.nvtx) if r["Name"] == args.step)
        table = step_table(ops, starts)
        print(f"{len(table)} steps (from one `{args.step}` to the next): period ms, GPU busy ms")
        for i, (period, step_busy) in enumerate(table):
            print(f"  {i:4d} {period / 1e6:9.3f} {step_busy / 1e6:9.3f}")


if __name__ == "__main__":
    main()
