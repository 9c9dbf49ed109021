"""The per-kernel check of a reload (kernels/tsdev_kernels/checks.py): which ops an edit changed, their error against
the reference at the serving shapes (`strict`: inside the pause, before the reload commits, which a failure rolls back;
`report`: once serving resumed, between its steps; when the engine is idle the inputs and the reference's outputs are
drawn before the pause, so the check runs only the new kernels and the comparisons), and their time
per call before and after (never while requests run, never in a reload's save → serving: the old code is timed
while the server is idle, one call at a time, ahead of any reload (`time_one_pending`, EngineControl.time_when_idle),
or by `tsdev check`; the new code after serving resumes, if it is idle then; a time no one could take comes from the
last one taken for that code, marked not fresh, or is missing: the line then shows the new code's time alone).
Times on CUDA only: Triton's interpreter, which runs the checks on the CPU, says nothing of a kernel's speed.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from tsdev_kernels import checks
from tsdev_runtime.config import KERNEL_CHECK_MODES
from tsdev_runtime.control_protocol import KernelCheckResult

MAX_SHAPES = 6  # per op: the pause grows with each
DRAWN_BYTES = 1 << 30  # inputs drawn ahead of a pause, at most (the rest are drawn in it)


def serving_tokens(decode_sizes: list[int], prefill_buckets: list[int], max_running: int) -> tuple[int, ...]:
    """Rows an op sees per step: the smallest, a middle and the largest captured decode batch, and each prefill
    bucket (eager serving: 1 and max_running), at most MAX_SHAPES."""
    decode = sorted(decode_sizes) or [1, max_running]
    picked = {decode[0], decode[len(decode) // 2], decode[-1], *sorted(prefill_buckets)}
    return tuple(sorted(picked)[:MAX_SHAPES])


def why_off(device: str) -> str | None:
    """Why the checks cannot run on `device` (None: they can): they run the Triton kernels."""
    if checks.runnable(device):
        return None
    return (f"kernel checks are off on {device}: they run the Triton kernels, which need CUDA, or Triton's "
            "interpreter on the CPU (start the server with TRITON_INTERPRET=1: slow; --kernel-check off silences this)")


class KernelChecker:
    def __init__(self, mode: str = "report"):
        if mode not in KERNEL_CHECK_MODES:
            raise ValueError(f"kernel check mode {mode!r}: expected one of {', '.join(KERNEL_CHECK_MODES)}")
        self.mode = mode  # the server's: a reload may ask for another
        self.times: dict[tuple, tuple[str, float, str]] = {}  # (op, shape, dtype) -> (its code's fingerprint, µs, how)
        self.timed_now: set[tuple] = set()  # the keys timed for the reload under way (fresh: its old code's now)
        self.timed_idle: set[tuple] = set()  # the keys time_one_pending timed since the last reload
        self.drawn: dict[tuple, checks.Drawn] = {}  # (op, shape) -> inputs drawn ahead for the reload under way
        self.reachable: set[str] = set()  # the ops whose code the reload under way may change
        self.limits: checks.Limits | None | bool = None  # the GPU's (False: none known; None: not looked up yet)

    def fingerprints(self) -> dict[str, str]:
        return checks.fingerprints(checks.declared())

    def prepare(self, serving: checks.Serving, idle: bool, modules: Iterable[str]) -> None:
        """Before the pause, for each op the edited `modules` may change (they define its kernels or a helper these
        call; no other op's code can change), if the engine is idle: draw its inputs and its reference's outputs at
        the serving shapes, up to DRAWN_BYTES, which `check` uses where the edit left the code drawing them
        unchanged. While requests run nothing is done here (they would wait for it, for ops the edit may not
        change): `check` draws in the pause what it needs. The old code is not timed here: its first calls at the
        check's shapes may compile (2 s for the norm ops on the H200), which the save → serving would wait for."""
        self.timed_now, self.drawn, self.reachable = self.timed_idle, {}, set()  # timed since the last reload: fresh
        self.timed_idle = set()
        if not checks.runnable(serving.device):
            return
        edited = set(modules)
        reachable = [c for c in checks.declared() if checks.modules_reached(c) & edited]
        self.reachable = {c.op for c in reachable}
        if not idle:
            return
        size = 0
        for check, shape in [(c, tuple(shape)) for c in reachable if serving.dtype in c.tolerance
                             for shape in c.shapes(serving)]:
            drawn = checks.draw(check, shape, serving.dtype, serving.device)
            size += sum(t.numel() * t.element_size() for t in (*drawn.args, *drawn.want) if isinstance(t, torch.Tensor))
            if size > DRAWN_BYTES:
                break
            self.drawn[(check.op, shape)] = drawn
        if serving.device.startswith("cuda"):  # the references computed now, not in the pause's first wait
            torch.cuda.synchronize(serving.device)

    def time_one_pending(self, serving: checks.Serving) -> bool:
        """Time one (op, shape) whose current code has no time yet (CUDA only), so that the first edit reaching that
        op finds its old code's time. False once every declared op's current code is timed."""
        if not serving.device.startswith("cuda"):
            return False
        declared = checks.declared()
        now = checks.fingerprints(declared)
        for check in declared:
            if serving.dtype not in check.tolerance:
                continue
            for shape in check.shapes(serving):
                key = (check.op, tuple(shape), serving.dtype)
                if self.times.get(key, ("",))[0] != now[check.op]:
                    timing = checks.time_call(check, shape, serving.dtype, serving.device)
                    self.times[key] = (now[check.op], timing.us, timing.how)
                    self.timed_idle.add(key)
                    return True
        return False

    def forget_drawn(self) -> None:
        """The reload ended: the inputs drawn ahead are not kept (a failed reload never reached `check`)."""
        self.drawn = {}

    def check(self, before: Mapping[str, str], serving: checks.Serving) -> list[checks.Result]:
        """The changed ops against their references at the serving shapes (the new code): among the ops `prepare`
        found the edit can reach, and any op new since `before`."""
        drawn, self.drawn = self.drawn, {}
        if not (before and checks.runnable(serving.device)):
            return []
        candidates = [c for c in checks.declared() if c.op in self.reachable or c.op not in before]
        items = [(check, tuple(shape)) for check in checks.changed(before, candidates)
                 if serving.dtype in check.tolerance for shape in check.shapes(serving)]
        results = checks.run_all(items, serving.dtype, serving.device, drawn)
        for result in results:
            key = (result.op, result.shape, serving.dtype)
            old = self.times.get(key)
            if old is not None and old[0] == before.get(result.op):  # the old code's time
                result.us_before, result.timed, result.before_fresh = old[1], old[2], key in self.timed_now
        return results

    def cases(self, ops: list[str] | None, serving: checks.Serving) -> list[tuple[str, tuple[int, ...]]]:
        """The (op, shape) cases of `tsdev check` for the named ops (all when None), at the serving shapes, in the
        order they run; ValueError for a name no op family declares. Names, not checks: each case looks its op up
        again when it runs (`check_one`), so a reload between two cases is checked as the code that serves."""
        declared = checks.declared()
        unknown = sorted(set(ops or ()) - {c.op for c in declared})
        if unknown:
            raise ValueError(f"no kernel check declares {', '.join(unknown)}: the ops are "
                             f"{', '.join(c.op for c in declared)}")
        if not checks.runnable(serving.device):
            return []
        return [(check.op, tuple(shape)) for check in declared
                if (ops is None or check.op in ops) and serving.dtype in check.tolerance
                for shape in check.shapes(serving)]

    def check_one(self, op: str, shape: tuple[int, ...], serving: checks.Serving, idle: bool) -> checks.Result:
        """One case of `tsdev check` (on the engine thread: one call per case, so that steps run between cases),
        timed if `idle` on CUDA; the time is kept as the next reload's 'before', fresh."""
        declared = checks.declared()
        check = next((c for c in declared if c.op == op), None)
        if check is None:  # a reload between two cases removed it
            return checks.Result(op, shape, str(serving.dtype).removeprefix("torch."), math.inf, math.inf, 0.0, 0.0,
                                 False, 0, error="no longer declared: a reload during the check removed it")
        result = checks.run_all([(check, shape)], serving.dtype, serving.device)[0]
        if idle and serving.device.startswith("cuda") and not result.error:
            timing = checks.time_call(check, shape, serving.dtype, serving.device)
            result.us, result.timed = timing.us, timing.how
            self.limit(check, result, timing.cost, serving)
            key = (op, shape, serving.dtype)
            self.times[key] = (checks.fingerprints([check])[op], result.us, result.timed)
            self.timed_idle.add(key)
        return result

    def time_new(self, results: list[checks.Result], serving: checks.Serving, idle: bool) -> None:
        """Time the new code of the checked ops (after serving resumed, if idle), and keep it as their next
        'before'."""
        if not (results and idle and serving.device.startswith("cuda")):
            return
        declared = {c.op: c for c in checks.declared()}
        now = checks.fingerprints(list(declared.values()))
        for result in results:
            check = declared.get(result.op)
            if check is None or result.error:
                continue
            timing = checks.time_call(check, result.shape, serving.dtype, serving.device)
            if result.timed not in (None, timing.how):  # the old code's time is not comparable
                result.us_before = None
            result.us, result.timed = timing.us, timing.how
            self.times[(result.op, result.shape, serving.dtype)] = (now[result.op], result.us, timing.how)
            self.limit(check, result, timing.cost, serving)

    def limit(self, check: checks.KernelCheck, result: checks.Result, cost: tuple[int, int] | None,
              serving: checks.Serving) -> None:
        """The timed call's bytes and FLOPs (`cost`: over the inputs timed) and its share of the GPU's limit."""
        if cost is None:
            return
        result.bytes, result.flops = cost
        if self.limits is None:
            self.limits = checks.device_limits(serving.device) or False
        if self.limits and result.us:
            result.share, result.bound = checks.share_of(*cost, result.us, self.limits, check.tensor_cores)


def reported(results: list[checks.Result]) -> list[KernelCheckResult]:
    return [KernelCheckResult(op=r.op, shape=list(r.shape), dtype=r.dtype, max_abs=_finite(r.max_abs),
                              max_rel=_finite(r.max_rel), atol=r.atol, rtol=r.rtol, ok=r.ok, seed=r.seed,
                              error=r.error, us_before=r.us_before, us_after=r.us, before_fresh=r.before_fresh,
                              timed=r.timed, bytes=r.bytes, flops=r.flops, share=r.share, bound=r.bound)
            for r in results]


def describe_failure(result: checks.Result) -> str:
    shape = "x".join(map(str, result.shape))
    if result.error:
        return f"kernel check failed: {result.op} at {shape} {result.dtype}: {result.error}"
    return (f"kernel check failed: {result.op} at {shape} {result.dtype}: max error {result.max_abs:.3g} "
            f"(relative {result.max_rel:.3g}) beyond atol {result.atol:g} + rtol {result.rtol:g} (inputs seed "
            f"{result.seed}); the edit was rolled back (--kernel-check strict)")


def _finite(value: float) -> float | None:
    return None if value != value or value in (float("inf"), float("-inf")) else value


def serving_of(engine) -> checks.Serving:
    """The shapes and dtype engine `engine` serves, for the checks."""
    info, config = engine.describe(), engine.model_config
    world = max(engine.config.world_size, 1)  # tensor parallelism: each rank's part
    raw = config.raw
    return checks.Serving(tokens=serving_tokens(info.decode_graph_sizes, info.prefill_graph_buckets,
                                                engine.config.max_running),
                          hidden=config.hidden_size, intermediate=max(config.intermediate_size // world, 1),
                          q_heads=max(config.num_attention_heads // world, 1),
                          kv_heads=max(config.num_key_value_heads // world, 1), head_dim=config.head_dim,
                          page_size=info.page_size or 16, max_context=min(engine.max_model_len, 1024),
                          max_running=engine.config.max_running, vocab=config.vocab_size,
                          latent_dim=raw.get("kv_lora_rank") or 0, rope_dim=raw.get("qk_rope_head_dim") or 0,
                          experts=raw.get("num_experts") or raw.get("n_routed_experts") or 0,
                          top_k=raw.get("num_experts_per_tok") or 0,
                          moe_intermediate=(raw.get("moe_intermediate_size") or 0) // world,
                          fp8=engine.config.quantization == "fp8", fp8_blocks=config.fp8_blocks is not None,
                          kv_fp8=engine.config.kv_cache_dtype != "auto",
                          dtype=engine.runner.dtype, eps=config.rms_norm_eps, device=str(engine.runner.device))

