"""The warm-up manifest (tsdev/hotreload/manifest.py): what a start compiled, written down and handed to the compile
pool by the next start. Its entries must name exactly the binaries Triton's JIT built -- a job made from one compiles
to the same disk-cache key, so the next warm-up loads instead of compiling -- and a start's configuration picks its
file. Compiled for sm_90 in a process of its own (no interpreter, no GPU)."""
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from test_compile_pool import KERNEL


CAST = """

@triton.jit
def cast(X, N, BLOCK: tl.constexpr, DOT: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < N).to(DOT).to(tl.float32), mask=offs < N)
"""


@pytest.mark.slow
def test_a_manifest_entry_compiles_to_the_binary_the_jit_built_and_survives_its_file(pkg, tmp_path):
    """Also for a dtype constexpr (the decode attention's DOT): left out, a fresh machine compiled those kernels one
    after another in its graph capture."""
    pkg.write("ops", KERNEL + CAST)
    check = textwrap.dedent(f"""
        import json
        from pathlib import Path
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend
        from tsdev.hotreload import manifest
        from {pkg.name} import ops

        cache = Path({str(tmp_path / "triton-cache")!r})
        cubins = lambda: len(list(cache.rglob("*.cubin")))
        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        attrs = {{(0,): [["tt.divisibility", 16]]}}
        for kernel, spec, options in (
                (ops.kernel, ({{"X": "*fp32", "N": "i32", "BLOCK": "constexpr"}}, {{(2,): 64}}), {{"num_warps": 8}}),
                (ops.cast, ({{"X": "*fp32", "N": "i32", "BLOCK": "constexpr", "DOT": "constexpr"}},
                            {{(2,): 64, (3,): tl.bfloat16}}), {{}})):
            built = triton.compile(ASTSource(kernel, *spec, attrs), target=target, options=options)
            kernel.device_caches = {{0: ({{"key": built}}, {{}}, target, backend, None)}}  # as the JIT keeps it
        path = Path({str(tmp_path / "warmup" / "m.json")!r})
        manifest.write(path, manifest.entries(["{pkg.name}.ops", "{pkg.name}"]))
        entries = manifest.read(path)
        before = cubins()
        for job in manifest.jobs(entries, target):
            signature, constexprs, attrs, options = job.spec
            triton.compile(ASTSource(getattr(ops, job.name), signature, constexprs, attrs), target=target,
                           options=options)
        same = cubins() == before  # cache hits: the jobs are the JIT's binaries
        triton.compile(ASTSource(ops.kernel, *manifest.jobs(entries, target)[0].spec[:3]), target=target, options={{}})
        print(json.dumps({{"entries": entries, "same": same, "other": cubins() == before + 1,
                           "garbled": manifest.read(path.with_name("missing.json"))}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    entry, cast = got["entries"]  # the package's __init__ holds no kernel: a binary of each kernel in ops
    assert [(e["module"], e["name"]) for e in (entry, cast)] == [(f"{pkg.name}.ops", n) for n in ("kernel", "cast")]
    assert entry["constexprs"] == [[[2], 64]] and entry["attrs"] == [[[0], [["tt.divisibility", 16]]]]
    assert cast["constexprs"] == [[[2], 64], [[3], {"tl.dtype": "bf16"}]]
    assert entry["options"] == {"num_warps": 8}  # only what differs from the backend's defaults for the target
    assert got["same"] and got["other"]  # its job hits the JIT's key; the defaults' options (4 warps) do not
    assert got["garbled"] == []


def test_a_start_picks_its_manifest_by_what_changes_its_kernels(tmp_path, monkeypatch):
    from triton.backends.compiler import GPUTarget

    from tsdev.launch.serve import manifest_path
    from tsdev_runtime.config import EngineConfig

    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path))
    sm90, base = GPUTarget("cuda", 90, 32), EngineConfig("default", device="cuda")
    path = manifest_path(base, sm90, "3.6.0")
    assert path.parent == tmp_path / "warmup" and path.name.startswith("sm90-triton3.6.0-")
    same = [dataclasses.replace(base, seed=7, device="cuda:0", cudagraph_capture_first=[1], gpu_memory_utilization=0.5)]
    other = [dataclasses.replace(base, quantization="fp8"), dataclasses.replace(base, kv_cache_dtype="fp8"),
             dataclasses.replace(base, max_running=8), dataclasses.replace(base, model="/models/qwen3-8b")]
    assert all(manifest_path(c, sm90, "3.6.0") == path for c in same)
    assert len({manifest_path(c, sm90, "3.6.0") for c in other} | {path}) == len(other) + 1
    assert manifest_path(base, GPUTarget("cuda", 100, 32), "3.6.0") != path != manifest_path(base, sm90, "3.9.0")


def test_a_start_hands_the_last_such_starts_binaries_to_its_pool_and_says_so(tmp_path, monkeypatch, caplog):
    import logging
    import threading

    from triton.backends.compiler import GPUTarget

    from tsdev.hotreload import manifest
    from tsdev.launch.serve import manifest_path, prewarm
    from tsdev_runtime.config import EngineConfig

    class Pool:
        target, workers, handed = GPUTarget("cuda", 90, 32), 2, threading.Event()

        def compile(self, sources, jobs):
            self.got = (sources, jobs)
            self.handed.set()
            raise RuntimeError("the pool closed at exit")  # never reaches the server

    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path))
    config, pool = EngineConfig("default", device="cuda"), Pool()
    assert prewarm(None, config) is None  # no pool (the CPU, or no --allow-reload-forward): nothing to hand
    path = manifest_path(config, pool.target, __import__("triton").__version__)
    started = prewarm(pool, config)
    assert started.manifest == path and not pool.handed.is_set()  # no manifest yet: the warm-up compiles
    entry = {"module": "tsdev_kernels.ops.norm", "name": "_rms_norm_kernel", "signature": {"X": "*bf16"},
             "constexprs": [[[1], 1024]], "attrs": [[[0], [["tt.divisibility", 16]]]], "options": {"num_warps": 4}}
    manifest.write(path, [entry])
    with caplog.at_level(logging.INFO, "tsdev_runtime.startup"):
        started = prewarm(pool, config)
    assert started.manifest == path and started.shipped is None  # this machine's own: the warm-up does not wait
    assert pool.handed.wait(10)
    sources, [job] = pool.got
    assert sources == {} and (job.module, job.name, job.target) == (entry["module"], entry["name"], pool.target)
    assert job.spec == ({"X": "*bf16"}, {(1,): 1024}, {(0,): [["tt.divisibility", 16]]}, {"num_warps": 4})
    assert "compiling 1 kernel binary the last start of this configuration built, in 2 worker(s)" in caplog.text


def test_a_fresh_machine_takes_the_manifest_shipped_for_its_configuration(tmp_path, monkeypatch):
    import threading

    from triton.backends.compiler import GPUTarget

    from tsdev.hotreload import manifest
    from tsdev.launch import serve
    from tsdev_runtime.config import EngineConfig

    class Pool:
        target, workers, handed, finish = GPUTarget("cuda", 90, 32), 8, threading.Event(), threading.Event()

        def compile(self, sources, jobs):
            self.jobs = jobs
            self.handed.set()
            self.finish.wait(10)  # compiling

    monkeypatch.setenv("TSDEV_CACHE_DIR", str(tmp_path / "cache"))  # this machine has none
    monkeypatch.setattr(serve, "SHIPPED_WARMUP", tmp_path / "shipped")
    config, pool = EngineConfig("default", device="cuda"), Pool()
    mine = serve.manifest_path(config, pool.target, __import__("triton").__version__)
    entry = {"module": "m", "name": "k", "signature": {}, "constexprs": [], "attrs": [], "options": {}}
    manifest.write(tmp_path / "shipped" / mine.name, [entry, entry])
    started = serve.prewarm(pool, config)
    assert started.manifest == mine and pool.handed.wait(10) and len(pool.jobs) == 2
    assert not mine.exists()  # written by the start once it has warmed up, as its own
    # the warm-up waits for the pool's compiles (rather than compile the same kernels again beside it), at most a while
    started.wait(timeout=0.2)
    assert started.shipped.is_alive()
    pool.finish.set()
    started.wait()
    assert not started.shipped.is_alive()


def test_every_shipped_manifest_entry_fits_the_kernel_it_names():
    """A shipped entry that no longer fits its kernel (renamed, an argument added or moved) costs a fresh machine a
    failed compile and a warm-up compile in its place: each names a kernel of its module with exactly the entry's
    arguments, in order, its constexprs at constexpr parameters."""
    import importlib
    import json

    from triton.runtime.jit import JITFunction

    from tsdev.launch import serve

    files = sorted(serve.SHIPPED_WARMUP.glob("*.json"))
    assert files
    for path in files:
        for entry in json.loads(path.read_text()):
            where = f"{path.name}: {entry['module']}.{entry['name']}"
            found = getattr(importlib.import_module(entry["module"]), entry["name"], None)
            assert hasattr(found, "fn"), f"{where} is no kernel"
            kernel = JITFunction(found.fn)  # (as a GPU's JIT sees it; under the interpreter the module holds another)
            assert list(entry["signature"]) == list(kernel.arg_names), where
            constexprs = {kernel.arg_names[i] for (i,), _ in entry["constexprs"]}
            assert {p.name for p in kernel.params if p.is_constexpr} <= constexprs, where
