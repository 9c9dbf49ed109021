"""Issue 35's microbenchmark: decode attention over a bf16 pool and an e4m3 one (--kv-cache-dtype fp8), Qwen3-0.6B's
heads (16 q / 8 kv of 128), at the offline workload's batches (B = 64, 139, 256; contexts 100-2048 in admission
order, as kernels_bench.py's decode rows), each against its floor: the KV bytes it must read at the device's copy
bandwidth. One KV pool per layer (28), replayed in a CUDA graph (kernels_bench.graph_ms). The e4m3 rows are
converted for the tensor-core dots to bfloat16 or float16 (`attention.fp8_dot_dtype`): both are timed.

    python3 benchmarks/fp8_kv.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.decode_step import copy_bandwidth
from benchmarks.kernels_bench import D, HK, LAYERS, graph_ms, layer_batches
from tsdev_kernels.ops import attention


BATCHES = (64, 139, 256)


def decode_batch(B: int):
    """(contexts, q, bf16 pools, e4m3 pools, cu_seqlens, seq_lens, page table, order) of a decode batch of B sequences
    with contexts 100-2048 (seeded by B): one pool per layer, as many layers (up to the model's) as fit in 8 GiB."""
    lens = torch.randint(100, 2049, (B,), generator=torch.Generator().manual_seed(B)).tolist()
    layers = max(1, min(LAYERS, (8 << 30) // (sum(lens) * HK * D * 4)))
    q, caches, cu, sl, pt = layer_batches(lens, [1] * B, layers=layers)
    order = torch.tensor(attention.longest_first(lens), device="cuda")
    fp8 = [tuple(attention.quantize_kv(c, 1.0, attention.FP8_KV_DTYPE) for c in pair) for pair in caches]
    return lens, q, caches, fp8, cu, sl, pt, order


def main() -> None:
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s")
    scale = D**-0.5
    for B in BATCHES:
        lens, q, caches, fp8, cu, sl, pt, order = decode_batch(B)
        times = {}
        for name, pools, itemsize in (("bf16", caches, 2), ("fp8", fp8, 1)):
            t = graph_ms([lambda kc=kc, vc=vc: attention.paged_decode_triton(q, kc, vc, cu, sl, pt, scale, order=order)
                          for kc, vc in pools])
            floor = sum(lens) * HK * D * 2 * itemsize / bw * 1e6
            times[name] = t * 1e3
            print(f"decode B={B} ctx 100-2048 (sum {sum(lens)}) {name}: {t * 1e3:.1f} us per layer, floor "
                  f"{floor:.1f} us ({floor / (t * 1e3):.0%} of it)", flush=True)
        print(f"  fp8 / bf16: {times['fp8'] / times['bf16']:.2f}")
        for dot in (torch.bfloat16, torch.float16):  # what the e4m3 rows are converted to for the dots
            t = graph_ms([lambda kc=kc, vc=vc: attention.paged_decode_triton(q, kc, vc, cu, sl, pt, scale, order=order,
                                                                             fp8_dot=dot) for kc, vc in fp8])
            print(f"  fp8, dots in {str(dot).removeprefix('torch.')}: {t * 1e3:.1f} us", flush=True)
        splits = attention.decode_num_splits(B, HK, q.device)
        for block_n in (16, 32, 64, 128):  # e4m3 rows are half the bytes: the bf16 tuning's block may not be best
            t = graph_ms([lambda kc=kc, vc=vc: attention.paged_decode_triton(q, kc, vc, cu, sl, pt, scale, splits,
                                                                             block_n, order=order) for kc, vc in fp8])
            print(f"  fp8 block_n={block_n} (splits {splits}): {t * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
