"""What the daemon tells its screen: one record per reload or restart, filled in as it runs, and the events
that carry them (the screen and the plain printer only read these)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from tsdev_runtime.control_protocol import WorkerReport
from tsdev.notebook import Entry, KernelRow
from tsdev.outcome import SHOWN_STEPS
from tsdev.watch.checks import Probe, Verdict


@dataclass
class ReloadRecord:
    n: int
    trigger: str  # "save", "reload all (r)", "another client"
    files: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)  # what the trigger asked for or saw changed
    started: float = field(default_factory=time.time)
    ids: list[str] = field(default_factory=list)
    steps: dict[str, float] = field(default_factory=dict)  # step -> seconds, filled in live
    current: str | None = None  # the step running now
    step_started: float = 0.0  # perf_counter() when it started
    failed: str | None = None  # the step that failed
    worker: WorkerReport | None = None  # the reply's worker (the first failing one, else rank 0)
    ranks: list[WorkerReport] = field(default_factory=list)  # every rank's entry, when the server has several
    error: str | None = None
    verdict: Verdict | None = None
    probe: Probe | None = None
    note: str = ""
    restart: str = ""  # what the reply's needs_restart leads to ("needs restart: ... → restarting the server")
    saved_at: float | None = None  # a save's modification time: when the edit the reload serves was written
    served_after_save: float | None = None  # seconds from that save to serving resumed with the new code
    settle: float | None = None  # seconds from that save to the reload's request (the watcher's settle, the queue)
    texts: dict[str, str | None] = field(default_factory=dict)  # the files' text when the reload was asked for
    done: bool = False

    def serving_split(self) -> list[tuple[str, float]]:
        """save → serving in parts that add up to it: the settle, the server's steps before serving resumed (jit,
        the checks' inputs, the pause) and the rest of its time to that point (reading, planning, the request)."""
        if self.served_after_save is None or self.settle is None or self.worker is None:
            return []
        t = self.worker.timings
        parts = [("settle", self.settle), ("jit", t.get("jit", 0.0)), ("check inputs", t.get("check_prepare", 0.0)),
                 ("pause", t.get("pause", 0.0))]
        parts.append(("read+plan", self.served_after_save - sum(seconds for _, seconds in parts)))
        return [(name, seconds) for name, seconds in parts if name != "check inputs" or seconds >= 0.005]

    @property
    def after_serving(self) -> float | None:
        """The server's seconds after serving resumed (report-mode kernel checks, the new code timed)."""
        t = self.worker.timings if self.worker else {}
        return t["total"] - t["resumed"] if "resumed" in t and "total" in t else None

    @property
    def ok(self) -> bool:
        return self.done and self.error is None

    def step_order(self) -> list[str]:
        """The steps seen so far in the order they ran, then the ones still to come."""
        seen = [s for s in self.steps if s in SHOWN_STEPS]
        return seen + [s for s in SHOWN_STEPS if s not in seen]

    @property
    def reloaded(self) -> list[str]:
        return self.worker.reloaded if self.worker else []

    @property
    def dependents(self) -> list[str]:
        return self.worker.dependents if self.worker else []

    def finish(self, worker: WorkerReport) -> None:
        """Take the reply's outcome: its timings win over the ones seen live."""
        self.worker, self.current = worker, None
        self.error = None if worker.ok else (worker.error or "the reload failed")
        self.steps.update(worker.timings)
        if self.error and self.failed is None:
            self.failed = worker.failed_step


@dataclass
class WeightsRecord(ReloadRecord):
    """A checkpoint in `--weights DIR` applied with update_weights (direct): shown like a reload, numbered apart
    ("weights #n"); `steps` holds its load and total seconds and the daemon's check."""
    path: str = ""  # the checkpoint directory, as the server is asked to load it
    message: str = ""  # the server's reply (format, bytes, seconds)
    retaken: bool = False  # the golden completion was taken again on the new weights


@dataclass
class RestartRecord:
    n: int  # 0: the first start
    reason: str
    started: float = field(default_factory=time.time)
    seconds: float = 0.0
    pid: int | None = None
    error: str | None = None
    verdict: Verdict | None = None
    probe: Probe | None = None
    note: str = ""
    done: bool = False
    standby: bool = False  # a standby process took the start (tsdev/launch/standby.py)
    served_after_save: float | None = None  # from the saved file's modification time to healthy again
    stopped: float | None = None  # seconds the old server took to stop (a restart's, before `seconds` began)
    startup: dict[str, float] = field(default_factory=dict)  # the new server's own account (ServerInfo.startup)
    # when (time.time()) the restart began, its arguments went to the standby and /health first answered (the
    # daemon's), and the server's ServerInfo.moments: `restart_parts` splits the hand-over and health checks by them
    moments: dict[str, float] = field(default_factory=dict)


def outcome_of(record: ReloadRecord | RestartRecord) -> str:
    """The notebook's word for how a reload or restart ended (tsdev.notebook.OUTCOMES)."""
    if isinstance(record, RestartRecord):
        return "restart failed" if record.error else "restarted"
    checks = record.worker.kernel_checks if record.worker else []
    if (record.error and "kernel check failed" in record.error) or any(not c.ok for c in checks):
        return "kernel check failed"  # rolled back under strict; served under report (the error tells)
    if record.error:
        return "rolled back"
    if record.worker and record.worker.needs_restart:
        return "needs restart"
    return "ok" if record.reloaded or isinstance(record, WeightsRecord) else "nothing to reload"


def entry_of(record: ReloadRecord | RestartRecord, daemon: str = "") -> Entry:
    """What the notebook keeps of a finished reload or restart."""
    verdict = record.verdict
    entry = Entry(at=record.started, kind="restart" if isinstance(record, RestartRecord) else
                  "weights" if isinstance(record, WeightsRecord) else "reload",
                  trigger=record.reason if isinstance(record, RestartRecord) else record.trigger,
                  outcome=outcome_of(record), error=record.error, golden=verdict.text() if verdict else None,
                  golden_same=verdict.same if verdict else None, decode_ms=record.probe.ms if record.probe else None,
                  served_s=record.served_after_save, note=record.note, daemon=daemon)
    if isinstance(record, ReloadRecord):
        entry.files = dict(record.texts) or dict.fromkeys(record.files)
        entry.modules = list(record.reloaded or record.modules)
        worker = record.worker
        entry.changed = sorted(worker.kernels) if worker else []
        entry.kernels = [KernelRow(c.op, "x".join(map(str, c.shape)), c.dtype, c.ok, c.max_abs, c.us_before,
                                   c.us_after, c.bytes, c.flops, c.share, c.bound, c.error)
                         for c in (worker.kernel_checks if worker else [])]
    return entry


@dataclass
class Event:
    # state | message | reload_started (a WeightsRecord too) | reload_step | reload_finished | restart_started |
    # restart_finished
    kind: str
    record: ReloadRecord | RestartRecord | None = None
    text: str = ""
    level: str = "info"  # info | warning | error
