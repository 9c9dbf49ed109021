"""Capture ranges that close themselves after N engine steps.

CUDA_PROFILER opens a cudaProfilerStart/Stop range, which `nsys --capture-range=cudaProfilerApi` turns
into one report per range; TORCH records a torch.profiler trace (Chrome/Perfetto JSON) per range.
Every method runs on the engine thread.
"""
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tsdev_runtime.control_protocol import ProfileRange

ACTIVITIES = ("CUDA_PROFILER", "TORCH")


@dataclass
class Range:
    n: int
    activities: list[str]
    num_steps: int
    output_dir: Path
    name: str
    steps_left: int
    torch_profiler: object = None


class RangeOpen(ValueError):
    """A capture range is open: another cannot start yet (the HTTP layer answers 409)."""


_kineto_started = False


def start_kineto(kinds: list) -> None:
    """Start torch's profiler (kineto) once, empty, with the activities `kinds` of the ranges to come, on the main
    thread (the one that imported torch). Its first start initialises it, and on any other thread -- the engine's,
    where the ranges start -- prints "ERROR: External init callback must run in same thread as registerClient"
    (torch 2.13: harmless, but it reads as a failure)."""
    global _kineto_started
    if _kineto_started or threading.current_thread() is not threading.main_thread():
        return
    _kineto_started = True
    empty = torch.profiler.profile(activities=kinds)
    empty.start()
    empty.stop()


class StepProfiler:
    def __init__(self, device: str | torch.device, default_dir: Path = Path("profiles"),
                 on_main_thread: Callable[[Callable[[], None]], None] = lambda fn: fn()):
        """`on_main_thread(fn)`: runs fn on the main thread and waits (the server's: its event loop's), from the
        engine's thread, where `start` runs."""
        self.device, self.default_dir, self.on_main_thread = torch.device(device), default_dir, on_main_thread
        self.active: Range | None = None
        self.count = 0

    def start(self, activities: list[str], num_steps: int, output_dir: str | None = None,
              name: str | None = None) -> ProfileRange:
        if self.active is not None:
            raise RangeOpen(f"capture range {self.active.n} is still open ({self.active.steps_left} of "
                             f"{self.active.num_steps} steps left): wait for it or POST /stop_profile first")
        unknown = [a for a in activities if a not in ACTIVITIES]
        if unknown or not activities:
            raise ValueError(f"activities must be a non-empty subset of {list(ACTIVITIES)}, got {activities}")
        if num_steps < 1:
            raise ValueError("num_steps must be at least 1")
        if "CUDA_PROFILER" in activities and self.device.type != "cuda":
            raise ValueError("CUDA_PROFILER needs a CUDA device (this server runs on the CPU): use TORCH")
        self.count += 1
        out = Path(output_dir) if output_dir else self.default_dir
        r = Range(self.count, list(activities), num_steps, out, name or f"range-{self.count}", num_steps)
        if "TORCH" in activities:
            kinds = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                kinds.append(torch.profiler.ProfilerActivity.CUDA)
            self.on_main_thread(lambda: start_kineto(kinds))
            r.torch_profiler = torch.profiler.profile(activities=kinds)
            r.torch_profiler.start()
        if "CUDA_PROFILER" in activities:
            torch.cuda.synchronize(self.device)
            torch.cuda.profiler.start()
        self.active = r
        return ProfileRange(n=r.n, name=r.name, activities=r.activities, num_steps=num_steps)

    def after_step(self) -> ProfileRange | None:
        """Count a step; returns the closed range's description when this step closed it."""
        if self.active is None:
            return None
        self.active.steps_left -= 1
        return self.stop() if self.active.steps_left <= 0 else None

    def stop(self) -> ProfileRange:
        r = self.active
        if r is None:
            raise ValueError("no capture range is open")
        self.active = None
        info = ProfileRange(n=r.n, name=r.name, activities=r.activities, steps=r.num_steps - r.steps_left)
        if "CUDA_PROFILER" in r.activities:
            torch.cuda.synchronize(self.device)
            torch.cuda.profiler.stop()
        if r.torch_profiler is not None:
            r.torch_profiler.stop()
            path = r.output_dir / f"{r.name}.trace.json"
            try:  # a full disk must not fail the engine step that closed the range
                r.output_dir.mkdir(parents=True, exist_ok=True)
                r.torch_profiler.export_chrome_trace(str(path))
                info.trace = str(path)
            except OSError as exc:
                info.error = f"could not write the trace {path}: {exc.strerror or exc}"
        return info
