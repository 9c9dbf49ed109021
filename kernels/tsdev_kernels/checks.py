"""What an edit did to a kernel: its error against the torch reference, and its time per call, at the shapes serving
uses.

Each op family declares its checks beside its kernels (`CHECKS` in kernels/tsdev_kernels/ops/<family>.py, a list of
`KernelCheck`): the Triton entry point and its reference, fresh random inputs for a shape (never zeros), the shapes
serving reaches (from `Serving`: the token counts of the captured decode batches and prefill buckets and the model's
dimensions), and a stated tolerance per dtype. `changed(before)` tells which checks' kernels an edit changed -- the
kernel itself or an `@jit` helper it calls, in any module -- by a fingerprint of their code; `run` checks one
shape, `time_call` times one.

This module is not reloadable (tsdev_kernels.ops is): what it keeps (the last time per shape) outlives reloads.
"""
from __future__ import annotations

import hashlib
import math
import os
import statistics
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

OPS_PACKAGE = "tsdev_kernels.ops"
TIMED_CALLS, TIMED_REPEATS = 20, 5  # per shape: the median of 5 runs of 20 calls back to back
TIMED_REPLAYS, RUN_US = 10, 1000.0  # a run replays the graph of the calls up to 10 times, about 1 ms in all
HEAD_START_CYCLES = 1_000_000  # the GPU spins ~0.5 ms before a timed run: its replays are all queued when it starts


@dataclass(frozen=True)
class Tolerance:
    """|kernel - reference| <= atol + rtol * |reference| everywhere, and why that much."""
    atol: float
    rtol: float
    why: str


@dataclass(frozen=True)
class Serving:
    """What a server serves: the rows an op sees per step (captured decode batch sizes, prefill buckets) and the
    model's dimensions the checks draw their shapes from."""
    tokens: tuple[int, ...]
    hidden: int
    intermediate: int
    dtype: torch.dtype
    q_heads: int = 16  # per rank, as intermediate
    kv_heads: int = 8
    head_dim: int = 128
    latent_dim: int = 0  # a latent-attention model's kv_lora_rank and qk_rope_head_dim (0: attention.py's layout)
    rope_dim: int = 0
    page_size: int = 16  # tokens per KV page
    max_context: int = 1024  # the longest sequence a check draws (the served context length, at most 1024)
    max_running: int = 256  # the largest decode batch (the rows above are prefill steps)
    vocab: int = 151936  # the logits' columns (sampling's ops)
    experts: int = 0  # a mixture of experts' (0: a dense model), its experts per token and their width per rank
    top_k: int = 0
    moe_intermediate: int = 0
    fp8: bool = False  # e4m3 projections (--quantization fp8)
    fp8_blocks: bool = False  # e4m3 projections with 128 x 128 block scales (a block-FP8 checkpoint, as stored)
    kv_fp8: bool = False  # an e4m3 KV pool (--kv-cache-dtype fp8)
    eps: float = 1e-6
    device: str = "cuda"


@dataclass(frozen=True)
class KernelCheck:
    """One op's check. `kernels`: the Triton kernels the op launches (names in the declaring module, or dotted
    through a module it imports: "linear_ops._gemv_kernel"), whose code
    decides whether an edit changed the op; `shapes(serving)`: the shapes to check; `inputs(shape, dtype,
    device, generator)`: fresh random arguments; `kernel(*args)` and `reference(*args)`: the outputs to compare
    (a tensor or a tuple of them); `tolerance`: per dtype."""
    op: str
    kernels: tuple[str, ...]
    shapes: Callable[[Serving], Iterable[tuple[int, ...]]]
    inputs: Callable[[tuple[int, ...], torch.dtype, str, torch.Generator], tuple]
    kernel: Callable
    reference: Callable
    tolerance: Mapping[torch.dtype, Tolerance]
    # (bytes moved, tensor-core FLOPs) of one call on these arguments (`cost(*args)`, the `inputs` drawn): the bytes
    # each input read and output written once, the FLOPs 2·M·N·K of its matmuls (0 for elementwise ops: never the
    # limit). From the arguments, not the shape: attention's cached lengths are drawn per call.
    cost: Callable[..., tuple[int, int]] | None = field(default=None, compare=False)
    tensor_cores: str = "bf16"  # the rate its FLOPs run at: "bf16" (also fp16, tf32 counted alike) or "fp8"
    module: str = field(default="", compare=False)  # the declaring module (set by `declared`)


@dataclass
class Result:
    op: str
    shape: tuple[int, ...]
    dtype: str
    max_abs: float  # the largest |kernel - reference|
    max_rel: float  # the largest |kernel - reference| / |reference| where |reference| > atol
    atol: float
    rtol: float
    ok: bool
    seed: int  # of the inputs (drawn fresh for every check)
    error: str | None = None  # the kernel raised, or its output's shape or dtype differs from the reference's
    us: float | None = None  # median time per call after the edit
    us_before: float | None = None  # before it (the last time measured for this shape, `before_fresh` says when)
    timed: str | None = None  # how the times were taken (`time_call`): "graph", "eager" or "wall"
    before_fresh: bool = False  # measured in this reload, before the new code ran (else: at an earlier one)
    bytes: int | None = None  # per call (`cost`): over the inputs timed on CUDA, else the check's own
    flops: int | None = None
    share: float | None = None  # of the GPU's limit at `us` (`share_of`)
    bound: str | None = None  # which limit: "bandwidth", "bf16 tensor cores", "fp8 tensor cores"


def nbytes(*tensors) -> int:
    """The bytes of these tensors (anything else counts 0): a cost's reads and writes."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def matmul_cost(x: torch.Tensor, weight: torch.Tensor, *read: torch.Tensor) -> tuple[int, int]:
    """x [M, K] @ weight [N, K]^T into [M, N] of x's dtype: x, the weight and `read` (scales) read once, the output
    written; 2·M·N·K FLOPs."""
    (m, k), n = x.shape, weight.shape[0]
    return nbytes(x, weight, *read) + m * n * x.element_size(), 2 * m * n * k


def declared() -> list[KernelCheck]:
    """Every check of the loaded op families (their CHECKS lists, as the modules are now)."""
    found = []
    for name in sorted(name for name in list(sys.modules) if name.startswith(OPS_PACKAGE + ".")):
        if (module := sys.modules.get(name)) is not None:
            for check in vars(module).get("CHECKS", ()):
                found.append(KernelCheck(**{**vars(check), "module": name}))
    return found


def fingerprints(checks: Sequence[KernelCheck]) -> dict[str, str]:
    """op -> a digest of the code of its kernels and of every `@jit` helper they reach."""
    return {check.op: _digest(check) for check in checks}


def changed(before: Mapping[str, str], checks: Sequence[KernelCheck]) -> list[KernelCheck]:
    """The checks whose kernels' code differs from `before` (fingerprints taken before the edit); new ops too."""
    now = fingerprints(checks)
    return [check for check in checks if before.get(check.op) != now[check.op]]


def runnable(device: str) -> bool:
    """Triton kernels run on CUDA, or anywhere under Triton's interpreter (TRITON_INTERPRET=1)."""
    return device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"


def run(check: KernelCheck, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Result:
    """The kernel against the reference at `shape` on fresh random inputs (see `run_all`)."""
    return run_all([(check, shape)], dtype, device)[0]


@dataclass
class Drawn:
    """A check's fresh inputs at one shape and its reference's outputs on them, drawn ahead (a reload draws them
    before its pause, for the ops the edited modules reach), with the digest of the code that drew them."""
    seed: int
    args: tuple
    want: list[torch.Tensor]
    digest: str


def draw(check: KernelCheck, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Drawn:
    seed = int.from_bytes(os.urandom(6), "little")
    args = check.inputs(tuple(shape), dtype, device, torch.Generator(device=device).manual_seed(seed))
    return Drawn(seed, args, _tensors(check.reference(*args)), drawing_digest(check))


def run_all(items: Sequence[tuple[KernelCheck, tuple[int, ...]]], dtype: torch.dtype, device: str,
            drawn: Mapping[tuple[str, tuple[int, ...]], Drawn] | None = None) -> list[Result]:
    """Each (check, shape): the kernel against the reference on fresh random inputs -- those `drawn` ahead for
    (op, shape) while the code that draws them and computes the reference is unchanged, else drawn now. NaN or
    Inf in the kernel's output never pass. The comparisons run on the device, many checks' outputs at once
    (`_compare`), read back once at the end: a reload's pause pays one wait and a few dozen launches for all of
    them, not a few dozen per shape."""
    results, compared = [], []
    for check, shape in items:
        ahead = (drawn or {}).get((check.op, tuple(shape)))
        inputs = ahead if ahead is not None and ahead.digest == drawing_digest(check) else draw(check, shape, dtype,
                                                                                                   device)
        tol = check.tolerance[dtype]
        result = Result(check.op, tuple(shape), str(dtype).removeprefix("torch."), math.inf, math.inf, tol.atol,
                        tol.rtol, False, inputs.seed)
        results.append(result)
        try:
            got = _tensors(check.kernel(*inputs.args))
        except Exception as exc:  # a kernel that no longer runs at this shape: reported, not raised
            result.error = f"{type(exc).__name__}: {exc}"
            continue
        if [(g.shape, g.dtype) for g in got] != [(w.shape, w.dtype) for w in inputs.want]:
            result.error = (f"output {[(tuple(g.shape), g.dtype) for g in got]} where the reference gives "
                            f"{[(tuple(w.shape), w.dtype) for w in inputs.want]}")
            continue
        compared.append((result, got, inputs.want))
        if check.cost is not None and not device.startswith("cuda"):  # on CUDA: over the inputs timed (time_call)
            result.bytes, result.flops = check.cost(*inputs.args)
    groups, group, size = [], [], 0
    for entry in compared:  # a few outputs at a time: the comparison's temporaries stay within COMPARED_ELEMENTS
        group.append(entry)
        size += sum(g.numel() for g in entry[1])
        if size >= COMPARED_ELEMENTS:
            groups.append(group)
            group, size = [], 0
    stats = [_compare(g) for g in (*groups, group) if g]
    for (result, _, _), (max_abs, max_rel, ok) in zip(compared, torch.cat(stats).tolist() if stats else []):
        result.max_abs, result.max_rel, result.ok = max_abs, max_rel, bool(ok)
    return results


COMPARED_ELEMENTS = 1 << 24  # output elements compared in one go (each temporary: 64 MB of float32)


def _compare(entries: list[tuple[Result, list[torch.Tensor], list[torch.Tensor]]]) -> torch.Tensor:
    """Per entry (result, kernel's outputs, reference's): [max |g - w|, max |g - w| / |w| where |w| > atol, all
    within atol + rtol * |w| and finite], on the device, in one pass over every entry's outputs flattened end to
    end (each element knows its entry); the errors are inf where an output is not finite."""
    got = torch.cat([t.float().flatten() for _, g, _ in entries for t in g])
    want = torch.cat([t.float().flatten() for _, _, w in entries for t in w])
    device, sizes = got.device, [sum(t.numel() for t in g) for _, g, _ in entries]
    per_entry = torch.tensor([[size, r.atol, r.rtol] for size, (r, _, _) in zip(sizes, entries)],
                             dtype=torch.float64).to(device, non_blocking=True)
    entry = torch.repeat_interleave(torch.arange(len(entries), device=device), per_entry[:, 0].long(),
                                    output_size=got.numel())
    atol, rtol = per_entry[:, 1].float()[entry], per_entry[:, 2].float()[entry]
    diff, size, finite = (got - want).abs(), want.abs(), torch.isfinite(got)
    within = finite & (diff <= atol + rtol * size)
    rel = torch.where(size > atol, diff / torch.maximum(size, atol), 0.0)
    # one reduction per entry over its three statistics (measured on the H200 for 8 entries of 10 M elements in all:
    # a scatter_reduce into 8 addresses 20+ ms, serialised on its atomics; torch.segment_reduce 6.7 ms)
    stats = torch.stack([torch.where(finite, diff, math.inf), torch.where(finite, rel, math.inf), 1 - within.float()])
    worst = torch.stack([part.amax(dim=1) if part.shape[1] else part.new_zeros(3)
                         for part in stats.split(sizes, dim=1)])
    return torch.stack([worst[:, 0], worst[:, 1], 1 - worst[:, 2]], dim=1)


class Timing(NamedTuple):
    us: float  # per call
    how: str  # "graph", "eager" or "wall"
    cost: tuple[int, int] | None  # (bytes, FLOPs) per call, the mean over the inputs timed; None: none declared


def time_call(check: KernelCheck, shape: tuple[int, ...], dtype: torch.dtype, device: str,
              calls: int = TIMED_CALLS, repeats: int = TIMED_REPEATS) -> Timing:
    """Microseconds per call of the kernel at `shape`, how they were timed, and the call's declared cost over the
    same inputs (it may read them back: cached lengths; after the timing, where a sync costs nothing). On CUDA:
    "graph", the device time of `calls` launches captured in one CUDA graph (what a captured step pays: no host launch
    cost, unmoved by the server's other threads), over up to INPUT_SETS distinct inputs as serving's layers bring
    their own, the median of `repeats` runs of back-to-back replays (`_replays`) -- benchmarks/kernels_bench.py's
    graph column; "eager" where the op cannot be captured (it waits on the host): the same launches one by one between
    two events, launch cost included. Off CUDA, "wall": the wall clock of eager launches."""
    inputs = timing_inputs(check, tuple(shape), dtype, device)
    for args in inputs:
        check.kernel(*args)  # loaded and launched once before timing
    launches = [inputs[i % len(inputs)] for i in range(calls)]
    if not device.startswith("cuda"):
        return Timing(statistics.median(_wall_us(check, launches) for _ in range(repeats)), "wall",
                      _mean_cost(check, inputs))
    graph = _captured(check, launches)
    replays = 1 if graph is None else _replays(graph)
    runs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if graph is not None:  # a server's other threads can hold the GIL between two replays: no gap is timed
            torch.cuda._sleep(HEAD_START_CYCLES)
        start.record()
        for _ in range(replays):
            if graph is not None:
                graph.replay()
            else:
                for args in launches:
                    check.kernel(*args)
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / (calls * replays))
    return Timing(statistics.median(runs), "eager" if graph is None else "graph", _mean_cost(check, inputs))


def _mean_cost(check: KernelCheck, inputs: list[tuple]) -> tuple[int, int] | None:
    if check.cost is None:
        return None
    costs = [check.cost(*args) for args in inputs]
    return round(statistics.mean(c[0] for c in costs)), round(statistics.mean(c[1] for c in costs))


def _replays(graph: torch.cuda.CUDAGraph) -> int:
    """Replays per timed run: enough that one replay's launch latency (~0.25 µs a run pays once) is small against
    the calls' time (a kernel of 1 µs: 20 calls are 20 µs), at most TIMED_REPLAYS and about RUN_US."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return max(1, min(TIMED_REPLAYS, int(RUN_US / max(start.elapsed_time(end) * 1e3, 1e-3))))


@dataclass(frozen=True)
class Limits:
    """What a GPU allows: its copy bandwidth and its dense tensor-core rates."""
    gpu: str
    bandwidth: float  # bytes/s: a device-to-device copy's (read + write), measured
    bf16: float  # FLOP/s, dense
    fp8: float
    source: str


# Copy bandwidth: measured with benchmarks/decode_step.py's copy_bandwidth (docs/benchmarks.md; the machines' notes:
# 3.0 TB/s on the H100 SXM, 4.2 on the H200); tensor-core rates: NVIDIA's H100/H200 SXM datasheets, dense (without
# sparsity): 989 TFLOP/s bf16, 1979 fp8. Matched against torch.cuda.get_device_name, the first that it contains.
GPU_LIMITS = (
    Limits("H200", 4.2e12, 989e12, 1979e12, "copy measured 4.2 TB/s; datasheet dense bf16 989, fp8 1979 TFLOP/s"),
    Limits("H100 80GB HBM3", 3.0e12, 989e12, 1979e12,
           "copy measured 3.0 TB/s; datasheet dense bf16 989, fp8 1979 TFLOP/s"),
)


def limits_of(gpu_name: str) -> Limits | None:
    """The limits of the GPU named so (None: not one whose limits are known; no share is given)."""
    return next((limits for limits in GPU_LIMITS if limits.gpu in gpu_name), None)


def device_limits(device: str) -> Limits | None:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return limits_of(torch.cuda.get_device_name(device))


def share_of(bytes_: int, flops: int, us: float, limits: Limits, tensor_cores: str = "bf16") -> tuple[float, str]:
    """(the share of the limit a call of `us` µs reaches, which limit): the larger of the time its bytes take at the
    copy bandwidth and its FLOPs at the tensor-core rate, over the time it took -- 0.82: 82 % of what the GPU allows."""
    rate = limits.fp8 if tensor_cores == "fp8" else limits.bf16
    memory, compute = bytes_ / limits.bandwidth, flops / rate
    bound = "bandwidth" if memory >= compute else f"{tensor_cores} tensor cores"
    return max(memory, compute) / (us * 1e-6), bound


INPUT_SETS, INPUT_BYTES = 4, 256 << 20  # distinct inputs a timing cycles through, within this many bytes


def timing_inputs(check: KernelCheck, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> list[tuple]:
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = [check.inputs(shape, dtype, device, generator)]
    size = sum(a.numel() * a.element_size() for a in inputs[0] if isinstance(a, torch.Tensor))
    while len(inputs) < INPUT_SETS and size * (len(inputs) + 1) <= INPUT_BYTES:
        inputs.append(check.inputs(shape, dtype, device, generator))
    return inputs


def _captured(check: KernelCheck, launches: list[tuple]) -> torch.cuda.CUDAGraph | None:
    """The launches in one CUDA graph, replayed once; None when the op cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for args in launches:
                check.kernel(*args)
        graph.replay()
    except Exception:  # a host sync inside the op: it is timed eagerly, and says so
        torch.cuda.synchronize()
        return None
    return graph


def _wall_us(check: KernelCheck, launches: list[tuple]) -> float:
    begin = time.perf_counter()
    for args in launches:
        check.kernel(*args)
    return (time.perf_counter() - begin) * 1e6 / len(launches)


def _tensors(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


# --- what decides whether an edit changed an op ----------------------------------------------------------------


def _digest(check: KernelCheck) -> str:
    """The check's kernels, the `@jit` helpers they reach and its launchers (`_python_path` of its call): an edit of
    a launch setting (num_warps, a block size, the grid) changes the op as much as one of a kernel's body."""
    digest = hashlib.sha256()
    for fn in _reached(check):
        digest.update(b"-" if fn is None else _code_digest(_written(fn)))
    for fn, constants in _python_path(check.kernel):
        digest.update(_code_digest(fn.__code__) + repr(constants).encode())
    return digest.hexdigest()


def drawing_digest(check: KernelCheck) -> str:
    """A digest of the code that draws the check's inputs and computes its reference: the Python functions of
    tsdev_kernels.ops they reach and the plain constants these read (`_python_path`)."""
    digest = hashlib.sha256()
    for fn, constants in _python_path(check.inputs, check.reference):
        digest.update(_code_digest(fn.__code__) + repr(constants).encode())
    return digest.hexdigest()


_PLAIN = (int, float, str, bool, tuple)


def _python_path(*roots) -> list[tuple[types.FunctionType, tuple]]:
    """The Python functions of tsdev_kernels.ops that `roots` run, through globals and closures, each with the plain
    constants it reads (`BLOCK = 1024`, a captured int). Kernels, `@jit` helpers and CuTe wrappers are `_reached`'s."""
    found, seen = [], set()

    def visit(value) -> None:
        if (not isinstance(value, types.FunctionType) or _is_cute(value) or id(value) in seen
                or not (value.__module__ or "").startswith(OPS_PACKAGE)):
            return
        seen.add(id(value))
        reads = [value.__globals__.get(name) for name in value.__code__.co_names]
        for cell in value.__closure__ or ():
            try:
                reads.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        found.append((value, tuple(v for v in reads if isinstance(v, _PLAIN))))
        for read in reads:
            visit(read)

    for root in roots:
        visit(root)
    return found


def modules_reached(check: KernelCheck) -> set[str]:
    """The modules that define the check's kernels, a helper they reach or its launchers: an edit elsewhere cannot
    change it."""
    return ({fn.__module__ for fn in _reached(check) if fn is not None}
            | {fn.__module__ for fn, _ in _python_path(check.kernel)})


def _python_function(obj) -> types.FunctionType | None:
    """The Python function under Triton's layers (JITFunction, the interpreter's, autotune/heuristics) or under a
    CuTe DSL decorator's wrapper (`__wrapped__`)."""
    for _ in range(8):
        if obj is None or isinstance(obj, types.FunctionType):
            return vars(obj).get("__wrapped__", obj) if _is_cute(obj) else obj
        obj = getattr(obj, "fn", None)
    return None


def _is_cute(obj) -> bool:
    """A CuTe DSL decorator's wrapper (as tsdev.hotreload.cute.is_cute: the kernels may not import the toolkit)."""
    return isinstance(obj, types.FunctionType) and "_dsl_cls" in vars(obj) and "__wrapped__" in vars(obj)


def _is_kernel_code(obj) -> bool:
    return (_is_cute(obj) or not isinstance(obj, types.FunctionType)) and _python_function(obj) is not None


def _written(fn: types.FunctionType) -> types.CodeType:
    """A kernel function's code as written (CuTe DSL replaces `__code__` by its rewrite on the first compile)."""
    return vars(fn).get("_original_code", fn.__code__)


def _reached(check: KernelCheck) -> list[types.FunctionType | None]:
    """The Python functions of the check's kernels and of every `@jit` helper they call, by name or as a module's
    attribute, depth first (None for a kernel name the module lacks)."""
    module, found, seen = sys.modules.get(check.module), [], set()

    def visit(obj) -> None:
        fn = _python_function(obj)
        if fn is None:
            found.append(None)
            return
        if id(fn) in seen:
            return
        seen.add(id(fn))
        found.append(fn)
        names = _written(fn).co_names
        for name in names:
            value = fn.__globals__.get(name)
            if _is_kernel_code(value):
                visit(value)
            elif isinstance(value, types.ModuleType):
                for attr in names:
                    if _is_kernel_code(inner := vars(value).get(attr)):
                        visit(inner)

    for name in check.kernels:  # a name in the declaring module, or dotted through a module it imports
        target = module
        for part in name.split("."):
            target = getattr(target, part, None)
        visit(target)
    return found


_CODE_DIGESTS: weakref.WeakKeyDictionary[types.CodeType, bytes] = weakref.WeakKeyDictionary()


def _code_digest(code: types.CodeType) -> bytes:
    """`_code_key`'s digest, computed once per code object (a reload makes new ones for what it re-executes: the
    pause hashes only the edited modules' functions)."""
    digest = _CODE_DIGESTS.get(code)
    if digest is None:
        digest = _CODE_DIGESTS[code] = hashlib.sha256(repr(_code_key(code)).encode()).digest()
    return digest


def _code_key(code: types.CodeType) -> tuple:
    """A code object's content without its line numbers (an edit above a kernel moves it, changing nothing)."""
    consts = tuple(_code_key(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.co_code, code.co_names, code.co_varnames, code.co_freevars, consts
