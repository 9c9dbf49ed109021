"""The projection and attention kernels' configurations follow the model's shapes: Qwen3-0.6B keeps the measured
ones, and for every projection (bf16 and e4m3 weights) and attention variant of Qwen3-0.6B, Llama-3.2-1B and
Qwen2.5-1.5B (the last two also per rank at --tp 2), and DeepSeek-V3's latent attention, the configuration chosen
compiles for the H200 (sm_90, through ptxas, no GPU needed) without register spills, read from the cubin with the
CUDA tools Triton's wheel ships (`cuobjdump -res-usage`).

The compiling runs in a subprocess without TRITON_INTERPRET (this file run as a script): under the interpreter
the kernels are not compilable objects. The launches are the real ones (`gemv_triton`, `paged_decode_triton`,
`paged_prefill_triton` on meta tensors of the served shapes), recorded instead of run, and compiled with the
signature Triton's JIT gives those arguments (an int == 1 a constant, a multiple of 16 or a 16-byte aligned
pointer marked divisible, except the parameters a kernel does not specialise)."""
import pytest
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tsdev_kernels.ops import attention, linear
from tsdev.launch.child import project_pythonpath
from tsdev_runtime.config import DEFAULT_CAPTURE_SIZES

ROOT = Path(__file__).resolve().parent.parent
H200_SMS = 132
# hidden, intermediate, query heads, KV heads, head_dim, vocabulary
SHAPES = {
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256),
    "qwen2.5-1.5b": (1536, 8960, 12, 2, 128, 151936),
}
CASES = [("qwen3-0.6b", 1), ("llama-3.2-1b", 1), ("llama-3.2-1b", 2), ("qwen2.5-1.5b", 1), ("qwen2.5-1.5b", 2)]


def heads(shape: str, tp: int) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of one rank: KV heads fewer than the ranks are replicated, one per rank."""
    _, _, hq, hk, d, _ = SHAPES[shape]
    return hq // tp, max(1, hk // tp), d


def projections(shape: str, tp: int) -> dict[str, tuple[int, int, bool, bool, bool]]:
    """name -> (outputs, inputs, norm fused, gated, bias) of one rank's projections at batch 1: q|k|v and gate|up
    with their norm fused (tsdev_runtime.layers.linear.norm_linear), column-parallel ones split by outputs,
    o_proj / down_proj by inputs, the lm_head by (padded) vocabulary rows."""
    hidden, inter, _, _, _, vocab = SHAPES[shape]
    hq, hk, d = heads(shape, tp)
    return {"qkv": ((hq + 2 * hk) * d, hidden, True, False, shape.startswith("qwen2.5")),
            "o_proj": (hidden, hq * d, False, False, False),
            "gate_up": (inter // tp, hidden, True, True, False),
            "down_proj": (hidden, inter // tp, False, False, False),
            "lm_head": (-(-vocab // tp), hidden, False, False, False)}


def decode_variant(batch: int, hk: int, d: int, kv_bytes: int = 2) -> tuple[bool, int, int]:
    """The decode kernel's constexprs that depend on the batch: (SPLIT, BLOCK_N, BLOCK_S)."""
    splits = attention.decode_splits(batch, hk, H200_SMS)
    return splits > 1, attention.decode_block_n(splits, d, kv_bytes), 1 << (splits - 1).bit_length()


def test_qwen3_0_6b_keeps_its_measured_gemv_configs():
    """benchmarks/pdl_probe.py's best on the H200: the default model's batch-1 decode is unchanged."""
    got = {name: linear.gemv_config(n, k, fused, gated) for name, (n, k, fused, gated, _) in
           projections("qwen3-0.6b", 1).items()}
    assert got == {"qkv": (4, 1024, 2), "o_proj": (2, 2048, 2), "gate_up": (4, 1024, 4), "down_proj": (2, 2048, 8),
                   "lm_head": (4, 1024, 2)}


def test_gemv_configs_keep_tiles_small_and_programs_many():
    for shape, tp in CASES:
        for name, (n, k, fused, gated, _) in projections(shape, tp).items():
            for weight_bytes in (2, 1):  # bf16, e4m3
                block_n, block_k, warps = linear.gemv_config(n, k, fused, gated, weight_bytes)
                where = (shape, tp, name, weight_bytes, (block_n, block_k, warps))
                assert block_n * block_k * (2 if gated else 1) <= 64 * 32 * warps, where
                assert block_k >= k if fused else block_k * weight_bytes <= 4096, where
                assert -(-n // block_n) >= 512 or block_n == 1, where


def test_attention_configs_follow_kv_heads_and_head_dim():
    # Qwen3-0.6B (8 KV heads, head_dim 128): the configurations measured on the H200, unchanged
    splits = {b: attention.decode_splits(b, 8, H200_SMS) for b in (1, 2, 16, 40, 64, 72, 256)}
    assert splits == {1: 64, 2: 33, 16: 5, 40: 2, 64: 2, 72: 1, 256: 1}
    assert [attention.decode_block_n(s, 128) for s in (64, 3, 2, 1)] == [32, 32, 64, 64]
    assert [attention.decode_block_n(s, 128, kv_bytes=1) for s in (64, 2, 1)] == [64, 128, 128]  # e4m3: same bytes
    assert [attention.decode_block_n(s, 128, kv_bytes=4) for s in (64, 1)] == [32, 64]  # float32: as measured
    assert attention.prefill_blocks(128) == (64, 64)
    # few KV heads (Qwen2.5-1.5B: 2, one per rank at --tp 2) split further at batch 1 to fill the SMs
    assert [attention.decode_splits(1, hk, H200_SMS) for hk in (2, 1)] == [128, 128]
    # head_dim 64 (Llama-3.2-1B): the same bytes per K/V block
    assert [attention.decode_block_n(s, 64) for s in (64, 2)] == [64, 128]
    assert attention.prefill_blocks(64) == (64, 128)


def mixed_step(decodes: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mixed step of `decodes` one-row sequences, then two prompts' chunks (20 and 9 rows), four pages each:
    (rows, cu_seqlens_q, seq_lens, page_table, order) as the runner hands them to the attention ops."""
    q_lens, seq_lens = [1] * decodes + [20, 9], [30 + i for i in range(decodes)] + [40, 9]
    order = torch.tensor(attention.split_order(q_lens, seq_lens)[1], dtype=torch.int64)
    return (sum(q_lens), torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), torch.arange(len(q_lens) * 4, dtype=torch.int32).view(-1, 4),
            order)


def recording(monkeypatch, module, kernels: dict) -> dict[str, "Recorder"]:
    """`module`'s kernels replaced by Recorders (each wrapping the original in `kernels`)."""
    launched = {name: Recorder(kernel) for name, kernel in kernels.items()}
    for name, recorder in launched.items():
        monkeypatch.setattr(module, name, recorder)
    return launched


def alignment_key(kernel, launch: tuple) -> str:
    """What Triton's JIT specialises a launch on beyond its signature (divisibility by 16 of pointers and ints)."""
    return repr(specialise(jit(kernel), *launch)[2])


def test_a_mixed_steps_launches_compile_the_same_binaries_whatever_its_count_of_decodes(monkeypatch):
    """The rows after a mixed step's decodes start at an int64 offset (slots, order): 16-byte aligned or not as the
    count is even or odd. A binary specialised on that would compile while serving (the GPU suite caught it)."""
    monkeypatch.setattr(attention, "use_triton", lambda x, family: True)
    hq, hk, d, page = 4, 2, 64, 16
    cache = torch.zeros(32, page, hk, d, dtype=torch.bfloat16)
    kernels = {name: getattr(attention, name)
               for name in ("_decode_kernel", "_prefill_kernel", "_store_kvcache_kernel")}
    keys = []
    for decodes in (1, 2, 3):
        rows, cu, seq_lens, page_table, order = mixed_step(decodes)
        q, k, v = torch.randn(rows, (hq + 2 * hk) * d, dtype=torch.bfloat16).split([hq * d, hk * d, hk * d], dim=1)
        launched = recording(monkeypatch, attention, kernels)
        attention.paged_attention(q.unflatten(1, (hq, d)), cache, cache, cu, seq_lens, page_table, 0.1, max_q_len=20,
                                  store=(k.unflatten(1, (hk, d)), v.unflatten(1, (hk, d)),
                                         torch.arange(rows, dtype=torch.int64)), order=order, decodes=decodes)
        assert all(len(kernel.launches) == 1 for kernel in launched.values()), decodes
        # (the decode kernel's launch takes the batch's own tensors, as a decode step's)
        keys.append([alignment_key(kernels[name], launched[name].launches[0])
                     for name in ("_prefill_kernel", "_store_kvcache_kernel")])
    assert keys[0] == keys[1] == keys[2]


@pytest.mark.parametrize("decode_kernel", ["tiles", "flash"])  # mla.MLA_DECODE: the decode rows' kernel
def test_a_mixed_steps_latent_attention_compiles_the_same_binaries_whatever_its_count_of_decodes(monkeypatch,
                                                                                               decode_kernel):
    """MLA's split as attention's (the test above): the prompts' launch and the store of their latent rows, whichever
    kernel runs the decode rows (`_mla_kernel`'s decode tiles, or mla_decode.py's, which stores their rows)."""
    from tsdev_kernels.ops import mla

    monkeypatch.setattr(mla, "use_triton", lambda x, family: True)
    monkeypatch.setattr(mla, "MLA_DECODE", decode_kernel)
    heads, latent, rope, page = 4, 32, 16, 16
    cache = torch.zeros(32, page, 1, latent + rope, dtype=torch.bfloat16)
    kernels = {name: getattr(mla, name) for name in ("_mla_kernel", "_mla_decode_kernel", "_mla_merge_kernel",
                                                     "_store_latent_kernel")}
    keys = []
    for decodes in (1, 2, 3):
        rows, cu, seq_lens, page_table, order = mixed_step(decodes)
        launched = recording(monkeypatch, mla, kernels)
        mla.mla_attention(torch.randn(rows, heads, latent + rope, dtype=torch.bfloat16), cache, cu, seq_lens,
                          page_table, 0.1, latent, max_q_len=20, order=order, decodes=decodes,
                          store=(torch.randn(rows, 1, latent + rope, dtype=torch.bfloat16),
                                 torch.arange(rows, dtype=torch.int64)))
        decode_launches = launched["_mla_kernel" if decode_kernel == "tiles" else "_mla_decode_kernel"].launches
        assert len(launched["_mla_kernel"].launches) == (2 if decode_kernel == "tiles" else 1)
        assert len(decode_launches) == (2 if decode_kernel == "tiles" else 1)  # (tiles: the prompts' launch too)
        assert len(launched["_store_latent_kernel"].launches) == 1
        keys.append([alignment_key(kernels["_mla_kernel"], launched["_mla_kernel"].launches[-1]),  # the prompts'
                     alignment_key(kernels["_store_latent_kernel"], launched["_store_latent_kernel"].launches[0])])
    assert keys[0] == keys[1] == keys[2]


def test_every_decode_variant_an_eager_step_can_launch_is_compiled_at_startup():
    """Eager decode at any batch size (a step the graphs do not take) launches a variant that the warm-up or a
    graph capture already compiled, given that the split count and the page table's width are not specialised
    (the compiling test checks that)."""
    for max_running in (64, 256):  # EngineConfig's default, the largest captured size
        sizes = [s for s in DEFAULT_CAPTURE_SIZES if s <= max_running]
        for shape, tp in CASES:
            _, hk, d = heads(shape, tp)
            startup = {decode_variant(b, hk, d) for b in (*sizes, 1, 2, max(sizes))}  # + ModelRunner.warmup's
            served = {decode_variant(b, hk, d) for b in range(1, max_running + 1)}
            assert served <= startup, (max_running, shape, tp, served - startup)


@pytest.mark.slow
def test_chosen_configs_compile_for_sm90_without_register_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = project_pythonpath(ROOT, env.get("PYTHONPATH"))
    shards = [subprocess.Popen([sys.executable, __file__, str(i), "2"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in range(2)]  # CI's two cores
    outputs = [shard.communicate(timeout=300) for shard in shards]
    for shard, (out, err) in zip(shards, outputs):
        assert shard.returncode == 0, out + err
    lines = [json.loads(line) for out, _ in outputs for line in out.splitlines() if line.startswith("{")]
    assert lines[0] == {"do_not_specialize": {"_decode_kernel": ["num_splits", "stride_pt"],
                                              "_prefill_kernel": ["ORDER", "stride_pt"],
                                              "_store_kvcache_kernel": ["SLOTS"]}}
    compiled = lines[1:]
    assert sorted(c["label"] for c in compiled) == sorted(record_launches())
    spilled = [c for c in compiled if c["stack"] or c["local"]]
    assert not spilled, "\n".join(map(json.dumps, spilled))


# --------------------------------------------------------------------------------------------------------------
# The subprocess: record the launches, compile each distinct one for sm_90, print its registers and stack.


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the arguments instead of
    launching."""

    def __init__(self, fn):
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


TRITON_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
                torch.float8_e4m3fn: "fp8e4nv"}
OPTIONS = ("num_warps", "num_stages", "launch_pdl")


def jit(kernel):
    """The kernel as Triton's JIT sees it on a GPU (under the interpreter: its function, decorated the same way)."""
    if hasattr(kernel, "params"):
        return kernel
    from triton.runtime.jit import JITFunction

    return JITFunction(kernel.fn, do_not_specialize=kernel.kwargs["do_not_specialize"])


def specialise(fn, args: tuple, kwargs: dict):
    """The (signature, constexprs, attrs, options) Triton's JIT compiles for this launch on a CUDA device."""
    values = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in OPTIONS}
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    if "PDL" in values:  # meta tensors are not on CUDA: launch as on the H200, with programmatic dependent launch
        values["PDL"], options["launch_pdl"] = True, True
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = values[name]
        if param.is_constexpr or (isinstance(value, int) and value == 1 and not param.do_not_specialize):
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, options


def meta(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def record_launches() -> dict[str, tuple]:
    """label -> (kernel, launch args, launch kwargs) of every projection and attention variant of CASES."""
    recorded = {}
    for shape, tp in CASES:
        for name, (n, k, fused, gated, bias) in projections(shape, tp).items():
            rows = n * (2 if gated else 1)
            for fp8 in (False, True) if name != "lm_head" else (False,):  # --quantization fp8 leaves it bf16
                weight = meta(rows, k, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
                # a fused norm with the residual (every layer but the first: a superset of the first's code)
                kernel_name = "_gemv_norm_kernel" if fused else "_gemv_kernel"
                kernel = Recorder(getattr(linear, kernel_name))
                setattr(linear, kernel_name, kernel)
                try:
                    linear.gemv_triton(meta(1, k), weight, meta(rows) if bias else None,
                                       weight_scale=meta(rows, dtype=torch.float32) if fp8 else None,
                                       residual=meta(1, k) if fused else None, norm_weight=meta(k) if fused else None,
                                       eps=1e-6, gated=gated)
                finally:
                    setattr(linear, kernel_name, kernel.fn)
                recorded[f"{shape} tp{tp} {name}{' fp8' if fp8 else ''}"] = (kernel.fn, *kernel.launches[0])
        hq, hk, d = heads(shape, tp)
        qkv = meta(256, (hq + 2 * hk) * d)
        pages = meta(256, 8, dtype=torch.int32)
        ints = meta(257, dtype=torch.int32)
        order = meta(256, dtype=torch.int64)
        for kv in (torch.bfloat16, torch.float8_e4m3fn):  # the pool's dtype (--kv-cache-dtype fp8: e4m3)
            cache, pool = meta(64, 16, hk, d, dtype=kv), "" if kv == torch.bfloat16 else " fp8 KV"
            # every (SPLIT, BLOCK_N) reached, with its largest BLOCK_S (the merge's tile: the most registers)
            variants = {}
            for batch in sorted(DEFAULT_CAPTURE_SIZES, reverse=True):
                variants[decode_variant(batch, hk, d, kv.itemsize)[:2]] = batch
            for batch in variants.values():
                variant = decode_variant(batch, hk, d, kv.itemsize)
                q, k, v = (meta(batch, hq, d), meta(batch, hk, d), qkv[:batch, (hq + hk) * d:].unflatten(1, (hk, d)))
                kernel = attention._decode_kernel = Recorder(attention._decode_kernel)
                try:
                    attention.paged_decode_triton(q, cache, cache, ints[: batch + 1], ints[:batch], pages[:batch], 0.1,
                                                  num_splits=attention.decode_splits(batch, hk, H200_SMS),
                                                  block_n=variant[1], store=(k, v, order[:batch]), order=order[:batch])
                finally:
                    attention._decode_kernel = kernel.fn
                recorded[f"{shape} tp{tp} decode{pool} SPLIT/BLOCK_N/BLOCK_S {variant}"] = (kernel.fn,
                                                                                             *kernel.launches[0])
            kernel = attention._prefill_kernel = Recorder(attention._prefill_kernel)
            try:
                attention.paged_prefill_triton(meta(256, hq, d), cache, cache, ints[:3], ints[:2], pages[:2], 0.1, 200,
                                               *attention.prefill_blocks(d), order=order[:2])
            finally:
                attention._prefill_kernel = kernel.fn
            recorded[f"{shape} tp{tp} prefill{pool}"] = (kernel.fn, *kernel.launches[0])
    return recorded | record_mla_launches() | record_block_fp8_launches()


def record_mla_launches() -> dict[str, tuple]:
    """DeepSeek-V3's latent attention (128 heads, latent 512, rope 64) on CUDA's tiles (`mla.decode_tile`,
    `mla.CUDA_TILE`): decode with splits and the fused store, decode unsplit, a prefill, with a bf16 and an e4m3
    cache; and the expanded form's prefill."""
    from tsdev_kernels.ops import mla

    recorded, heads, latent, rope = {}, 128, 512, 64
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        cache, pool = meta(64, 16, 1, latent + rope, dtype=kv), "" if kv == torch.bfloat16 else " fp8 KV"
        for label, batch, q_len, splits in (("decode split", 4, 1, 8), ("decode", 256, 1, 1), ("prefill", 2, 100, 1)):
            rows, ints = batch * q_len, meta(batch + 1, dtype=torch.int32)
            kernel = mla._mla_kernel = Recorder(mla._mla_kernel)
            merge = mla._mla_merge_kernel = Recorder(mla._mla_merge_kernel)  # (not compiled here: few registers)
            try:
                mla.mla_attention_triton(meta(rows, heads, latent + rope), cache, ints, ints[:batch],
                                         meta(batch, 8, dtype=torch.int32), 0.1, latent, q_len,
                                         out=meta(rows, heads, latent), num_splits=splits,
                                         order=meta(batch, dtype=torch.int64),
                                         **(mla.decode_tile(heads, kv != torch.bfloat16) if q_len == 1
                                            else mla.CUDA_TILE),
                                         store=(meta(rows, 1, latent + rope), meta(rows, dtype=torch.int64))
                                         if q_len == 1 else None)
            finally:
                mla._mla_kernel, mla._mla_merge_kernel = kernel.fn, merge.fn
            recorded[f"deepseek-v3 mla {label}{pool}"] = (kernel.fn, *kernel.launches[0])
    # a long prompt's expanded form: attention.py's prefill over one-token pages, heads 192 wide (a 256 block)
    kernel = attention._prefill_kernel = Recorder(attention._prefill_kernel)
    try:
        ints, rows = meta(3, dtype=torch.int32), meta(8192, 1, heads, 192)
        attention.paged_prefill_triton(meta(4096, heads, 192), rows, rows, ints, ints[:2],
                                       meta(2, 4096, dtype=torch.int32), 0.1, 4096, *attention.prefill_blocks(192),
                                       order=meta(2, dtype=torch.int64))
    finally:
        attention._prefill_kernel = kernel.fn
    recorded["deepseek-v3 mla expanded prefill"] = (kernel.fn, *kernel.launches[0])
    return recorded


def record_block_fp8_launches() -> dict[str, tuple]:
    """The block-FP8 GEMM (`fp8_block_gemm_triton`) at Qwen3-8B's o and q|k|v projections as a block-FP8 checkpoint
    serves them on the H200: unsplit at M 256, split over K as `block_gemm_split` picks at M 16 (4 and 2 shares),
    multiplied on the FP8 tensor cores (F32_DOT off: the meta tensors are not on CUDA); and as the served projection
    launches it, quantizing its bf16 activation tiles itself (x_scale None), at M 16 and 256."""
    from tsdev_kernels.ops import fp8_block

    recorded = {}
    for name, m, n, k, inside in (("o", 256, 4096, 4096, False), ("o", 16, 4096, 4096, False),
                                  ("qkv", 16, 6144, 4096, False), ("qkv", 16, 6144, 4096, True),
                                  ("o", 256, 4096, 4096, True)):
        bm, bn, warps = fp8_block.UNTUNED_GEMM  # (no tuned file for the H200 yet: block_gemm_config serves this)
        split = fp8_block.block_gemm_split(-(-m // bm) * -(-n // bn), k // 128, H200_SMS)
        kernel = fp8_block._block_gemm_kernel = Recorder(fp8_block._block_gemm_kernel)
        try:
            e4m3, scales = torch.float8_e4m3fn, torch.float32
            x = meta(m, k, dtype=torch.bfloat16) if inside else meta(m, k, dtype=e4m3)
            fp8_block.fp8_block_gemm_triton(x, None if inside else meta(m, k // 128, dtype=scales),
                                            meta(n, k, dtype=e4m3), meta(n // 128, k // 128, dtype=scales),
                                            config=(bm, bn, warps, split))
        finally:
            fp8_block._block_gemm_kernel = kernel.fn
        args, kwargs = kernel.launches[0]
        label = f"qwen3-8b block-fp8 {name} M {m} split {split}{' quantizing inside' if inside else ''}"
        recorded[label] = (kernel.fn, args, kwargs | dict(F32_DOT=False))
    return recorded


def compile_sm90(fn, signature, constexprs, attrs, options) -> dict[str, int]:
    """Registers, stack and local memory per thread of the sm_90 binary (cuobjdump -res-usage of the cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    binary = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(binary.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    return dict(zip(("regs", "stack", "shared", "local"), map(int, found.groups())))


def main(shard: int, shards: int) -> None:
    """Compile every `shards`-th distinct binary from the `shard`-th; print one JSON line per launch compiled."""
    if shard == 0:
        kernels = (attention._decode_kernel, attention._prefill_kernel, attention._store_kvcache_kernel)
        print(json.dumps({"do_not_specialize": {k.__name__: sorted(p.name for p in k.params if p.do_not_specialize)
                                                for k in kernels}}), flush=True)
    binaries: dict[str, list[str]] = {}
    launches = record_launches()
    for label, (fn, args, kwargs) in launches.items():
        signature, constexprs, attrs, options = specialise(fn, args, kwargs)
        key = repr((fn.__name__, signature, constexprs, attrs, options))
        binaries.setdefault(key, []).append(label)
    for labels in list(binaries.values())[shard::shards]:
        fn, args, kwargs = launches[labels[0]]
        usage = compile_sm90(fn, *specialise(fn, args, kwargs))
        for label in labels:
            config = {k: v for k, v in launches[label][2].items()
                      if k.startswith("BLOCK") or k in ("num_warps", "SPLIT", "SPLIT_K")}
            print(json.dumps({"label": label, "kernel": fn.__name__, **config, **usage}), flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
