"""Rank 0 drives the other ranks of a tensor-parallel engine (`tsdev_runtime.distributed`).

Why: the ranks' forwards meet in collectives, so every rank must make the same runner calls in the same order.
Rank 0 (scheduler, HTTP server, reload) sends each call it makes on its runner; the others `follow`, with only a
model runner each. A call that fails on every rank alike raises on rank 0; one that fails on some ranks only, or
differently, or a rank that does not answer, stops the server, since the ranks may be out of step
(docs/parallel.md, "What runs in step, and what is agreed"). `RankLedger` keeps each rank's outcome per call for the
reload reply.
"""
import time
from dataclasses import dataclass, field

from tsdev_runtime import distributed
from tsdev_runtime.control_protocol import StaleDefinition
from tsdev_runtime.engine.errors import describe_error, stop_server

STOP = "stop"
LAUNCH = "launch"
RELOAD, COMMIT, ROLLBACK = "reload", "commit", "rollback"
REBUILD, RESTORE = "rebuild_model", "restore_model"
# The runner's methods that run on every rank, ending with every rank's outcome: what rank 0 sends (DrivenRunner's
# methods of these names) and what the other ranks accept (`follow`); each with the reload step its seconds count
# towards in a rank's entry of the reload reply (None: no step). A new rank-wide method is a line here and a method
# of DrivenRunner.
RANK_CALLS = {"start": None, "warmup": "warm", "capture_graphs": "recapture", "capture_next": None, "sleep": None,
              "wake_up": None, "begin_update": None, "load_update": None, REBUILD: "rebuild"}


class RankFailed(RuntimeError):
    """A call failed on another rank (rank 0's own failures raise as they are)."""


class RankLost(RuntimeError):
    """Some rank did not answer within the control group's timeout: it is wedged (or gone), so the ranks can no
    longer run in step and the server must stop."""


@dataclass
class RankOutcome:
    rank: int
    call: str
    error: str | None
    seconds: float
    report: dict = field(default_factory=dict)  # a reload's fields (reloaded, dependents, patched, ...)


class RankLedger:
    """Each rank's outcome of every call that ends with a gather, since `start()` (a reload reads its own)."""

    def __init__(self):
        self.outcomes: list[RankOutcome] = []

    def start(self) -> None:
        self.outcomes = []

    def record(self, outcomes: list[RankOutcome]) -> None:
        self.outcomes += outcomes

    def of(self, rank: int) -> list[RankOutcome]:
        return [o for o in self.outcomes if o.rank == rank]


def _send(call: str, args: tuple = ()) -> None:
    """Rank 0's call to the other ranks; one that cannot be sent means a rank is gone: the server stops."""
    try:
        distributed.broadcast((call, args))
    except RuntimeError as exc:
        stop_server(f"FATAL: cannot send '{call}' to the other ranks ({first_line(exc)}): a rank is gone. The "
                    "server stops (tsdev watch restarts it).")


def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


def _gather(call: str, error: str | None, seconds: float, report: dict,
            ledger: RankLedger | None) -> list[RankOutcome]:
    """Every rank's outcome of `call`, everywhere (RankLost when one does not answer in time)."""
    try:
        outcomes = distributed.gather(RankOutcome(distributed.rank(), call, error, seconds, report))
    except RuntimeError as exc:  # torch's DistBackendError: a timeout, or a peer that went away
        raise RankLost(f"a rank did not answer within {distributed.timeout_s():.0f} s after '{call}' "
                       f"(--rank-timeout): {first_line(exc)}") from exc
    if ledger is not None:
        ledger.record(outcomes)
    return outcomes


def _settle(call: str, error: str | None, seconds: float, report: dict, ledger: RankLedger | None) -> None:
    """Every rank's outcome of `call`, everywhere; on rank 0, raise RankFailed if another rank failed."""
    outcomes = _gather(call, error, seconds, report, ledger)
    failed = [o for o in outcomes[1:] if o.error is not None]
    if distributed.rank() == 0 and failed and error is None:
        raise RankFailed("; ".join(f"rank {o.rank} failed in {call}: {o.error}" for o in failed))


class DrivenRunner:
    """Rank 0's rank-wide runner calls under tensor parallelism: the methods of RANK_CALLS, `launch`,
    `restore_model` and `stop` run on every rank (tests/test_rank_calls.py holds this class, RANK_CALLS
    and ModelRunner's signatures to each other). Nothing else: what one rank reads or does alone goes to its own
    runner (`LLMEngine.runner`)."""

    def __init__(self, runner, ledger: RankLedger):
        self._runner, self.ledger = runner, ledger

    def launch(self, batch, in_flight=None, use_graphs: bool = True):
        # the sequence -> index map travels with the batch (one pickle keeps their identity); every rank uses
        # its own device tokens of the step in flight
        _send(LAUNCH, (batch, in_flight[1] if in_flight else None, use_graphs))
        return self._runner.launch(batch, in_flight, use_graphs)

    def restore_model(self, weights) -> None:
        _send(RESTORE)  # every other rank restores the model its rebuild kept
        self._runner.restore_model(weights)

    def stop(self) -> None:
        """The other ranks leave `follow` (the engine shuts down)."""
        _send(STOP)

    def start(self):
        return self._everywhere("start")

    def warmup(self):
        return self._everywhere("warmup")

    def capture_graphs(self, strict=True, first=None):
        return self._everywhere("capture_graphs", strict, first)

    def capture_next(self):
        return self._everywhere("capture_next")

    def sleep(self, level):
        return self._everywhere("sleep", level)

    def wake_up(self, tags=None):
        return self._everywhere("wake_up", tags)

    def begin_update(self, model_dir):
        return self._everywhere("begin_update", model_dir)

    def load_update(self, model_dir, mode):
        return self._everywhere("load_update", model_dir, mode)

    def rebuild_model(self, model_dir):
        return self._everywhere(REBUILD, model_dir)

    def _everywhere(self, call: str, *args):
        """`call` on every rank. A failure on every rank alike raises here as rank 0's; any other failure stops
        the server (the ranks may be out of step: different collectives run, different states)."""
        _send(call, args)
        start, error, result, failure = time.perf_counter(), None, None, None
        try:
            result = getattr(self._runner, call)(*args)
        except Exception as exc:
            error, failure = describe_error(exc), exc
        outcomes = _gather(call, error, time.perf_counter() - start, {}, self.ledger)
        errors = {o.rank: o.error for o in outcomes if o.error is not None}
        if not errors:
            return result
        if len(errors) < len(outcomes) or len(set(errors.values())) > 1:
            stop_server(f"FATAL: '{call}' failed on rank(s) {', '.join(map(str, errors))} only, or differently "
                        f"({'; '.join(f'rank {r}: {e}' for r, e in errors.items())}): the ranks may be out of "
                        "step. The server stops (tsdev watch restarts it).")
        raise failure


class RankedReloader:
    """Rank 0's reloader under tensor parallelism: rank 0 reads the sources once and plans and compiles ahead on
    its own; `reload` applies them here, then on every other rank (the same bytes); the transaction commits or
    rolls back every rank."""

    def __init__(self, reloader, ledger: RankLedger):
        self._reloader, self.ledger = reloader, ledger

    def read_sources(self):
        return self._reloader.read_sources()

    def plan(self, sources=None, modules=None):
        return self._reloader.plan(sources=sources, modules=modules)

    def modules(self):
        return self._reloader.modules()

    def compile_ahead(self, sources=None, modules=None, prepared=None):
        return self._reloader.compile_ahead(sources, modules, prepared)

    def reload(self, modules=None, sources=None):
        tx = self._reloader.reload(modules=modules, sources=sources)
        if not tx.report.ok:  # rolled back already; the other ranks never saw it
            return tx
        _send(RELOAD, (modules, sources))
        try:
            _settle(RELOAD, None, 0.0, {}, self.ledger)
        except RankFailed as exc:
            tx.rollback(str(exc))  # its report: not ok, with that rank's error; committing it raises
            _send(ROLLBACK, (str(exc),))  # ranks whose reload succeeded undo it
            _settle(ROLLBACK, None, 0.0, {}, self.ledger)
            return tx
        return _AllRanks(tx, self.ledger)


class _AllRanks:
    def __init__(self, tx, ledger: RankLedger):
        self.tx, self.report, self.ledger = tx, tx.report, ledger

    def commit(self) -> None:
        self.tx.commit()
        _send(COMMIT)
        _settle(COMMIT, None, 0.0, {}, self.ledger)

    def rollback(self, reason: str | None = None) -> None:
        self.tx.rollback(reason)
        _send(ROLLBACK, (reason,))
        _settle(ROLLBACK, None, 0.0, {}, self.ledger)


def reported(report) -> dict:
    """The WorkerReport fields a reloader's report fills (on rank 0 for its entry, on the others for theirs)."""
    return dict(reloaded=list(report.reloaded), dependents=list(report.dependents), patched=report.patched,
                stale=[StaleDefinition.model_validate(s) for s in report.stale],
                needs_restart=list(report.needs_restart), jit_kernels=report.jit_kernels,
                kernels=dict(getattr(report, "kernels", {})), kernels_only=getattr(report, "kernels_only", False),
                compiled_in_pause=dict(getattr(report, "compiled_in_pause", {})))


STEP_OF_CALL = {RELOAD: "reload", **{call: step for call, step in RANK_CALLS.items() if step}}


def rank_entries(ledger: RankLedger, rank0_ok: bool) -> list[dict]:
    """WorkerReport fields of every rank but 0 for the calls in the ledger (a reload's): ok unless a call failed
    there (its first error), seconds per reload step, and what its reloader reported. A rank that was asked
    nothing shares rank 0's outcome (nothing to reload), or says it did not run (rank 0 failed first)."""
    entries = []
    for rank in range(1, distributed.size()):
        outcomes = ledger.of(rank)
        errors = [f"{o.call}: {o.error}" for o in outcomes if o.error is not None]
        if not outcomes and not rank0_ok:
            errors = ["did not run: the reload failed on rank 0 before this rank was asked"]
        timings, fields = {}, {}
        for o in outcomes:
            if o.call in STEP_OF_CALL:
                step = STEP_OF_CALL[o.call]
                timings[step] = timings.get(step, 0.0) + o.seconds
            fields.update(o.report)
        entries.append(dict(rank=rank, ok=not errors, error=errors[0] if errors else None, timings=timings, **fields))
    return entries


def follow(runner, reloader=None) -> None:
    """A rank other than 0: make every call rank 0 makes on its runner (and reloader), until it stops."""
    tokens, kept_model, tx = None, None, None
    while True:
        call, args = distributed.broadcast()
        if call == STOP:
            return
        if call == LAUNCH:
            batch, index, use_graphs = args
            sampled = runner.launch(batch, None if index is None else (tokens, index), use_graphs)
            tokens = None if sampled is None else sampled.tokens
            continue
        if call == RESTORE:  # rank 0 does not wait for it
            if kept_model is not None:
                runner.restore_model(kept_model)
            kept_model = None
            continue
        start, error, report = time.perf_counter(), None, {}
        try:
            if call == REBUILD:
                kept_model = runner.rebuild_model(*args)
            elif call == RELOAD:
                modules, sources = args
                tx = reloader.reload(modules=modules, sources=sources)
                report = reported(tx.report)
                if not tx.report.ok:
                    error, tx = tx.report.error or "the reload failed", None
            elif call == COMMIT:
                if tx is not None:
                    tx.commit()
                tx, kept_model = None, None
            elif call == ROLLBACK:
                if tx is not None:
                    tx.rollback(*args)
                tx = None
            elif call in RANK_CALLS:
                getattr(runner, call)(*args)
            else:  # rank 0 sends only what RANK_CALLS declares: a different version of this code
                raise RuntimeError(f"rank 0 asked for {call!r}, which is not a rank-wide call (RANK_CALLS)")
        except Exception as exc:
            error = describe_error(exc)
        _settle(call, error, time.perf_counter() - start, report, None)
