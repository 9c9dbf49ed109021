"""Triton scenarios. On CPU the interpreter runs the kernels (TRITON_INTERPRET=1, set in conftest);
on a GPU machine the same tests compile them. The compiled-kernel bookkeeping (binaries dropped,
kept, callers invalidated) is also checked on CPU, on `JITFunction` objects with stand-in binaries
(test_hotreload_gpu.py does it with real ones)."""
import collections
import itertools
import os
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
HEADER = f"import torch\nimport triton\nimport triton.language as tl\nDEVICE = {DEVICE!r}\n"

KERNEL = HEADER + """
@triton.jit
def _helper(x):
    return x + 1

@triton.jit
def add_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, _helper(tl.load(x_ptr + offs, mask=mask)), mask=mask)

def run(x):
    out = torch.empty_like(x)
    add_kernel[(1,)](x, out, x.numel(), BLOCK=8)
    return out
"""

X = torch.arange(4, dtype=torch.float32, device=DEVICE)


def test_kernel_body_edit(pkg):
    pkg.write("ops", KERNEL)
    m = pkg.mod("ops")
    run, kernel = m.run, m.add_kernel
    assert run(X).tolist() == [1, 2, 3, 4]
    r = pkg.reloader()
    pkg.edit("ops", KERNEL.replace("_helper(tl.load(x_ptr + offs, mask=mask))",
                                   "tl.load(x_ptr + offs, mask=mask) * 10"))
    report = pkg.reload(r)
    assert run(X).tolist() == [0, 10, 20, 30]
    # the interpreter also caches each helper it ran; a GPU compiles helpers into their callers
    assert m.add_kernel is kernel and report.jit_kernels == (2 if INTERPRET else 1)
    assert report.kernels_only is not INTERPRET  # the interpreter's kernels must run to be checked


def test_helper_edit_seen_by_caller_in_dependent(pkg):
    pkg.write("common", HEADER + "@triton.jit\ndef bump(x):\n    return x + 1\n")
    pkg.write("ops", HEADER + """
from .common import bump

@triton.jit
def kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, bump(tl.load(x_ptr + offs)))

def run(x):
    out = torch.empty_like(x)
    kernel[(1,)](x, out, BLOCK=4)
    return out
""")
    run = pkg.mod("ops").run
    assert run(X).tolist() == [1, 2, 3, 4]
    r = pkg.reloader()
    pkg.edit("common", HEADER + "@triton.jit\ndef bump(x):\n    return x + 100\n")
    report = pkg.reload(r)
    assert report.dependents == pkg.full("ops")
    assert run(X).tolist() == [100, 101, 102, 103]


def test_constexpr_global_changed(pkg):
    src = HEADER + """
SCALE = tl.constexpr(2)

@triton.jit
def kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * SCALE)

def run(x):
    out = torch.empty_like(x)
    kernel[(1,)](x, out, BLOCK=4)
    return out
"""
    pkg.write("ops", src)
    run = pkg.mod("ops").run
    assert run(X).tolist() == [0, 2, 4, 6]
    r = pkg.reloader()
    pkg.edit("ops", src.replace("tl.constexpr(2)", "tl.constexpr(3)"))
    pkg.reload(r)
    assert run(X).tolist() == [0, 3, 6, 9]


AUTOTUNED = HEADER + """
def fake_bench(kernel_call, quantiles):
    kernel_call()
    return [1.0, 1.0, 1.0]

@triton.autotune(configs=[CONFIGS], key=["n"], do_bench=fake_bench)
@triton.jit
def kernel(out_ptr, n, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, 1), tl.full((1,), BLOCK * MUL, tl.float32))

def run():
    out = torch.zeros(1, device=DEVICE)
    kernel[(1,)](out, 4)
    return out.item()
"""


def autotuned(configs: str, mul: int = 1) -> str:
    return AUTOTUNED.replace("CONFIGS", configs).replace("MUL", str(mul))


def test_autotune_config_change(pkg):
    pkg.write("ops", autotuned("triton.Config({'BLOCK': 16}), triton.Config({'BLOCK': 64})"))
    m = pkg.mod("ops")
    run, kernel = m.run, m.kernel
    assert run() == 16 and len(kernel.cache) == 1  # tuned: first config wins the fake benchmark
    r = pkg.reloader()
    pkg.edit("ops", autotuned("triton.Config({'BLOCK': 32}), triton.Config({'BLOCK': 64})"))
    pkg.reload(r)
    assert kernel.cache == {}  # new configs: the old choice is meaningless
    assert run() == 32 and m.kernel is kernel


def test_autotune_body_edit_keeps_tuning(pkg):
    pkg.write("ops", autotuned("triton.Config({'BLOCK': 16}), triton.Config({'BLOCK': 64})"))
    m = pkg.mod("ops")
    run, kernel = m.run, m.kernel
    assert run() == 16
    tuned = dict(kernel.cache)
    r = pkg.reloader()
    pkg.edit("ops", autotuned("triton.Config({'BLOCK': 16}), triton.Config({'BLOCK': 64})", mul=2))
    pkg.reload(r)
    assert kernel.cache == tuned  # same configs and key: no re-tuning
    assert run() == 32


def test_heuristics_edit(pkg):
    src = HEADER + """
@triton.heuristics(values={"BLOCK": lambda args: 4 * FACTOR})
@triton.jit
def kernel(out_ptr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, 1), tl.full((1,), BLOCK, tl.float32))

def run():
    out = torch.zeros(1, device=DEVICE)
    kernel[(1,)](out)
    return out.item()
"""
    pkg.write("ops", src.replace("FACTOR", "1"))
    run = pkg.mod("ops").run
    assert run() == 4
    r = pkg.reloader()
    pkg.edit("ops", src.replace("FACTOR", "2"))
    pkg.reload(r)
    assert run() == 8


def test_kernel_edit_rollback_runs_old_kernel(pkg):
    pkg.write("ops", KERNEL)
    run = pkg.mod("ops").run
    assert run(X).tolist() == [1, 2, 3, 4]
    r = pkg.reloader()
    pkg.edit("ops", KERNEL.replace("return x + 1", "return x + 2"))
    tx = r.reload()
    assert run(X).tolist() == [2, 3, 4, 5]
    tx.rollback("capture failed")
    assert run(X).tolist() == [1, 2, 3, 4]  # the interpreter re-reads the *old* source


# -- compiled kernels (JITFunction), bookkeeping only --------------------------------------------
COMPILED = HEADER + """
@triton.jit
def helper(x):
    return x + 1

@triton.jit
def uses_helper(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, helper(tl.load(x_ptr + offs)))

@triton.jit
def independent(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * 2)
"""
CALLER = HEADER + """
from .kern import helper

@triton.jit
def outside_caller(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, helper(tl.load(x_ptr + offs)))
"""


def fake_compile(kernel):
    """What a launch leaves behind: a hash and a binary in device_caches."""
    kernel.cache_key
    kernel.device_caches[0] = ({"spec": "binary"}, {}, None, None, None)


def test_compiled_kernels_drop_exactly_the_stale_binaries(pkg, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    pkg.write("engine", CALLER)  # outside the reloadable package: never re-executed
    kern, engine = pkg.mod("kern"), pkg.mod("engine")
    assert type(kern.helper).__name__ == "JITFunction"
    kernels = [kern.uses_helper, kern.independent, engine.outside_caller]
    for k in kernels:
        fake_compile(k)
    hashes = [k.hash for k in kernels]
    r = pkg.reloader("kern")
    pkg.edit("kern", COMPILED.replace("return x + 1", "return x + 3"))
    tx = r.reload()
    assert tx.report.ok and tx.report.jit_kernels == 2
    assert not tx.report.kernels_only  # stand-in binaries it cannot read: the warm-up runs instead
    uses_helper, independent, outside = kernels
    assert "x + 3" in kern.helper.src and kern.helper is pkg.mod("engine").helper
    assert dict(uses_helper.device_caches) == {} and uses_helper.cache_key != hashes[0]
    assert dict(outside.device_caches) == {} and outside.cache_key != hashes[2]  # caller elsewhere
    assert independent.device_caches[0][0] == {"spec": "binary"} and independent.hash == hashes[1]
    tx.rollback()
    assert [k.hash for k in kernels] == hashes and "x + 1" in kern.helper.src
    assert all(k.device_caches[0][0] == {"spec": "binary"} for k in kernels)


class StandInBinary:
    """A compiled kernel as `jit.load_binaries` reads it: what it was built for (`src`), its `metadata`, and once
    loaded its `function` (a CUfunction: a distinct number per binary)."""
    loads = itertools.count(0x1000)
    scratch = 0  # global scratch bytes the next stand-ins are built with

    def __init__(self, fn):
        self.src = SimpleNamespace(fn=fn, signature={"x_ptr": "*fp32"}, constants={(1,): 8},
                                   attrs={(0,): [["tt.divisibility", 16]]})
        self.metadata = collections.namedtuple("Metadata", "num_warps launch_pdl shared global_scratch_size")(
            4, [True], 1024, StandInBinary.scratch)
        self.loaded, self.function = False, None

    def _init_handles(self):
        self.loaded, self.function = True, next(StandInBinary.loads)


class StandInBackend:
    def parse_options(self, options):
        return SimpleNamespace(**options)


def compile_stand_ins(monkeypatch, *kernels):
    """Give each kernel a readable stand-in binary under key "spec"; record what `_do_compile` is asked for."""
    for kernel in kernels:
        kernel.cache_key
        kernel.device_caches[0] = ({"spec": StandInBinary(kernel)}, {}, None, StandInBackend(), None)
    calls = []

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        binary = StandInBinary(self)
        vars(self)["device_caches"][device] = ({key: binary}, {}, None, StandInBackend(), None)
        calls.append((self, key, signature, device, constexprs, vars(options), attrs, warmup, binary))
        return binary
    monkeypatch.setattr(type(kernels[0]), "_do_compile", do_compile, raising=False)
    return calls


def test_a_kernel_body_edit_loads_the_new_binaries_under_the_old_keys(pkg, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    kern = pkg.mod("kern")
    calls = compile_stand_ins(monkeypatch, kern.uses_helper, kern.independent)
    r = pkg.reloader()
    pkg.edit("kern", COMPILED.replace("tl.load(x_ptr + offs) * 2", "tl.load(x_ptr + offs) * 3"))
    tx = r.reload()
    assert tx.report.ok and tx.report.kernels_only and tx.report.jit_kernels == 1
    [(kernel, key, signature, device, constexprs, options, attrs, warmup, binary)] = calls  # uses_helper kept its own
    assert kernel is kern.independent and "* 3" in kernel.src
    assert (key, signature, device, constexprs, attrs, warmup) == (
        "spec", {"x_ptr": "*fp32"}, 0, {(1,): 8}, {(0,): [["tt.divisibility", 16]]}, True)
    assert options == {"num_warps": 4, "launch_pdl": (True,), "shared": 1024, "global_scratch_size": 0} and \
        binary.loaded  # lists back to tuples; loaded now
    assert kern.independent.device_caches[0][0] == {"spec": binary}
    assert tx.report.compiled_in_pause == {}  # the stand-in loads at once: as from Triton's disk cache
    tx.rollback()
    assert kern.independent.device_caches[0][0]["spec"] is not binary and "* 2" in kern.independent.src


def test_a_manifests_binaries_load_into_a_new_process_kernels_whose_source_is_unchanged(pkg, monkeypatch):
    """What a start wrote down (tsdev/hotreload/manifest.py) holds each binary's JIT key and its kernel's source hash:
    `preload` (a restart's standby) loads those of unchanged kernels under their keys, where the first launch looks."""
    from tsdev.hotreload import manifest

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    kern = pkg.mod("kern")
    calls = compile_stand_ins(monkeypatch, kern.independent, kern.uses_helper)
    written = manifest.entries([pkg.full("kern")[0]])
    assert sorted(e["name"] for e in written) == ["independent", "uses_helper"]
    assert all(e["key"] == "spec" and e["hash"] == getattr(kern, e["name"]).cache_key for e in written)
    for kernel in (kern.independent, kern.uses_helper):  # a new process: its kernels hold no binary yet
        kernel.device_caches[0] = ({}, {}, None, StandInBackend(), None)
    [edited] = [e for e in written if e["name"] == "uses_helper"]
    edited["hash"] = "the source before an edit"  # its binary is not this source's: left to the first launch
    assert manifest.preload(written, 0) == 1 and manifest.preload(written, 0) == 0  # (held already: nothing again)
    [(kernel, key, signature, device, constexprs, options, attrs, warmup, binary)] = calls
    assert kernel is kern.independent and (key, signature, device, constexprs, attrs) == (
        "spec", {"x_ptr": "*fp32"}, 0, {(1,): 8}, {(0,): [["tt.divisibility", 16]]})
    assert options == {"num_warps": 4, "launch_pdl": (True,), "shared": 1024, "global_scratch_size": 0}
    assert binary.loaded and kern.independent.device_caches[0][0] == {"spec": binary}
    assert kern.uses_helper.device_caches[0][0] == {}


def test_a_binary_that_compiles_in_the_reload_instead_of_loading_is_named_with_its_seconds(pkg, monkeypatch):
    """Not compiled ahead (a miss of the disk cache): the pause waits for the compile, and the report says whose."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    kern = pkg.mod("kern")
    compile_stand_ins(monkeypatch, kern.independent)
    loads = type(kern.independent)._do_compile

    def compiles(self, *args, **kwargs):  # as Triton's compile on a miss: it works, then tells the listener
        time.sleep(0.02)
        triton.knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=False)
        return loads(self, *args, **kwargs)
    monkeypatch.setattr(type(kern.independent), "_do_compile", compiles)
    r = pkg.reloader()
    pkg.edit("kern", COMPILED.replace("tl.load(x_ptr + offs) * 2", "tl.load(x_ptr + offs) * 3"))
    listening = triton.knobs.compilation.listener  # (an engine made earlier in this process counts compiles so)
    tx = r.reload()
    [(name, seconds)] = tx.report.compiled_in_pause.items()
    assert tx.report.ok and name == f"{pkg.full('kern')[0]}.independent" and seconds >= 0.02
    assert triton.knobs.compilation.listener is listening  # given back
    tx.rollback()


@pytest.mark.parametrize("scratch", [0, 256], ids=["same-launch", "other-scratch"])
def test_a_kernel_body_edit_gives_captured_graphs_each_launched_binarys_replacement(pkg, monkeypatch, scratch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    kern = pkg.mod("kern")
    calls = compile_stand_ins(monkeypatch, kern.independent)
    old = kern.independent.device_caches[0][0]["spec"]
    old._init_handles()  # launched: graphs may hold its function
    monkeypatch.setattr(StandInBinary, "scratch", scratch)  # the new binary's launch needs other arguments
    r = pkg.reloader()
    pkg.edit("kern", COMPILED.replace("tl.load(x_ptr + offs) * 2", "tl.load(x_ptr + offs) * 3"))
    tx = r.reload()
    [*_, new] = calls[0]
    assert tx.report.ok and tx.report.kernels_only
    if scratch:  # no node can run it as the old one was launched: the graphs are captured again
        assert tx.report.graph_swaps is None
    else:  # 4 warps: 128 threads; its shared memory
        assert tx.report.graph_swaps == {old.function: (new.function, 128, 1024)} and new.function != old.function
    tx.rollback()


def test_an_edited_kernel_that_does_not_compile_fails_the_reload_naming_the_kernel(pkg, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    path = pkg.write("kern", COMPILED)
    kern = pkg.mod("kern")
    compile_stand_ins(monkeypatch, kern.independent)

    def fails(self, *args, **kwargs):
        raise ValueError("at 3:4: unsupported operand")
    monkeypatch.setattr(type(kern.independent), "_do_compile", fails)
    r = pkg.reloader()
    pkg.edit("kern", COMPILED.replace("tl.load(x_ptr + offs) * 2", "tl.load(x_ptr + offs) @ 2"))
    tx = r.reload()
    line = COMPILED.splitlines().index("def independent(x_ptr, BLOCK: tl.constexpr):")  # 1-based: the decorator's
    assert not tx.report.ok and tx.report.error == f"{path}:{line}: ValueError: at 3:4: unsupported operand"
    assert "* 2" in kern.independent.src  # rolled back


@pytest.mark.parametrize("edit", [
    ("def independent(x_ptr, BLOCK", "def independent(x_ptr, y_ptr, BLOCK"),  # the launches bind differently
    ("@triton.jit\ndef independent", "@triton.jit(debug=True)\ndef independent"),  # the module's code changed
    ("    return x + 1\n", "    return x + 1\n\nTHRESHOLD = 3\n"),  # so did this
], ids=["parameter", "decorator", "module-level"])
def test_anything_but_a_kernel_body_changed_loads_nothing_and_leaves_the_warm_up_to_run(pkg, monkeypatch, edit):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    kern = pkg.mod("kern")
    calls = compile_stand_ins(monkeypatch, kern.independent)
    r = pkg.reloader()
    pkg.edit("kern", COMPILED.replace(*edit))
    tx = r.reload()
    assert tx.report.ok and not tx.report.kernels_only and calls == []
    tx.rollback()


def test_jit_options_change_drops_binary(pkg, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    kern = pkg.mod("kern")
    independent = kern.independent
    fake_compile(independent)
    r = pkg.reloader()
    pkg.edit("kern", COMPILED.replace("@triton.jit\ndef independent",
                                      "@triton.jit(do_not_specialize=['x_ptr'])\ndef independent"))
    report = pkg.reload(r)
    assert report.jit_kernels == 1 and dict(independent.device_caches) == {}
    assert independent.do_not_specialize == ["x_ptr"]


def test_decorator_stack_changed_is_stale_but_module_runs_new(pkg):
    src = HEADER + """
@triton.jit
def kernel(out_ptr, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, 1), tl.full((1,), BLOCK, tl.float32))

def run():
    out = torch.zeros(1, device=DEVICE)
    kernel[(1,)](out, BLOCKARG)
    return out.item()
"""
    pkg.write("ops", src.replace("BLOCKARG", "BLOCK=4"))
    m = pkg.mod("ops")
    old_kernel, run = m.kernel, m.run
    assert run() == 4
    r = pkg.reloader()
    pkg.edit("ops", src.replace("@triton.jit", "@triton.heuristics(values={'BLOCK': lambda args: 8})\n@triton.jit")
             .replace("BLOCKARG", ""))
    report = pkg.reload(r)
    [stale] = report.stale
    assert stale["name"] == f"{pkg.name}.ops.kernel" and "became Heuristics" in stale["reason"]
    assert stale["where"] == f"{pkg.path('ops')}:6"
    assert run() == 8 and m.kernel is not old_kernel


def test_compile_ahead_builds_the_edited_source_and_leaves_the_live_state_alone(pkg, monkeypatch):
    import sys

    from tsdev.hotreload import ahead

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    pkg.write("user", CALLER)  # a reloadable dependent with its own kernel
    kern, user = pkg.mod("kern"), pkg.mod("user")
    for k in (kern.uses_helper, kern.independent, user.outside_caller):
        fake_compile(k)
    registry = getattr(sys.modules["triton.runtime.jit"], "_triton_jit_function_registry", None)
    before = dict(registry) if isinstance(registry, dict) else None
    built = []
    monkeypatch.setattr(ahead, "_recompile", lambda new_fn, compiled, target, backend: built.append(new_fn) or 1)
    r = pkg.reloader()
    pkg.edit("kern", COMPILED.replace("tl.load(x_ptr + offs) * 2", "tl.load(x_ptr + offs) * 5"))
    count, *_ = r.compile_ahead()
    assert count == 1 and [fn.__name__ for fn in built] == ["independent"]  # unchanged ones keep their binaries
    assert "* 5" in next(fn for fn in built if fn.__name__ == "independent").src  # the new source, not the running one
    assert "* 2" in kern.independent.src and kern.independent.device_caches[0][0] == {"spec": "binary"}
    if before is not None:
        assert dict(registry) == before  # the scratch kernels did not replace the live ones there
    import linecache

    assert "* 2" in "".join(linecache.getlines(kern.__file__))  # tracebacks still show what runs


def test_compile_ahead_raises_when_any_binary_did_not_compile_not_only_when_all_failed(pkg, monkeypatch):
    """A binary that failed ahead compiles in the reload's pause: the reply's warning must say so, even when others
    compiled (the Gluon kernels of an edit failing in the workers while its Triton ones compiled went unreported)."""
    from tsdev.hotreload import ahead

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    pkg.write("user", CALLER)
    kern, user = pkg.mod("kern"), pkg.mod("user")
    for k in (kern.uses_helper, kern.independent, user.outside_caller):
        fake_compile(k)

    def recompile(new_fn, compiled, target, backend):
        if new_fn.__name__ == "outside_caller":
            raise RuntimeError("no backend")
        return 1
    monkeypatch.setattr(ahead, "_recompile", recompile)
    r = pkg.reloader()
    pkg.edit("kern", COMPILED.replace("return x + 1", "return x + 3"))  # uses_helper and outside_caller
    with pytest.raises(RuntimeError,
                       match=r"1 of 2 binaries did not compile: outside_caller: RuntimeError: no backend"):
        r.compile_ahead()


def test_compile_ahead_says_when_it_no_longer_needs_the_program_before_it_compiles(pkg, monkeypatch):
    """`prepared` (an editor's buffer built while serving, runtime/tsdev_runtime/engine/buffers.py): called once the new
    source ran aside and the binaries are drawn up, before any compile, so a reload may run beside the compiles."""
    import linecache
    import sys

    from tsdev.hotreload import ahead

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    kern = pkg.mod("kern")
    fake_compile(kern.independent)
    registry = getattr(sys.modules["triton.runtime.jit"], "_triton_jit_function_registry", None)
    before = dict(registry) if isinstance(registry, dict) else None
    events = []

    def prepared():  # the live state is back as it was by now
        assert "* 2" in "".join(linecache.getlines(kern.__file__))
        assert before is None or dict(registry) == before
        events.append("prepared")

    monkeypatch.setattr(ahead, "_recompile", lambda new_fn, *_: events.append(new_fn.__name__) or 1)
    r = pkg.reloader()
    edited = COMPILED.replace("tl.load(x_ptr + offs) * 2", "tl.load(x_ptr + offs) * 5")
    built = r.compile_ahead({f"{pkg.name}.kern": edited.encode()}, prepared=prepared)
    assert events == ["prepared", "independent"]
    assert (built.binaries, built.kernels, built.reused) == (1, (f"{pkg.name}.kern.independent",), False)
    with pytest.raises(ValueError):  # a failure before the compiles still lets the caller go
        r.compile_ahead(prepared=lambda: events.append("prepared again"), modules=["no.such.module"])
    assert events[-1] == "prepared again"


def test_compile_ahead_of_the_same_edit_again_reuses_what_it_built(pkg, monkeypatch):
    """A buffer compiled ahead, then saved as it was: the save's jit step builds nothing again (the binaries are in
    Triton's cache). A commit since, or a binary serving added since, and it builds again."""
    from tsdev.hotreload import ahead

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pkg.write("kern", COMPILED)
    kern = pkg.mod("kern")
    fake_compile(kern.independent)
    built = []
    monkeypatch.setattr(ahead, "_recompile", lambda new_fn, *_: built.append(new_fn.__name__) or 1)
    r = pkg.reloader()
    edited = COMPILED.replace("tl.load(x_ptr + offs) * 2", "tl.load(x_ptr + offs) * 5")
    buffer = {**r.read_sources(), f"{pkg.name}.kern": edited.encode()}
    assert r.compile_ahead(buffer).binaries == 1 and built == ["independent"]
    pkg.edit("kern", edited)  # saved as it was sent
    again = r.compile_ahead()
    assert (again.binaries, again.reused, built) == (1, True, ["independent"])
    kern.independent.device_caches[0][0]["other spec"] = "binary"  # serving compiled one more specialisation
    assert not r.compile_ahead().reused and built == ["independent"] * 3  # both specialisations
    assert r.compile_ahead().reused
    pkg.reload(r)  # the edit runs now: nothing of it left to build
    pkg.edit("kern", COMPILED)
    fake_compile(kern.independent)
    assert r.compile_ahead().binaries == 1 and built == ["independent"] * 4


@pytest.mark.parametrize("registry", [True, False], ids=["with-registry", "without"])  # Triton 3.6 has none
def test_compile_ahead_also_builds_callers_of_an_edited_helper_elsewhere_against_the_new_helper(pkg, monkeypatch,
                                                                                                registry):
    import sys

    from tsdev.hotreload import ahead, jit

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not registry:
        monkeypatch.setattr(jit, "_registry", lambda: None)
    pkg.write("kern", COMPILED)
    pkg.write("user", CALLER)
    kern, user = pkg.mod("kern"), pkg.mod("user")
    for k in (kern.uses_helper, kern.independent, user.outside_caller):
        fake_compile(k)
    triton_registry = sys.modules["triton.runtime.jit"]._triton_jit_function_registry
    before = dict(triton_registry)
    built = []
    monkeypatch.setattr(ahead, "_recompile", lambda new_fn, compiled, target, backend: built.append(new_fn) or 1)
    r = pkg.reloader()
    pkg.edit("kern", COMPILED.replace("return x + 1", "return x + 3"))
    count, *_ = r.compile_ahead()
    assert count == 2 and sorted(fn.__name__ for fn in built) == ["outside_caller", "uses_helper"]
    caller = next(fn for fn in built if fn.__name__ == "outside_caller")
    assert caller is not user.outside_caller and "x + 3" in caller.fn.__globals__["helper"].src
    assert user.outside_caller.fn.__globals__["helper"] is kern.helper and "x + 1" in kern.helper.src
    assert dict(triton_registry) == before or not registry
    tx = r.reload()  # the reload's own version of the caller hashes as the one compiled ahead
    assert tx.report.ok and user.outside_caller.cache_key == caller.cache_key
    tx.rollback()


def test_the_report_names_the_edited_kernel_and_its_dialect(pkg):
    pkg.write("ops", KERNEL)
    m = pkg.mod("ops")
    m.run(X)
    r = pkg.reloader()
    pkg.edit("ops", KERNEL.replace("return x + 1", "return x + 2"))
    report = pkg.reload(r)
    named = {f"{pkg.name}.ops._helper": "triton"}  # the interpreter reads the new helper when the caller runs;
    if not INTERPRET:                               # a GPU binary of the caller inlines it: reset too
        named[f"{pkg.name}.ops.add_kernel"] = "triton"
    # (Triton's registry also holds earlier tests' kernels, which any reload checks for stale binaries)
    assert {name: d for name, d in report.kernels.items() if name.startswith(f"{pkg.name}.")} == named
