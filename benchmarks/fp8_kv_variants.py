"""Issue 35's exploration: where decode attention over an e4m3 pool spends its time. Compiled for sm_90 (no GPU
needed: `tests/compile_kernels.py`'s way), the kernel reads V for the P @ V dot a byte at a time from shared memory
(64 `LDS.U8` a thread per 64-row block): Triton moves the e4m3 -> f16 conversion after the shared-memory load, into
the dot operand's layout, and an 8-bit operand along the reduced axis (V's rows) has no `ldmatrix` transpose.
Converting V in registers first (`attention._kept_in_registers`, a barrier the move cannot cross) lets the dot read
f16 with `ldmatrix.trans`; the kernel does so (`V_IN_REGISTERS`).

This times the kernel as it is against variants of it, each built from kernels/tsdev_kernels/ops/attention.py's source
with one line replaced (V's conversion left where Triton puts it; K's kept in registers too), over the same e4m3 pools
(Qwen3-0.6B's heads, B = 64/139/256, contexts 100-2048, 28 layers' pools in a CUDA graph, as benchmarks/fp8_kv.py),
at KV blocks of 64 and 128 rows and 2 and 3 stages, and checks each output against the kernel's as it is.

    python3 benchmarks/fp8_kv_variants.py
"""
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.decode_step import copy_bandwidth
from benchmarks.fp8_kv import BATCHES, decode_batch
from benchmarks.kernels_bench import D, HK, graph_ms
from tsdev_kernels.ops import attention

HOST_CHOICE = "V_IN_REGISTERS=quantized and q.is_cuda and dot != torch.float32"
K_CONVERSION = "            k = k.to(DOT)\n"
VARIANTS = {  # name -> {text of kernels/tsdev_kernels/ops/attention.py: its replacement}
    "V moved": {HOST_CHOICE: "V_IN_REGISTERS=False"},  # Triton's own placement: V's conversion after the copy
    "K, V kept": {K_CONVERSION: "            k = _kept_in_registers(k.to(DOT))\n"},
}


def variant(name: str):
    source = (ROOT / "kernels/tsdev_kernels/ops/attention.py").read_text()
    for line, replacement in VARIANTS[name].items():
        assert source.count(line) == 1, f"{line!r} moved: update this benchmark"
        source = source.replace(line, replacement)
    path = Path(f"/tmp/tsdev_attention_{name.replace(' ', '_').replace(',', '')}.py")
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s")
    modules = {"as is": attention, **{name: variant(name) for name in VARIANTS}}
    scale = D**-0.5
    for B in BATCHES:
        lens, q, _, pools, cu, sl, pt, order = decode_batch(B)
        floor = sum(lens) * HK * D * 2 / bw * 1e6
        splits = attention.decode_num_splits(B, HK, q.device)
        expected = attention.paged_decode_triton(q, *pools[0], cu, sl, pt, scale, order=order)
        print(f"B={B} (sum of contexts {sum(lens)}, splits {splits}), e4m3 floor {floor:.1f} us per layer", flush=True)
        for name, module in modules.items():
            got = module.paged_decode_triton(q, *pools[0], cu, sl, pt, scale, order=order)
            err = (got.float() - expected.float()).abs().max().item()
            for block_n in (64, 128):
                for stages in (2, 3):
                    t = graph_ms([lambda kc=kc, vc=vc: module.paged_decode_triton(
                        q, kc, vc, cu, sl, pt, scale, splits, block_n, order=order, num_stages=stages)
                        for kc, vc in pools])
                    shown = "failed" if t is None else f"{t * 1e3:6.1f} us ({floor / (t * 1e3):.0%} of floor)"
                    print(f"  {name:9s} block_n {block_n:3d} stages {stages}: {shown}  max|diff| {err:.1e}",
                          flush=True)


if __name__ == "__main__":
    main()
