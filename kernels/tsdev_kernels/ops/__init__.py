"""Op families: norm, rope, activation, linear, fp8, attention, mla, sampling, moe. Import the submodules directly.

Each public op runs its Triton kernel when its inputs are on CUDA and its torch reference otherwise.
Set TSDEV_KERNELS=ref to run the references on CUDA too (to compare speed or rule a kernel out), or
TSDEV_KERNELS=ref:linear,rope to do that for those families only. A family with a Gluon kernel (GLUON_FAMILIES)
runs it instead of its Triton one under TSDEV_KERNELS=gluon:norm, a family with a CuTe DSL one (CUTE_FAMILIES, the
optional `tsdev[cute]`) under TSDEV_KERNELS=cute:activation; items combine: ref:rope,linear,gluon:norm.
A family whose op routes some shapes to a library kernel (ROUTED_FAMILIES: fp8's block-FP8 projections to
torch._scaled_mm where the tuned crossover says it is faster) goes there at every shape under
TSDEV_KERNELS=cublas:fp8 and never under TSDEV_KERNELS=triton:fp8 (an A/B).
Under TRITON_INTERPRET=1 the Triton entry points (`*_triton`) also run on CPU tensors; the tests use that.

Programmatic dependent launch (Hopper and newer): the kernels on the decode path are launched with
`launch_pdl=pdl(x)`, so each may start while the kernel before it finishes. Every program of such a kernel
calls `wait_for_previous` before it reads anything an earlier kernel wrote or writes anything at all (it
may read weights before that); since each one waits, the order of the whole chain holds. On the H200 the
batch-1 decode graph replays in 0.869 ms with it, 1.040 without (docs/benchmarks.md). TSDEV_PDL=0 turns it off.
"""
import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from tsdev_kernels.cache import cache_dir


tuned_log = logging.getLogger("tsdev_kernels.tuned")  # which tuned file serves each shape: one line each, at startup

FAMILIES = ("norm", "rope", "activation", "linear", "fp8", "attention", "mla", "sampling", "moe")
GLUON_FAMILIES = ("norm",)  # the families with a Gluon kernel too (triton.experimental.gluon)
# ... with a CuTe DSL kernel (nvidia-cutlass-dsl: kernels/tsdev_kernels/ops/activation_cute.py)
CUTE_FAMILIES = ("activation",)
# ... whose op routes some shapes to a library kernel (fp8: block-FP8 projections to torch._scaled_mm, fp8_block.py's
# `uses_scaled_mm`): cublas:fp8 forces the library at every M, triton:fp8 the Triton kernel, for an A/B
ROUTED_FAMILIES = ("fp8",)
# what TSDEV_KERNELS can pick, for which families
IMPLS = {"ref": FAMILIES, "gluon": GLUON_FAMILIES, "cute": CUTE_FAMILIES, "cublas": ROUTED_FAMILIES,
         "triton": ROUTED_FAMILIES}


def kernel_choices() -> Mapping[str, str]:
    """family -> "ref", "gluon" or "cute", for the families TSDEV_KERNELS takes off their Triton kernels on CUDA:
    `triton` (or unset) none, `ref` all to their references, else comma-separated FAMILY items each under the
    IMPL: before it or before an earlier item (ref:linear,rope,gluon:norm). Parsed once per value: eager ops ask
    on every call."""
    return _parsed(os.environ.get("TSDEV_KERNELS", "triton"))


@functools.lru_cache(maxsize=8)
def _parsed(value: str) -> Mapping[str, str]:
    if value in ("triton", ""):
        return MappingProxyType({})
    if value == "ref":
        return MappingProxyType(dict.fromkeys(FAMILIES, "ref"))
    choices, impl = {}, None
    for item in value.split(","):
        impl, _, family = item.rpartition(":") if ":" in item else (impl, "", item)
        if family not in IMPLS.get(impl, ()):
            raise ValueError(f"TSDEV_KERNELS={value!r}: expected triton, ref, or IMPL:FAMILY items (ref:linear,rope,"
                             f"gluon:norm): ref for families from {', '.join(FAMILIES)}; gluon for "
                             f"{', '.join(GLUON_FAMILIES)}; cute for {', '.join(CUTE_FAMILIES)}; cublas or triton "
                             f"for {', '.join(ROUTED_FAMILIES)} (the block-FP8 projections' route)")
        choices[family] = impl
    return MappingProxyType(choices)


def check_kernel_choices() -> None:
    """Fail now, with what to do, on a TSDEV_KERNELS the op calls would fail on later (ValueError)."""
    if "cute" in kernel_choices().values():
        try:
            import cutlass.cute  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"TSDEV_KERNELS={os.environ['TSDEV_KERNELS']!r} picks CuTe DSL kernels, which need the "
                             f"CuTe DSL ({exc}): pip install 'tsdev[cute]'") from exc


def reference_families() -> set[str]:
    """The op families TSDEV_KERNELS sends to their torch references on CUDA."""
    return {family for family, impl in kernel_choices().items() if impl == "ref"}


def use_gluon(family: str) -> bool:
    """Whether TSDEV_KERNELS picks `family`'s Gluon kernel over its Triton one (where use_triton holds)."""
    return kernel_choices().get(family) == "gluon"


def use_cute(family: str) -> bool:
    """Whether TSDEV_KERNELS picks `family`'s CuTe DSL kernel over its Triton one (where use_triton holds)."""
    return kernel_choices().get(family) == "cute"


def routed(family: str) -> str | None:
    """"cublas" or "triton" where TSDEV_KERNELS forces a routed family's (ROUTED_FAMILIES) side, else None: the op
    routes by shape."""
    choice = kernel_choices().get(family)
    return choice if choice in ("cublas", "triton") else None


def use_triton(x: torch.Tensor, family: str) -> bool:
    """Whether the public op of `family` should launch its Triton (or Gluon: `use_gluon`) kernel for this input."""
    return x.is_cuda and kernel_choices().get(family) != "ref"


def use_fused_triton(x: torch.Tensor, *families: str) -> bool:
    """Whether one Triton kernel built from the Triton arithmetic of `families` (the decode GEMV with the norm and
    activation, Qwen3's q/k norm inside the rotation) may serve their ops on this input: on CUDA, with TSDEV_KERNELS
    taking none of them off Triton. A family picked for its reference, Gluon or CuTe DSL kernel runs that, unfused,
    everywhere: a pick never applies to some batch sizes only."""
    choices = kernel_choices()  # (a route's pick, cublas: or triton:, leaves the family's fused kernels alone)
    return x.is_cuda and not any(choices.get(family, "triton") not in ("triton", "cublas") for family in families)


_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def split_arrivals(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters in which the programs of a split launch count their arrival (decode attention: one per
    (sequence, KV head); the block-FP8 GEMM's split-K: one per output tile); the last to arrive merges the splits and
    zeroes its counter, so all are zero again after each launch. Kept for the process's life (captured graphs hold
    their address); a larger count adds a larger buffer, never inside a capture. Shared by every split launch on the
    device: two of them running at once on two streams would mix their counts (the engine steps one model at a time
    on one thread, each kernel waiting for the one before: `wait_for_previous`)."""
    buffers = _ARRIVALS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a split kernel needs {count} arrival counters while a CUDA graph is captured: "
                               "run the batch size once eagerly before capturing it")
        buffers.append(torch.zeros(max(count, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


def device_name(device: torch.device | str | None) -> str | None:
    """The CUDA device's name (default: the current one, if any), or None for a CPU (the interpreter: kernels run
    their default configurations there). What tuned configuration files are named by."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_name(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache
def tuned_configs(path: str) -> dict[int, object] | None:
    """{token bucket: config} of a tuned configuration file (JSON, keyed by token count), None if there is none;
    read once per process per file."""
    try:
        table = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    return {int(tokens): config for tokens, config in table.items()}


# GPUs of one architecture whose tuned files serve each other when a GPU has none of its own, nearest first: the
# kernels' best tiles follow the SM count, shared memory and the ratio of bandwidth to FLOPs, close within a pair
# (H100 SXM and H200: 132 SMs, sm_90; the H200's HBM 1.4x faster). CUDA names, as `device_name` returns them.
SIBLING_GPUS = {
    "NVIDIA H100 80GB HBM3": ("NVIDIA H200",),
    "NVIDIA H200": ("NVIDIA H100 80GB HBM3",),
    "NVIDIA H100 NVL": ("NVIDIA H100 80GB HBM3", "NVIDIA H200"),
    "NVIDIA H100 PCIe": ("NVIDIA H100 80GB HBM3", "NVIDIA H200"),
    "NVIDIA H800": ("NVIDIA H100 80GB HBM3", "NVIDIA H200"),
    "NVIDIA H20": ("NVIDIA H200", "NVIDIA H100 80GB HBM3"),
}


class Tuned(NamedTuple):
    """A tuned table and where it came from: `source` is "your tuned file" (the user's cache), "shipped for this GPU"
    or "shipped for the <sibling>" -- what the one startup line says."""
    table: dict
    path: Path
    source: str


def tuned_file_name(stem: str, gpu: str) -> str:
    """vLLM's scheme: the shape's key=value items, then the GPU's CUDA name with '_' for ' '."""
    return f"{stem},device={gpu.replace(' ', '_')}.json"


def find_tuned(folder: str, stem: str, gpu: str, shipped: Path) -> Tuned | None:
    """The tuned table for `stem` (E=..,I=..,H=..,dtype=.. or N=..,K=..,...) on `gpu`, in order: the user's cache
    (`cache_dir()/tuned/<folder>`, what `tsdev tune` writes), the file shipped for this GPU (in `shipped`), the
    file shipped for its nearest sibling (SIBLING_GPUS); None: the kernel's defaults. Each file read once."""
    candidates = [(cache_dir() / "tuned" / folder / tuned_file_name(stem, gpu), "your tuned file"),
                  (shipped / tuned_file_name(stem, gpu), "shipped for this GPU")]
    candidates += [(shipped / tuned_file_name(stem, sibling), f"shipped for the {sibling}")
                   for sibling in SIBLING_GPUS.get(gpu, ())]
    for path, source in candidates:
        if table := tuned_configs(str(path)):
            return Tuned(table, path, source)
    return None


def nearest(table: dict[int, object], tokens: int):
    """The entry of the token bucket nearest to `tokens` (the smaller on a tie)."""
    return table[min(table, key=lambda bucket: (abs(bucket - tokens), bucket))]


@functools.lru_cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (kernels size their grids by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with programmatic dependent launch (the PDL flag and launch_pdl)."""
    return x.is_cuda and os.environ.get("TSDEV_PDL", "1") != "0" and _pdl_capable(x.device.index or 0)


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Under PDL: let the next kernel launch, then wait until the previous one has finished and its writes
    are visible. Every program must call it, unconditionally (a kernel whose programs all skipped it could
    end before its predecessor, and the next kernel would wait on the wrong one)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
