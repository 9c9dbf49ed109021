"""The flash MLA decode kernel's CUDA tiles (`mla.CUDA_FLASH_TILES`, bf16 and e4m3 caches) compile for sm_90 (through
ptxas, no GPU needed) at DeepSeek-V3's shapes (128 heads, latent 512 + rope 64, pages of 16), split with the fused
store and unsplit, within the shared memory an H100 block may use (227 KiB), and spill no more than they did when
chosen (mla.py's CUDA_FLASH_TILES comment: timed on an H100; docs/mla.md names the spills); and at a small model's
shapes (the tests' tiny DeepSeeks: 4 heads, latent 32 + rope 8) in bf16, float32 and e4m3 (32 latent columns in the
bf16 tile's 4 chunks did not compile: `flash_tile` caps the chunks). The launches are
`mla_decode_triton`'s on meta tensors, recorded instead of run and compiled with the signature Triton's JIT gives
them (tests/test_kernel_configs.py's `specialise`), in a subprocess without TRITON_INTERPRET. The Gluon kernel
(mla_decode_gluon.py, what serves V3's shapes on Hopper) the same way at V3's shapes: within the shared memory and
without a spill (254 registers at most: a spill would be a regression the timings did not see)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_kernel_configs import Recorder, meta, specialise
from tsdev.launch.child import project_pythonpath

ROOT = Path(__file__).resolve().parent.parent
H100_SHARED = 227 * 1024  # bytes of shared memory one block may use (sm_90)
SPILLED = {"bf16": 208, "fp8": 376}  # bytes per thread under Triton 3.9 when the H100 timings chose the tiles


@pytest.mark.slow
def test_the_flash_tiles_compile_for_sm90_within_shared_memory_and_their_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = project_pythonpath(ROOT, env.get("PYTHONPATH"))
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=280,
                            cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(c["label"] for c in compiled) == ["bf16 split", "bf16 unsplit", "fp8 split", "fp8 unsplit",
                                                    "gluon bf16 split", "gluon bf16 unsplit", "gluon fp8 split",
                                                    "gluon fp8 unsplit", "tiny bf16", "tiny float32", "tiny fp8"]
    print("\n".join(map(json.dumps, compiled)))
    for c in compiled:
        assert c["shared"] <= H100_SHARED, c
        if c["label"].startswith("gluon"):
            assert c["stack"] == 0, c
        elif not c["label"].startswith("tiny"):
            assert c["stack"] <= SPILLED[c["label"].split()[0]], c


def compile_sm90(fn, signature, constexprs, attrs, options, gluon: bool = False) -> dict[str, int]:
    """Registers and stack (spills) per thread from the cubin, and the shared memory the launch asks for."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    source = (GluonASTSource if gluon else ASTSource)(fn, signature, constexprs, attrs)
    binary = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(binary.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return dict(regs=int(regs), stack=int(stack), shared=binary.metadata.shared)


def main() -> None:
    from tsdev_kernels.ops import mla

    fp8 = torch.float8_e4m3fn
    v3 = (("split", 4, 8), ("unsplit", 256, 1))  # (label, batch, splits)
    cases = [(f"{name} {label}", 128, 512, 64, torch.bfloat16, kv, batch, splits)
             for kv, name in ((torch.bfloat16, "bf16"), (fp8, "fp8")) for label, batch, splits in v3]
    cases += [(f"tiny {name}", 4, 32, 8, q, kv, 4, 2) for name, q, kv in (("bf16", torch.bfloat16, torch.bfloat16),
                                                                          ("float32", torch.float32, torch.float32),
                                                                          ("fp8", torch.bfloat16, fp8))]
    for label, heads, latent, rope, q_dtype, kv, batch, splits in cases:
        cache = meta(64, 16, 1, latent + rope, dtype=kv)
        ints = meta(batch + 1, dtype=torch.int32)
        kernel = mla._mla_decode_kernel = Recorder(mla._mla_decode_kernel)
        merge = mla._mla_merge_kernel = Recorder(mla._mla_merge_kernel)  # (few registers: not compiled here)
        try:
            mla.mla_decode_triton(meta(batch, heads, latent + rope, dtype=q_dtype), cache, ints, ints[:batch],
                                  meta(batch, 8, dtype=torch.int32), 0.1, latent,
                                  out=meta(batch, heads, latent, dtype=q_dtype), num_splits=splits,
                                  order=meta(batch, dtype=torch.int64),
                                  store=(meta(batch, 1, latent + rope, dtype=q_dtype), meta(batch, dtype=torch.int64)),
                                  **mla.flash_tile(kv == fp8, latent))  # the tile CUDA serves these shapes with
        finally:
            mla._mla_decode_kernel, mla._mla_merge_kernel = kernel.fn, merge.fn
        args, kwargs = kernel.launches[0]
        usage = compile_sm90(kernel.fn, *specialise(kernel.fn, args, kwargs))
        tile = {k: kwargs[k] for k in ("HEADS", "BLOCK_N", "CHUNKS", "num_warps")}
        print(json.dumps({"label": label, **tile, **usage}), flush=True)
    mla.gluon_misfit = lambda q, cache, latent: None  # (meta tensors are on no GPU)
    for label, heads, latent, rope, q_dtype, kv, batch, splits in cases[:4]:
        kernel = mla._mla_decode_gluon_kernel = Recorder(mla._mla_decode_gluon_kernel)
        merge = mla._mla_merge_kernel = Recorder(mla._mla_merge_kernel)
        ints = meta(batch + 1, dtype=torch.int32)
        try:
            mla.mla_decode_gluon(meta(batch, heads, latent + rope, dtype=q_dtype), meta(64, 16, 1, latent + rope,
                                 dtype=kv), ints, ints[:batch], meta(batch, 8, dtype=torch.int32), 0.1, latent,
                                 out=meta(batch, heads, latent, dtype=q_dtype), num_splits=splits,
                                 order=meta(batch, dtype=torch.int64),
                                 store=(meta(batch, 1, latent + rope, dtype=q_dtype), meta(batch, dtype=torch.int64)))
        finally:
            mla._mla_decode_gluon_kernel, mla._mla_merge_kernel = kernel.fn, merge.fn
        args, kwargs = kernel.launches[0]
        usage = compile_sm90(kernel.fn, *specialise(kernel.fn, args, kwargs), gluon=True)
        print(json.dumps({"label": f"gluon {label}", "HEADS": kwargs["HEADS"], "BLOCK_N": kwargs["BLOCK_N"],
                          "num_warps": kwargs["num_warps"], **usage}), flush=True)


if __name__ == "__main__":
    main()
