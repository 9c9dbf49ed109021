"""Issue 69's check of the share-of-limit figure a reload line shows ("rms_norm [256x4096] 4.1 µs = 82 % of
bandwidth"): for the RMSNorm and the paged decode attention at one served shape each, the figure tsdev computes (its
kernel-check timing, the bytes declared beside the op's CHECKS, the GPU's row of checks.GPU_LIMITS) beside one
computed by hand (the bytes counted from the shape here, the kernel timed here in a CUDA graph of its own, the copy
bandwidth measured now). Target: within 10 %.

run (GPU): python3 benchmarks/share_of_limit.py
"""
import torch

from tsdev_kernels import checks
from tsdev_kernels.ops import attention, norm  # noqa: F401  (their CHECKS are declared when imported)

CALLS = 200


def graph_us(fn) -> float:
    """Device µs per call of `fn`, CALLS of it captured in one CUDA graph, the median of 5 replays."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(CALLS):
                fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[2]


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), 10 of them between two events."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) * 1e-3)


def compare(op: str, shape: tuple, hand_bytes, limits, bandwidth: float) -> tuple:
    """(tsdev µs, tsdev share, hand µs, hand share) on the same inputs: those the check times (checks.timing_inputs),
    their bytes counted here by `hand_bytes(args)` from the tensors' shapes and the cached lengths."""
    check = next(c for c in checks.declared() if c.op == op)
    timing = checks.time_call(check, shape, torch.bfloat16, "cuda")
    share, _ = checks.share_of(*timing.cost, timing.us, limits)
    inputs = checks.timing_inputs(check, shape, torch.bfloat16, "cuda")
    calls = iter(range(10**9))
    hand_us = graph_us(lambda: check.kernel(*inputs[next(calls) % len(inputs)]))
    counted = sum(hand_bytes(args) for args in inputs) / len(inputs)
    return timing.us, share, hand_us, counted / bandwidth / (hand_us * 1e-6)


def norm_bytes(args) -> int:
    x, weight, _ = args
    rows, hidden = x.shape
    return 2 * rows * hidden * 2 + hidden * 2  # x read and the output written (bf16), the weight read


def decode_bytes(args) -> int:
    q, k_cache, v_cache, cu, lens, table, k, v, slots, order, max_q_len = args
    _, _, kv_heads, head_dim = k_cache.shape
    cached = int(lens.sum())  # every cached row's K and V read once (this step's among them)
    return 2 * cached * kv_heads * head_dim * 2 + 2 * q.numel() * 2 + 2 * k.numel() * 2  # + q, out; k, v stored


def main() -> None:
    limits = checks.device_limits("cuda")
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth measured now {bandwidth / 1e12:.2f} TB/s; "
          f"checks.GPU_LIMITS says {limits.bandwidth / 1e12:.2f}")
    rows = [("rms_norm", "[256x4096]", *compare("rms_norm", (256, 4096), norm_bytes, limits, bandwidth)),
            ("paged_decode", "B64 Hq32 Hk8 D128 page 16 ctx<=4096",
             *compare("paged_decode", (64, 32, 8, 128, 16, 4096), decode_bytes, limits, bandwidth))]
    print("| op | shape | tsdev µs | tsdev share | hand µs | hand share | tsdev / hand |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for op, shape, us, share, h_us, h_share in rows:
        print(f"| {op} | {shape} | {us:.1f} | {share:.1%} | {h_us:.1f} | {h_share:.1%} | {share / h_share:.3f} |")


if __name__ == "__main__":
    main()
