"""The weights drill: rounds of sleep(level 2) -> wake_up -> reload_weights, each checked against a fresh load.

After every round every parameter and buffer (derived ones included: the rotary table, fp8 scales) must hash
identical to what the engine held right after its startup load, and greedy output must be token-identical.
`tsdev weights drill` runs it, eager and with graphs; the negative control (TSDEV_DEBUG_DERIVED=skip or rebind,
runtime/tsdev_runtime/weights/processing.py) must make it fail (tests/test_sleep.py, tests/test_sleep_gpu.py).
"""
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tsdev_runtime.config import EngineConfig
from tsdev_runtime.engine.llm_engine import LLMEngine
from tsdev_runtime.engine.sequence import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [11, 7, 300, 42], [5] * 20]


class DrillFailed(AssertionError):
    pass


@dataclass
class DrillReport:
    mode: str  # eager or graphs
    rounds: int
    seconds: dict[str, list[float]] = field(default_factory=lambda: {"sleep": [], "wake": [], "reload": []})
    freed_bytes: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        mean = {k: sum(v) / max(len(v), 1) for k, v in self.seconds.items()}
        return (f"{self.mode}: {self.rounds} round(s) identical to a fresh load; mean sleep {mean['sleep']:.3f} s, "
                f"wake {mean['wake']:.3f} s, reload {mean['reload']:.3f} s, "
                f"freed {max(self.freed_bytes, default=0) / 1e9:.2f} GB")


def greedy(engine: LLMEngine, max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    return [r["token_ids"] for r in engine.generate(prompts, params)]


def drill(engine: LLMEngine, rounds: int, mode: str = "",
          on_round: Callable[[int, dict[str, float]], None] | None = None) -> DrillReport:
    """Run `rounds` rounds on `engine` (nothing running); raise DrillFailed naming what differs."""
    control = engine.control
    reference, expected = control.checksum(), greedy(engine)
    report = DrillReport(mode or ("eager" if engine.config.enforce_eager else "graphs"), rounds)
    for n in range(1, rounds + 1):
        times = {}
        start = time.perf_counter()
        report.freed_bytes.append(control.free_memory(2)["freed"])
        times["sleep"] = time.perf_counter() - start
        if control.cannot_step() is None:
            raise DrillFailed(f"round {n}: the engine says it can serve while asleep")
        start = time.perf_counter()
        control.restore_memory()
        times["wake"] = time.perf_counter() - start
        if control.cannot_step() is None:
            raise DrillFailed(f"round {n}: after a level-2 wake the engine says it can serve before a weight load")
        start = time.perf_counter()
        try:
            control.load_weights()
        except Exception as exc:
            raise DrillFailed(f"round {n}: reload_weights failed: {type(exc).__name__}: {exc}") from exc
        times["reload"] = time.perf_counter() - start
        for key, seconds in times.items():
            report.seconds[key].append(seconds)
        checksum = control.checksum()
        differ = sorted(name for name in reference.keys() | checksum.keys()
                        if reference.get(name) != checksum.get(name))
        if differ:
            raise DrillFailed(f"round {n}: {len(differ)} tensor(s) differ from the fresh load, "
                              f"e.g. {', '.join(differ[:5])}")
        output = greedy(engine)
        if output != expected:
            raise DrillFailed(f"round {n}: greedy output changed: {expected} -> {output}")
        if on_round:
            on_round(n, times)
    return report


def drill_modes(config: EngineConfig, rounds: int, modes: tuple[str, ...] = ("eager", "graphs"),
                on_round: Callable[[str, int, dict[str, float]], None] | None = None) -> list[DrillReport]:
    """The drill on a fresh engine per mode (eager: --enforce-eager; graphs: decode and prefill graphs)."""
    reports = []
    for mode in modes:
        engine = LLMEngine(dataclasses.replace(config, enforce_eager=mode == "eager"))
        reports.append(drill(engine, rounds, mode, (lambda n, t, m=mode: on_round(m, n, t)) if on_round else None))
        del engine
    return reports


def fresh_checksum(config: EngineConfig, path: str | None = None) -> dict[str, str]:
    """name -> sha256 of every parameter and persistent buffer of a fresh load of `path` (default: the config's
    model) built as `config` says (device, dtype, quantization), without a KV pool or graphs: what
    GET /v1/rl/engine/weights_checksum of a server on those weights answers (`tsdev weights verify`)."""
    import torch

    from tsdev_runtime.engine.model_runner import Checkpoint, loaded_model
    from tsdev_runtime.engine.sleep import weights_checksum

    checkpoint = Checkpoint.open(dataclasses.replace(config, model=path or config.model))
    weights = loaded_model(checkpoint.config, checkpoint.dir, config, torch.device(config.device),
                           config.torch_dtype(checkpoint.config))
    return weights_checksum(weights.model, derived=False)
