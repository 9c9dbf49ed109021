"""`tsdev tune`'s timer on a CUDA GPU: random inputs of a job's shape, each configuration's kernels compiled in
parallel processes first (about a second per binary: one process compiling a search's would take most of its
time), then timed replayed from a CUDA graph (triton.testing.do_bench_cudagraph), each call on its own copy of the
operands where one copy would sit in L2 (`copies_past_l2`: serving's layers each read their weights from memory).

MoE: `fused_moe_triton` (alignment, both GEMMs, the sum; FP8 experts with their activations' quantization) on a
random routing. GEMM: the token-group quantization and the block GEMM (`fp8_block_gemm_triton`), and for the
crossover the chosen configuration quantizing inside (`fp8_block_gemm_triton(x, None, ...)`) and the quantization
and torch._scaled_mm (`fp8_block_linear_scaled_mm`). Block-FP8 experts: the best configuration again with
`quantize_inside` (tsdev/tune.py's `search_bucket`).
"""
import concurrent.futures
import multiprocessing
import os
import sys

import torch

from tsdev.tune import Job
from tsdev.tune_search import Config


def moe_inputs(job: Job, tokens: int, generator: torch.Generator, experts: int | None = None) -> tuple:
    """x, w13, w2, router weights, ids and `fused_moe_triton`'s scales for `tokens` tokens of the job's shape on the
    generator's device; `experts` (default the shape's) fewer for compiling: the binaries do not depend on it. The
    FP8 weights are quantized one expert at a time (a whole layer in float32 would not fit beside the bf16 one)."""
    from tsdev_kernels.ops import fp8, fp8_block

    e, i, h, k = job.shape
    e, device, dtype = experts or e, generator.device, torch.bfloat16
    x = torch.randn(tokens, h, generator=generator, device=device, dtype=dtype)
    w13 = torch.randn(e, 2 * i, h, generator=generator, device=device, dtype=dtype) * 0.02
    w2 = torch.randn(e, h, i, generator=generator, device=device, dtype=dtype) * 0.02
    probs = torch.randn(tokens, e, generator=generator, device=device).softmax(-1)
    weights, ids = probs.topk(k, dim=-1)
    scales = {}
    if job.kind == "fp8":
        (w13, s13), (w2, s2) = ([torch.stack(t) for t in zip(*(fp8.quantize_fp8_rows(m) for m in w))]
                                for w in (w13, w2))
        scales = dict(w13_scale=s13.squeeze(-1), w2_scale=s2.squeeze(-1))
    if job.kind == "block-fp8":
        (w13, s13), (w2, s2) = ([torch.stack(t) for t in zip(*(fp8_block.quantize_fp8_blocks(m.float()) for m in w))]
                                for w in (w13, w2))
        scales = dict(w13_scale=s13, w2_scale=s2, block=fp8_block.BLOCK)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).float(), ids.int(), scales


def gemm_inputs(job: Job, tokens: int, generator: torch.Generator, rows: int | None = None) -> tuple:
    """x (bf16) and the block-FP8 weight with its scales; `rows` fewer weight rows for compiling (`compile_rows`)."""
    from tsdev_kernels.ops import fp8_block

    n, k = job.shape
    n = rows or n
    device = generator.device
    weight, scale = fp8_block.quantize_fp8_blocks(torch.randn(n, k, generator=generator, device=device) * k**-0.5)
    x = torch.randn(tokens, k, generator=generator, device=device, dtype=torch.bfloat16)
    return x, weight, scale


def compile_rows(n: int) -> int:
    """Weight rows enough to compile a GEMM of N = n: the binaries depend on N only through its divisibility by 16
    (Triton's specialization), which this keeps. Sixteen workers each holding DeepSeek-V3's gate_up weight
    (36864 x 7168) in float32 would not fit in one H100."""
    return n if n <= 1024 else 1024 + n % 16


def copies_past_l2(nbytes: int, l2_bytes: int, most: int = 8) -> int:
    """How many copies of a call's operands (`nbytes` each) to cycle through so that each call reads its weights from
    memory, not from an L2 the call before filled -- as serving runs each layer's projection once per step: enough
    for twice the L2 (50 MB on an H100; Qwen3-8B's q|k|v in e4m3 is 25 MB), at most `most`, at least 1."""
    return max(1, min(most, -(-2 * l2_bytes // max(nbytes, 1))))


def operand_bytes(job: Job, data: tuple) -> int:
    """The bytes of the weights (and scales) one call of `launch` reads."""
    tensors = data[1:] if job.kind == "gemm" else (data[1], data[2], *data[5].values())
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def launch(job: Job, data: tuple, config: Config, inside: bool = False) -> None:
    """One call of the kernels `config` tunes; the GEMM's with the activations' quantization launch before it, or
    (`inside`) quantizing its own tiles."""
    if job.kind == "gemm":
        from tsdev_kernels.ops.fp8_block import fp8_block_gemm_triton, quantize_fp8_token_groups_triton

        x, weight, scale = data
        entry = (config["BLOCK_M"], config["BLOCK_N"], config["num_warps"], config.get("SPLIT_K"))
        a = (x, None) if inside else quantize_fp8_token_groups_triton(x)
        fp8_block_gemm_triton(*a, weight, scale, config=entry if entry[-1] else entry[:3])
    else:
        from tsdev_kernels.ops.moe import fused_moe_triton

        x, w13, w2, weights, ids, scales = data
        fused_moe_triton(x, w13, w2, weights, ids, config=config, **scales)


def compile_chunk(job: Job, tokens: int, configs: list[Config]) -> int:
    """Run each configuration once (Triton compiles its kernels into its cache on disk, which the timing process
    then loads) on few experts (MoE) or weight rows (GEMM: `compile_rows`) of the shape; the count that failed (out
    of shared memory or registers). A worker."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    if job.kind == "gemm":
        data = gemm_inputs(job, tokens, generator, rows=compile_rows(job.shape[0]))
    else:
        data = moe_inputs(job, tokens, generator, experts=min(job.shape[0], max(job.shape[3], 8)))
    failed = 0
    for config in configs:
        try:
            launch(job, data, config)
        except Exception:  # noqa: BLE001 -- out of resources: the timing skips it too
            failed += 1
    torch.cuda.synchronize()
    return failed


class CudaTimer:
    """`tsdev.tune.Timer` on the current CUDA device. Holds one job's weights at a time."""

    def __init__(self, jobs: int = min(16, os.cpu_count() or 1), rep: int = 50):
        self.rep, self.jobs = rep, jobs
        self.generator = torch.Generator(device="cuda").manual_seed(0)
        self.compiled: set = set()
        self.data: dict = {}
        context = multiprocessing.get_context("spawn")  # CUDA in every worker
        self.pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) if jobs > 1 else None

    def _inputs(self, job: Job, tokens: int) -> list[tuple]:
        """The operands of `copies_past_l2` calls: each timed call cycles through them all."""
        key = (job, tokens)
        if key not in self.data:
            self.data.clear()  # one (job, bucket) at a time: a DeepSeek layer's experts are 22 GB in bf16
            torch.cuda.empty_cache()
            make = gemm_inputs if job.kind == "gemm" else moe_inputs
            first = make(job, tokens, self.generator)
            l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
            copies = copies_past_l2(operand_bytes(job, first), l2)
            self.data[key] = [first] + [make(job, tokens, self.generator) for _ in range(copies - 1)]
        return self.data[key]

    def prepare(self, job: Job, tokens: int, configs: list[Config]) -> None:
        todo = [c for c in configs if (job, tokens, repr(sorted(c.items()))) not in self.compiled]
        if self.pool and len(todo) > 1:
            chunks = [todo[i::self.jobs] for i in range(self.jobs) if todo[i::self.jobs]]
            list(self.pool.map(compile_chunk, [job] * len(chunks), [tokens] * len(chunks), chunks))
        self.compiled.update((job, tokens, repr(sorted(c.items()))) for c in todo)

    def _bench(self, call, copies: list[tuple]) -> float | None:
        """µs per call of `call(data)`, replayed from a CUDA graph over every copy of the operands in turn."""
        import triton.testing

        def calls():
            for data in copies:
                call(data)
        try:
            calls()
            torch.cuda.synchronize()
            return triton.testing.do_bench_cudagraph(calls, rep=self.rep) * 1e3 / len(copies)
        except Exception as exc:  # noqa: BLE001 -- out of shared memory / registers: not a candidate
            print(f"  skip: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            torch.cuda.synchronize()
            return None

    def time(self, job: Job, tokens: int, config: Config) -> float | None:
        return self._bench(lambda data: launch(job, data, config), self._inputs(job, tokens))

    def crossover(self, job: Job, tokens: int, config: Config) -> dict[str, float] | None:
        """µs of the Triton projection at `config` with its quantization launch (`triton_us`; the GEMV too at one
        token), of the GEMM quantizing inside (`inside_us`), and of the quantization and torch._scaled_mm
        (`scaled_mm_us`, where _scaled_mm has block scales here and the shape is whole 128-blocks); each left out
        where it cannot run, None where the Triton projection cannot."""
        from tsdev_kernels.ops import fp8_block

        copies = self._inputs(job, tokens)
        triton_us = self.time(job, tokens, config)
        if tokens <= fp8_block.GEMV_MAX_ROWS:
            gemv = self._bench(lambda data: fp8_block.fp8_block_gemv_triton(*data), copies)
            triton_us = min((t for t in (triton_us, gemv) if t is not None), default=None)
        if triton_us is None:
            return None
        times = dict(triton_us=triton_us, inside_us=self._bench(lambda data: launch(job, data, config, inside=True),
                                                                  copies))
        if not (job.shape[0] % 128 or job.shape[1] % 128) and fp8_block.scaled_mm_available(copies[0][0].device):
            times["scaled_mm_us"] = self._bench(lambda data: fp8_block.fp8_block_linear_scaled_mm(*data), copies)
        return {name: us for name, us in times.items() if us is not None}

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown()
