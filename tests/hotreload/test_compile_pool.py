"""The compile pool (tsdev/hotreload/pool.py) on a machine without a GPU: its workers compile real binaries for the
H200 (sm_90, through ptxas; they never run Triton's interpreter) into Triton's disk cache, where a process of its own
then finds them instead of compiling; a kernel that does not compile comes back naming its file:line and leaves the
worker usable; a worker that dies is replaced. Each test has its own Triton cache directory."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tsdev.hotreload.ahead import Job
from tsdev.hotreload.pool import CompilePool

KERNEL = """
import triton
import triton.language as tl


@triton.jit
def scale(helper_x):
    return helper_x * 2.0


@triton.jit
def kernel(X, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, scale(tl.load(X + offs, mask=offs < N)), mask=offs < N)
"""


def sm90():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def sm90_job(module: str, block: int = 16) -> Job:
    spec = ({"X": "*fp32", "N": "i32", "BLOCK": "constexpr"}, {(2,): block}, {}, {"num_warps": 4})
    return Job(module, "kernel", spec, sm90())


def cubins(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*.cubin")}


@pytest.fixture
def pool(pkg, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # the workers inherit it
    pkg.write("ops", KERNEL)
    pkg.mod("ops")
    pool = CompilePool([pkg.name], workers=2, target=sm90())  # each worker warms its compiler in a scratch cache
    pool.wait_ready()
    yield pool
    pool.close()


def sources(pkg, **edits: str) -> dict[str, bytes]:
    return {f"{pkg.name}.{rel}": Path(pkg.path(rel)).read_bytes() if rel not in edits else edits[rel].encode()
            for rel in ("ops",)}


@pytest.mark.slow
def test_a_worker_compiles_the_edited_kernel_into_the_cache_where_another_process_finds_it(pkg, pool, tmp_path):
    cache = tmp_path / "triton-cache"
    edited = KERNEL.replace("helper_x * 2.0", "helper_x * 3.0")  # an edit of the inlined helper
    [done] = pool.compile(sources(pkg, ops=edited), [sm90_job(f"{pkg.name}.ops")])
    assert done.error is None and done.seconds > 0
    assert len(cubins(cache)) == 1
    Path(pkg.path("ops")).write_text(textwrap.dedent(edited))  # as the user saved it: what the server then loads
    before = cubins(cache)
    load = textwrap.dedent(f"""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from {pkg.name} import ops
        triton.compile(ASTSource(ops.kernel, {{"X": "*fp32", "N": "i32", "BLOCK": "constexpr"}}, {{(2,): 16}}, {{}}),
                       target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}})
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert cubins(cache) == before  # a cache hit: the worker's binary, not a second compile
    [again] = pool.compile(sources(pkg, ops=KERNEL), [sm90_job(f"{pkg.name}.ops")])  # the revert: another binary
    assert again.error is None and len(cubins(cache)) == 2


def test_a_module_needing_an_extra_that_is_not_installed_leaves_the_workers_compiling(pkg, tmp_path, monkeypatch):
    """A package holds modules for optional extras (kernels/tsdev_kernels/ops/activation_cute.py needs `tsdev[cute]`):
    the server imports them only when picked, and the workers, which import every module of the packages, must skip
    them."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    pkg.write("ops", KERNEL)
    pkg.write("extra_ops", "import a_package_that_is_not_installed  # noqa: F401\n")
    pkg.mod("ops")
    pool = CompilePool([pkg.name], workers=1, target=sm90())
    try:
        [done] = pool.compile(sources(pkg), [sm90_job(f"{pkg.name}.ops")])
        assert done.error is None and pool.restarts == 0
        assert len(cubins(tmp_path / "triton-cache")) == 1
    finally:
        pool.close()


def test_workers_import_the_kernel_modules_they_are_given_and_a_jobs_but_not_every_module_whose_source_comes(
        pkg, tmp_path, monkeypatch):
    """`modules` (the serving process's kernel modules): a worker imports those and no more -- a module the server
    never imported (an optional extra it does not use) stays out of it -- and a job's module when it lacks it; the
    sources of other modules (the models around the kernels) come along with every compile but are not imported:
    each worker re-running them cost every compile a few ms (benchmarks/worker_reload.py)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    marker = tmp_path / "imported"
    pkg.write("ops", KERNEL)
    pkg.write("later", f"from pathlib import Path\nPath({str(marker)!r}).write_text('yes')\n")
    pkg.mod("ops")
    pool = CompilePool([pkg.name], workers=1, target=sm90(), modules=[pkg.name])
    try:
        pool.wait_ready()
        later = Path(pkg.path("later")).read_bytes()
        [done] = pool.compile({**sources(pkg), f"{pkg.name}.later": later}, [sm90_job(f"{pkg.name}.ops")])
        assert done.error is None and cubins(tmp_path / "triton-cache") and not marker.exists()
    finally:
        pool.close()


@pytest.mark.slow
def test_a_pool_started_before_the_gpu_was_known_compiles_for_it_once_aimed(pkg, tmp_path, monkeypatch):
    """`tsdev serve` starts its pool before it imports torch (`early_compile_pool`): no target, no modules. Aimed at
    the GPU once known (`aim`), a worker imports the serving process's modules and compiles for that target."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    marker = tmp_path / "imported"
    pkg.write("ops", KERNEL)
    pkg.write("later", f"from pathlib import Path\nPath({str(marker)!r}).write_text('yes')\n")
    pkg.mod("ops")
    pool = CompilePool([pkg.name], workers=1, modules=())
    try:
        pool.wait_ready()
        assert not marker.exists()
        pool.aim(sm90(), [pkg.name, f"{pkg.name}.later"])
        [done] = pool.compile(sources(pkg), [sm90_job(f"{pkg.name}.ops")])
        assert done.error is None and marker.read_text() == "yes" and cubins(tmp_path / "triton-cache")
    finally:
        pool.close()


def test_a_kernel_that_does_not_compile_names_its_file_and_line_and_the_worker_stays_usable(pkg, pool, tmp_path):
    broken = KERNEL.replace("offs = tl.arange(0, BLOCK)", "offs = tl.arange(0, BLOCK + 1)")  # not a power of 2
    results = pool.compile(sources(pkg, ops=broken), [sm90_job(f"{pkg.name}.ops")] * 2)
    assert all(r.error and f"{pkg.path('ops')}:" in r.error for r in results), results
    assert not cubins(tmp_path / "triton-cache")
    [fixed] = pool.compile(sources(pkg), [sm90_job(f"{pkg.name}.ops")])
    assert fixed.error is None


@pytest.mark.slow
def test_a_worker_that_dies_is_replaced(pkg, pool):
    import signal

    first = set(pool.pids())
    os.kill(next(iter(first)), signal.SIGKILL)
    [done] = pool.compile(sources(pkg), [sm90_job(f"{pkg.name}.ops", block=32)])
    assert done.error is None and pool.restarts == 1
    assert len(pool.pids()) == 2 and not first & set(pool.pids())
    workers = pool.pids()
    pool.close()
    assert not any(map(alive, workers))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has ended


@pytest.mark.slow
def test_workers_end_with_a_server_that_exits_without_closing_the_pool(pkg, tmp_path):
    """They share its output: a reader of that pipe (a benchmark, the daemon) would wait on them for ever."""
    pkg.write("ops", KERNEL)
    server = textwrap.dedent(f"""
        import os
        from tsdev.hotreload.pool import CompilePool
        pool = CompilePool(["{pkg.name}"], workers=2)
        pool.wait_ready()
        print(*pool.pids(), flush=True)
        os._exit(0)  # as a killed server: no close()
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", server], env=env, stdout=subprocess.PIPE, text=True)
    output, _ = proc.communicate(timeout=120)  # the pipe closes once the workers are gone too
    workers = list(map(int, output.split()))
    assert len(workers) == 2 and not any(map(alive, workers))


def test_a_gluon_kernel_compiles_in_a_worker_from_gluons_own_ir(pkg, tmp_path, monkeypatch):
    from test_hotreload_gluon import GLUON

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    pkg.write("gops", GLUON)
    pkg.mod("gops")
    pool = CompilePool([pkg.name], workers=1, target=sm90())
    try:
        edited = GLUON.replace("return x * 2.0", "return x * 3.0").encode()
        spec = ({"X": "*fp32", "N": "i32", "BLOCK": "constexpr"}, {(2,): 64}, {}, {"num_warps": 1})
        [done] = pool.compile({f"{pkg.name}.gops": edited}, [Job(f"{pkg.name}.gops", "uses_scale", spec, sm90())])
        assert done.error is None, done.error  # (Triton's plain AST source cannot build a Gluon kernel)
        assert len(cubins(tmp_path / "triton-cache")) == 1
    finally:
        pool.close()


def test_a_buffer_built_ahead_lands_in_the_cache_and_the_save_of_its_text_builds_nothing(pkg, tmp_path, monkeypatch):
    """An editor's unsaved buffer compiled ahead (runtime/tsdev_runtime/engine/buffers.py), with real sm_90 binaries:
    the pool builds the kernel its text changes, for the specialisation the live kernel holds, into Triton's cache
    while nothing is reloaded; the save of that text then builds nothing (reused) and adds no binary."""
    import triton
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    from tsdev.hotreload import Reloader

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a JITFunction, holding binaries (as on a GPU)
    pkg.write("ops", KERNEL)
    ops = pkg.mod("ops")
    pool = CompilePool([pkg.name], workers=1, target=sm90())
    try:
        [done] = pool.compile(sources(pkg), [sm90_job(f"{pkg.name}.ops")])  # the binary the server runs: a worker
        assert done.error is None  # builds it, and it is loaded from the cache here (as after a launch)
        signature, constexprs, attrs, options = sm90_job(f"{pkg.name}.ops").spec
        served = triton.compile(ASTSource(ops.kernel, signature, constexprs, attrs), target=sm90(), options=options)
        ops.kernel.device_caches[0] = ({"served": served}, {}, sm90(), make_backend(sm90()), None)
        reloader = Reloader([pkg.name], pool=pool)
        cache = tmp_path / "triton-cache"
        before = cubins(cache)
        edited = KERNEL.replace("helper_x * 2.0", "helper_x * 3.0")
        built = reloader.compile_ahead({**reloader.read_sources(), f"{pkg.name}.ops": edited.encode()})
        assert (built.binaries, built.kernels, built.reused) == (1, (f"{pkg.name}.ops.kernel",), False)
        assert len(cubins(cache) - before) == 1 and "2.0" in ops.scale.src  # built; the old code still runs
        Path(pkg.path("ops")).write_text(textwrap.dedent(edited))  # the save, of that text
        after = cubins(cache)
        again = reloader.compile_ahead()
        assert (again.binaries, again.reused) == (1, True) and cubins(cache) == after
    finally:
        pool.close()


@pytest.mark.slow
def test_a_binary_on_disk_is_found_by_triton_compiles_own_key_so_a_revert_skips_the_pool(pkg, tmp_path):
    """`ahead._on_disk` (what lets a revert or an edit seen before skip the compile and the pool's round trip) answers
    as `triton.compile` would: True for the source and specialisation it compiled, False for an edited kernel or an
    edited helper it inlines until that version is compiled too. Compiled for sm_90 in a process of its own (no
    interpreter), with its own Triton cache."""
    pkg.write("ops", KERNEL)
    pkg.write("ops_edited", KERNEL.replace("offs < N)), mask", "offs < N) + 1.0), mask"))
    pkg.write("ops_helper", KERNEL.replace("helper_x * 2.0", "helper_x * 3.0"))
    check = textwrap.dedent(f"""
        import json
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend
        from tsdev.hotreload.ahead import _on_disk
        from {pkg.name} import ops, ops_edited, ops_helper
        target = GPUTarget("cuda", 90, 32)
        backend, spec = make_backend(target), ({{"X": "*fp32", "N": "i32", "BLOCK": "constexpr"}}, {{(2,): 16}}, {{}})
        def build(module):
            return triton.compile(ASTSource(module.kernel, *spec), target=target, options={{"num_warps": 4}})
        live = build(ops)
        seen = [_on_disk(m.kernel, live, target, backend) for m in (ops, ops_edited, ops_helper)]
        build(ops_edited)
        seen.append(_on_disk(ops_edited.kernel, live, target, backend))
        print(json.dumps(seen))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[true, false, false, true]", proc.stdout
