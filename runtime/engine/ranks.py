"""Rank 0 drives the other ranks of a tensor-parallel engine (`runtime.distributed`).

Rank 0 owns the scheduler, the HTTP server and the reload; every other rank owns only a model runner (its shard
of the weights and its heads' KV pool) and `follow`s: it receives each call rank 0 makes on its runner, over the
control group, and makes the same call, so their forwards' collectives meet. A step's batch (sequences, their
pages) travels pickled with the call; every rank samples the same tokens (same logits, same seeds), so a step's
still-pending tokens are on every rank's device for the next step.

Calls that may fail (warm-up, graph capture, a model rebuild, a code reload and its commit or rollback, sleep,
wake-up, a weight update's begin and load) end
with every rank's outcome (`gather`): a failure anywhere raises on rank 0 naming the rank, so rank 0 decides
(e.g. rolls every rank back) and every rank stays in step. `RankLedger` keeps each rank's outcome and seconds
per call, for the reload reply's per-rank entries. A rank that does not answer within the control group's
timeout fails the call with a distributed error: the engine cannot go on in step, and the server stops naming
the call (`tsdev watch` restarts it).
"""
import time
import traceback
from dataclasses import dataclass, field

from runtime import distributed

STOP = "stop"
LAUNCH = "launch"
RELOAD, COMMIT, ROLLBACK = "reload", "commit", "rollback"
REBUILD, RESTORE = "rebuild_model", "restore_model"


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


def describe(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f"{frame[0].filename}:{frame[0].lineno}: " if frame else ""
    return f"{where}{type(exc).__name__}: {exc}"


def _settle(call: str, error: str | None, seconds: float, report: dict, ledger: RankLedger | None) -> None:
    """Every rank's outcome of `call`, everywhere; on rank 0, raise RankFailed if another rank failed."""
    try:
        outcomes = distributed.gather(RankOutcome(distributed.rank(), call, error, seconds, report))
    except RuntimeError as exc:  # torch's DistBackendError: a timeout, or a peer that went away
        raise RankLost(f"a rank did not answer within {distributed.timeout_s():.0f} s after '{call}' "
                       f"(--rank-timeout): {str(exc).splitlines()[0][:300]}") from exc
    if ledger is not None:
        ledger.record(outcomes)
    failed = [o for o in outcomes[1:] if o.error is not None]
    if distributed.rank() == 0 and failed and error is None:
        raise RankFailed("; ".join(f"rank {o.rank} failed in {call}: {o.error}" for o in failed))


class DrivenRunner:
    """Rank 0's ModelRunner under tensor parallelism: the calls below run on every rank; attributes and other
    methods are the runner's own."""

    def __init__(self, runner, ledger: RankLedger):
        self._runner, self.ledger = runner, ledger

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def launch(self, batch, in_flight=None, use_graphs: bool = True):
        # the sequence -> index map travels with the batch (one pickle keeps their identity); every rank uses
        # its own device tokens of the step in flight
        distributed.broadcast((LAUNCH, (batch, in_flight[1] if in_flight else None, use_graphs)))
        return self._runner.launch(batch, in_flight, use_graphs)

    def run(self, batch, use_graphs: bool = True) -> list[int]:
        tokens = self.launch(batch, use_graphs=use_graphs)
        return [] if tokens is None else tokens.tolist()

    def start(self):
        return self._everywhere("start")

    def warmup(self):
        return self._everywhere("warmup")

    def capture_graphs(self, strict: bool = True):
        return self._everywhere("capture_graphs", strict)

    def release_graphs(self):
        return self._everywhere("release_graphs")

    def sleep(self, level: int):
        return self._everywhere("sleep", level)

    def wake_up(self, tags=None):
        return self._everywhere("wake_up", tags)

    def begin_update(self, model_dir):
        return self._everywhere("begin_update", model_dir)

    def load_update(self, model_dir, mode: str):
        return self._everywhere("load_update", model_dir, mode)

    def rebuild_model(self, model_dir):
        return self._everywhere(REBUILD, model_dir)

    def restore_model(self, model) -> None:
        distributed.broadcast((RESTORE, ()))  # every other rank restores the model its rebuild kept
        self._runner.restore_model(model)

    def stop(self) -> None:
        """The other ranks leave `follow` (the engine shuts down)."""
        distributed.broadcast((STOP, ()))

    def _everywhere(self, call: str, *args):
        distributed.broadcast((call, args))
        start, error, result = time.perf_counter(), None, None
        try:
            result = getattr(self._runner, call)(*args)
        except Exception as exc:
            error = describe(exc)
            _settle(call, error, time.perf_counter() - start, {}, self.ledger)
            raise
        _settle(call, None, time.perf_counter() - start, {}, self.ledger)
        return result


class RankedReloader:
    """Rank 0's reloader under tensor parallelism: rank 0 reads the sources once; `reload` applies them here,
    then on every other rank (the same bytes); the transaction commits or rolls back every rank."""

    def __init__(self, reloader, ledger: RankLedger):
        self._reloader, self.ledger = reloader, ledger

    def __getattr__(self, name: str):  # read_sources, plan, modules, compile_ahead: rank 0's
        return getattr(self._reloader, name)

    def reload(self, modules=None, sources=None):
        tx = self._reloader.reload(modules=modules, sources=sources)
        if not tx.report.ok:  # rolled back already; the other ranks never saw it
            return tx
        distributed.broadcast((RELOAD, (modules, sources)))
        try:
            _settle(RELOAD, None, 0.0, {}, self.ledger)
        except RankFailed as exc:
            tx.rollback(str(exc))
            distributed.broadcast((ROLLBACK, (str(exc),)))  # ranks whose reload succeeded undo it
            _settle(ROLLBACK, None, 0.0, {}, self.ledger)
            return _Failed(tx.report, str(exc))
        return _AllRanks(tx, self.ledger)


class _AllRanks:
    def __init__(self, tx, ledger: RankLedger):
        self.tx, self.report, self.ledger = tx, tx.report, ledger

    def commit(self) -> None:
        self.tx.commit()
        distributed.broadcast((COMMIT, ()))
        _settle(COMMIT, None, 0.0, {}, self.ledger)

    def rollback(self, reason: str | None = None) -> None:
        self.tx.rollback(reason)
        distributed.broadcast((ROLLBACK, (reason,)))
        _settle(ROLLBACK, None, 0.0, {}, self.ledger)


class _Failed:
    """Rank 0's report of a reload another rank refused: not ok, with that rank's error."""

    def __init__(self, report, error: str):
        self.report = _FailedReport(report, error)

    def commit(self) -> None:
        raise RuntimeError("a failed reload cannot be committed")

    def rollback(self, reason: str | None = None) -> None:
        pass  # rolled back on every rank already


class _FailedReport:
    def __init__(self, report, error: str):
        self._report, self.ok, self.error = report, False, error

    def __getattr__(self, name: str):
        return getattr(self._report, name)


def reload_fields(report) -> dict:
    return dict(reloaded=list(report.reloaded), dependents=list(report.dependents), patched=report.patched)


STEP_OF_CALL = {RELOAD: "reload", REBUILD: "rebuild", "warmup": "warm", "capture_graphs": "recapture"}


def rank_entries(ledger: RankLedger) -> list[dict]:
    """WorkerReport fields of every rank but 0 for the calls in the ledger (a reload's): ok unless a call failed
    there (its first error), seconds per reload step, and what its reloader reported."""
    entries = []
    for rank in range(1, distributed.size()):
        outcomes = ledger.of(rank)
        errors = [f"{o.call}: {o.error}" for o in outcomes if o.error is not None]
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
            tokens = runner.launch(batch, None if index is None else (tokens, index), use_graphs)
            continue
        start, error, report = time.perf_counter(), None, {}
        try:
            if call == REBUILD:
                kept_model = runner.rebuild_model(*args)
            elif call == RESTORE:
                if kept_model is not None:
                    runner.restore_model(kept_model)
                kept_model = None
                continue  # rank 0 does not wait for it
            elif call == RELOAD:
                modules, sources = args
                tx = reloader.reload(modules=modules, sources=sources)
                report = reload_fields(tx.report)
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
            else:
                getattr(runner, call)(*args)
        except Exception as exc:
            error = describe(exc)
        _settle(call, error, time.perf_counter() - start, report, None)


def serve_rank(config, make_reloader=None) -> None:
    """What a rank other than 0 runs, once `distributed.init` joined it: its model runner (its shard of the
    weights, its heads' KV pool), following rank 0 until the engine stops. `make_reloader` builds this rank's
    reloader once the model code is imported (a reloader tracks the modules loaded when it is made)."""
    from runtime.engine.model_runner import Checkpoint, ModelRunner

    runner = ModelRunner(config, Checkpoint.open(config))
    follow(runner, make_reloader() if make_reloader else None)
