"""The Gluon RMSNorm (kernels/tsdev_kernels/ops/norm.py, TSDEV_KERNELS=gluon:norm) against the Triton one it can
replace, in one process: the device time per call of each, CUDA-graph timed over 4 distinct inputs
(benchmarks/kernels_bench.py's graph_ms), at the rows serving sees (decode batches, prefill chunks) and two hidden
sizes.

    python3 benchmarks/gluon_norm.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernels_bench import graph_ms
from tsdev_kernels.ops import norm


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, bf16; µs per call (graph), ratio = gluon / triton")
    print(f"{'op':<20} {'shape':>11} {'triton':>8} {'gluon':>8} {'ratio':>6}")
    ratios = []
    for hidden in (1024, 4096):
        w = torch.randn(hidden, device="cuda").bfloat16()
        for rows in (1, 8, 64, 256, 1024, 4096, 16384):
            xs = [torch.randn(rows, hidden, device="cuda").bfloat16() for _ in range(4)]
            rs = [torch.randn(rows, hidden, device="cuda").bfloat16() for _ in range(4)]
            for op, residual in (("rms_norm", False), ("fused_add_rms_norm", True)):
                us = {}
                for gluon in (False, True):
                    calls = [lambda x=x, r=r, g=gluon: norm.rms_norm_triton(x, w, 1e-6, r if residual else None,
                                                                           gluon=g)
                             for x, r in zip(xs, rs)]
                    us[gluon] = graph_ms(calls, iters=50) * 1e3
                ratios.append(us[True] / us[False])
                print(f"{op:<20} {f'{rows}x{hidden}':>11} {us[False]:8.2f} {us[True]:8.2f} {ratios[-1]:6.2f}",
                      flush=True)
    ratios.sort()
    print(f"gluon / triton: median {ratios[len(ratios) // 2]:.2f}, best {ratios[0]:.2f}, worst {ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
