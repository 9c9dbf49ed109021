"""Triton compiles in this process, counted per kernel (`tsdev_jit_compiles_total` in /metrics), and each one that
happens while the engine serves logged as a warning naming the kernel and its specialisation.

Nothing should compile while serving: startup warms every specialisation a request can reach, and a reload compiles
its kernels ahead, so a compile outside those two stalls the step it lands in (0.3-2 s: the 706 ms step of the
offline workload on a fresh machine). Triton calls its post-compile hook on every compile (its disk cache included),
from Triton 3.6 on; under Triton's interpreter (CPU) nothing compiles and nothing is counted.
"""
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("tsdev_runtime.server")
progress = logging.getLogger("tsdev_runtime.startup")  # what a start is doing now (tsdev serve shows it while it waits)


class JitCompiles:
    """The compiles of this process. `expected()` marks the spans where compiling is the point (startup, a reload):
    counted, not warned about."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.built = 0  # of them, those Triton's disk cache did not answer (its compilation listener says)
        self._expected = 0
        self._lock = threading.Lock()

    @contextmanager
    def expected(self) -> Iterator[None]:
        with self._lock:
            self._expected += 1
        try:
            yield
        finally:
            with self._lock:
                self._expected -= 1

    def record(self, kernel: str, specialisation: str) -> None:
        with self._lock:
            self.counts[kernel] += 1
            expected, total = self._expected > 0, sum(self.counts.values())
        if expected:
            progress.info("compiled %s (%d Triton compile(s) in this process)", kernel, total)
        else:
            log.warning("Triton compiled %s while serving (%s): a specialisation startup did not warm; the step "
                        "waited for it", kernel, specialisation)


COMPILES = JitCompiles()  # one per process, as Triton's hook is


def jit_compiles() -> dict[str, int]:
    """Triton compiles in this process so far, per kernel."""
    return dict(COMPILES.counts)


def jit_built() -> int:
    """How many of this process's compiles so far Triton's disk cache did not answer: built here."""
    return COMPILES.built


def install() -> JitCompiles:
    """Chain COMPILES into Triton's post-compile hook (once per process; a hook set before stays called)."""
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return COMPILES  # an older Triton: not counted
    previous = runtime.jit_post_compile_hook
    if getattr(previous, "counts_into", None) is COMPILES:
        return COMPILES

    def hook(**kwargs):
        fn = kwargs.get("fn")
        COMPILES.record(f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}", str(kwargs.get("repr", "")))
        return previous(**kwargs) if previous is not None else None

    hook.counts_into = COMPILES
    runtime.jit_post_compile_hook = hook
    compilation = getattr(triton.knobs, "compilation", None)
    if compilation is not None and hasattr(compilation, "listener"):
        chained = compilation.listener

        def listener(*, cache_hit, **kwargs):
            if not cache_hit:
                with COMPILES._lock:
                    COMPILES.built += 1
            if chained is not None:
                chained(cache_hit=cache_hit, **kwargs)
        compilation.listener = listener
    return COMPILES
