"""How long a hot reload takes: one edited module with 5 dependents (target: < 50 ms).

    python3 benchmarks/hotreload_bench.py            # synthetic package + the real runtime if it imports
    python3 benchmarks/hotreload_bench.py --json out.json

The synthetic package is sized like the runtime's own: an op module with Triton
kernels (decorated for the interpreter on a machine without a GPU; compilation
happens at first launch, which a reload does not do), layers and models of nn.Module classes
importing it, and 20 unrelated modules the reloader must still read and check.
Each iteration edits the op module on disk, reloads (read, plan, compile,
execute, patch, kernels) and commits.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time

if not os.path.exists("/dev/nvidiactl"):  # no GPU: kernels are decorated for Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.dont_write_bytecode = True

from tsdev.hotreload import Reloader  # noqa: E402

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

KERNEL = '''
@triton.jit
def _{name}_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, x * tl.rsqrt(var + eps) * w, mask=mask)
'''

FUNCTION = '''
def {name}(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Reference {name}: computed in fp32 and cast back, like the kernel."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        x = x * weight.float()
    return x.to(dtype)
'''

CLASS = '''
class {name}(nn.Module):
    """A layer with the usual handful of methods."""

    def __init__(self, hidden: int = 64, eps: float = 1e-6):
        super().__init__()
        self.hidden = hidden
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def extra_repr(self) -> str:
        return f"hidden={{self.hidden}}, eps={{self.eps}}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_norm(x) + self._bias(x)

    def _apply_norm(self, x):
        return {call}(x, self.weight, self.eps)

    def _bias(self, x):
        return torch.zeros_like(x)

    @property
    def size(self) -> int:
        return self.hidden

    @classmethod
    def from_config(cls, config: dict) -> "{name}":
        return cls(config.get("hidden", 64), config.get("eps", 1e-6))

    @staticmethod
    def flops(tokens: int, hidden: int) -> int:
        return 4 * tokens * hidden
'''


def module(header: str, classes: int, functions: int, kernels: int, call: str, tag: str) -> str:
    parts = [header]
    parts += [KERNEL.format(name=f"{tag}{i}") for i in range(kernels if HAVE_TRITON else 0)]
    parts += [FUNCTION.format(name=f"{tag}_fn{i}") for i in range(functions)]
    parts += [CLASS.format(name=f"{tag.title()}Layer{i}", call=call) for i in range(classes)]
    return "\n".join(textwrap.dedent(p) for p in parts)


def build_package(root: str, name: str) -> None:
    """ops.norm <- layers.norm <- layers.fused <- models.{llama,qwen3} <- models (5 dependents)."""
    torch_header = "import torch\nfrom torch import nn\n"
    triton_header = "import triton\nimport triton.language as tl\n" if HAVE_TRITON else ""
    files = {
        "__init__": "",
        "ops/__init__": '"""Op families."""\n',
        "ops/norm": module(torch_header + triton_header + "EPS = 1e-6\n", 2, 6, 4, "norm_fn0", "norm"),
        "layers/__init__": "",
        "layers/norm": module(torch_header + f"from {name}.ops import norm as norm_ops\nEPS = 1e-6\n", 6, 3, 0,
                              "norm_ops.norm_fn0", "lnorm"),
        "layers/fused": module(torch_header + f"from {name}.layers.norm import LnormLayer0, lnorm_fn0\nEPS = 1e-6\n",
                               6, 3, 0, "lnorm_fn0", "fused"),
        "models/__init__": f"from {name}.models.llama import *\nfrom {name}.models.qwen3 import *\n",
        "models/llama": module(torch_header + f"from {name}.layers.fused import fused_fn0\nEPS = 1e-6\n", 8, 2, 0,
                               "fused_fn0", "llama"),
        "models/qwen3": module(torch_header + f"from {name}.layers.fused import fused_fn1\nEPS = 1e-6\n", 8, 2, 0,
                               "fused_fn1", "qwen"),
    }
    for i in range(20):  # unrelated modules: read and checked on every reload, never executed
        files[f"layers/other{i}"] = module(torch_header + "EPS = 1e-6\n", 4, 4, 0, f"other{i}_fn0", f"other{i}")
    for rel, src in files.items():
        path = os.path.join(root, name, rel + ".py")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(src)


def measure(reloader: Reloader, edit, iterations: int) -> dict:
    """Reload `iterations` times after `edit(i)`; the first reload is reported apart."""
    runs = []
    for i in range(iterations + 1):
        sources = edit(i)
        tx = reloader.reload(sources=sources)
        if not tx.report.ok:
            raise SystemExit(f"reload failed: {tx.report.error}")
        tx.commit()
        runs.append(tx.report)
    steady = runs[1:]
    phases = {k: statistics.median(r.timings.get(k, 0.0) for r in steady) * 1e3 for k in runs[0].timings}
    return {
        "reloaded": runs[-1].reloaded, "dependents": runs[-1].dependents, "patched": runs[-1].patched,
        "first_ms": runs[0].timings["total"] * 1e3,
        "median_ms": statistics.median(r.timings["total"] for r in steady) * 1e3,
        "p90_ms": statistics.quantiles([r.timings["total"] for r in steady], n=10, method="inclusive")[-1] * 1e3,
        "max_ms": max(r.timings["total"] for r in steady) * 1e3,
        "phases_ms": phases,
    }


def bench_synthetic(iterations: int) -> dict:
    root = tempfile.mkdtemp(prefix="tsdev_bench_")
    name = "tsdev_bench_pkg"
    build_package(root, name)
    sys.path.insert(0, root)
    import importlib
    start = time.perf_counter()
    importlib.import_module(f"{name}.models")
    for i in range(20):
        importlib.import_module(f"{name}.layers.other{i}")
    import_s = time.perf_counter() - start
    reloader = Reloader([f"{name}.ops", f"{name}.layers", f"{name}.models"])
    path = os.path.join(root, name, "ops", "norm.py")
    original = open(path).read()

    def edit(i: int):
        with open(path, "w") as f:
            f.write(original.replace("EPS = 1e-6", f"EPS = 1e-6 + {i} * 1e-9"))
        return None  # reload() reads the disk itself
    result = measure(reloader, edit, iterations)
    result.update(package=f"synthetic ({len(reloader._ran)} modules, "
                  f"{sum(len(s.source) for _, s in reloader._ran.values()) // 1024} KiB)", import_s=import_s)
    return result


def bench_runtime(iterations: int) -> dict | None:
    """The real packages, edited through `sources=` so no file in the tree is touched."""
    try:
        import tsdev_kernels.ops.norm  # noqa: F401
        import tsdev_runtime.layers  # noqa: F401
        import tsdev_runtime.models  # noqa: F401
        import tsdev_runtime.sampling  # noqa: F401
    except Exception as e:  # not written yet, or broken right now
        print(f"runtime packages did not import ({type(e).__name__}: {e}); skipping them")
        return None
    reloader = Reloader(["tsdev_runtime.models", "tsdev_runtime.layers", "tsdev_runtime.sampling", "tsdev_kernels.ops"])
    base = reloader.read_sources()

    def edit(i: int):
        sources = dict(base)
        sources["tsdev_kernels.ops.norm"] = base["tsdev_kernels.ops.norm"] + f"\n# bench edit {i}\n".encode()
        return sources
    result = measure(reloader, edit, iterations)
    result.update(package=f"runtime ({len(reloader._ran)} modules)")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = [r for r in (bench_synthetic(args.iterations), bench_runtime(args.iterations)) if r]
    for r in results:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases_ms"].items())
        print(f"{r['package']}: edit {r['reloaded'][0]} + {len(r['dependents'])} dependents, "
              f"{r['patched']} objects patched: median {r['median_ms']:.1f} ms, p90 {r['p90_ms']:.1f} ms, "
              f"max {r['max_ms']:.1f} ms, "
              f"first {r['first_ms']:.1f} ms\n  phases (median ms): {phases}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
