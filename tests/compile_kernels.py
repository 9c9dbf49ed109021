"""Compile every kernel on the decode path for the H200 (sm_90, through ptxas) without a GPU, and the Gluon ones;
prints one line per kernel compiled (`compiled NAME shared BYTES`). Run by tests/test_kernels_compile.py in a process
without TRITON_INTERPRET."""
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from tsdev_kernels.ops import activation, attention, linear, norm, rope
from tsdev.hotreload.jit import ast_source

BF16, F32, I32, I64, FP8 = "*bf16", "*fp32", "*i32", "*i64", "*fp8e4nv"


def compile_sm90(fn, pointers: dict[str, str], constants: dict, **options):
    """Compile `fn` with every argument not named in `pointers` (or a float named eps/scale) an int32."""
    signature = {name: pointers.get(name, "fp32" if name in ("eps", "scale_log2") else "i32") for name in fn.arg_names}
    signature.update({name: "constexpr" for name in constants})
    source = ast_source(fn)(fn, signature, {(fn.arg_names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True, **options})
    print("compiled", fn.__name__, "shared", compiled.metadata.shared, flush=True)


def main() -> None:
    for split, store, ordered, kv in ((True, True, True, BF16), (False, False, False, BF16), (True, True, True, FP8)):
        compile_sm90(attention._decode_kernel,
                     dict(Q=BF16, K_CACHE=kv, V_CACHE=kv, O=BF16, PART_O=F32, PART_LSE=F32, ARRIVED=I32, CU=I32,
                          SEQ_LENS=I32, PAGE_TABLE=I32, K_NEW=BF16, V_NEW=BF16, SLOTS=I64, ORDER=I64,
                          k_scale="fp32", v_scale="fp32"),
                     dict(GROUP=2, PAGE_SIZE=16, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, BLOCK_N=32, BLOCK_S=64,
                          SPLIT=split, STORE=store, ORDERED=ordered, PRECISION="tf32", PDL=True, QUANTIZED=kv == FP8,
                          DOT=tl.float16 if kv == FP8 else tl.bfloat16,
                          V_IN_REGISTERS=kv == FP8), num_warps=4, num_stages=3)
    for gated in (True, False):
        compile_sm90(linear._gemv_norm_kernel,
                     dict(X=BF16, R=BF16, NW=BF16, W=BF16, B=BF16, S=F32, OUT=BF16, R_OUT=BF16),
                     dict(HAS_RESIDUAL=True, GATED=gated, HAS_BIAS=False, HAS_SCALE=False, BLOCK_N=4, BLOCK_K=1024,
                          PDL=True), num_warps=2, num_stages=3)
    compile_sm90(linear._gemv_kernel, dict(X=BF16, W="*fp8e4nv", B=BF16, S=F32, OUT=BF16),
                 dict(HAS_BIAS=False, HAS_SCALE=True, BLOCK_N=4, BLOCK_K=1024, PDL=True), num_warps=2, num_stages=3)
    compile_sm90(rope._rope_kernel,
                 dict(Q=BF16, K=BF16, QW=BF16, KW=BF16, Q_OUT=BF16, K_OUT=BF16, POS=I64, COS_SIN=F32),
                 dict(HALF=64, BLOCK_HQ=16, BLOCK_HK=8, BLOCK_HALF=64, NORM=True, PDL=True), num_warps=4)
    compile_sm90(attention._store_kvcache_kernel, dict(K=BF16, V=BF16, K_CACHE=BF16, V_CACHE=BF16, SLOTS=I64),
                 dict(PAGE_SIZE=16, BLOCK_H=8, BLOCK_D=128, PDL=True), num_warps=4)
    compile_sm90(norm._rms_norm_kernel, dict(X=BF16, R=BF16, W=BF16, OUT=BF16, R_OUT=BF16),
                 dict(HAS_RESIDUAL=True, BLOCK=1024, PDL=True), num_warps=4)
    for rows in (1, 4):  # a warp per row
        compile_sm90(norm._rms_norm_gluon_kernel, dict(X=BF16, R=BF16, W=BF16, OUT=BF16, R_OUT=BF16),
                     dict(HAS_RESIDUAL=True, BLOCK=1024, PDL=True), num_warps=rows)
    compile_sm90(activation._silu_and_mul_kernel, dict(X=BF16, OUT=BF16), dict(BLOCK=1024, PDL=True), num_warps=4)
    compile_sm90(linear._skinny_kernel, dict(X=BF16, W=BF16, B=BF16, S=F32, OUT=BF16),
                 dict(HAS_BIAS=False, HAS_SCALE=False, IEEE=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, PDL=True),
                 num_warps=2, num_stages=4)


if __name__ == "__main__":
    main()
