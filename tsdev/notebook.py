"""The kernel author's notebook: one SQLite file per project in tsdev's cache directory, one row per save (or
restart) the watch daemon saw -- the files it read and their text (deduplicated by hash, so any version can be shown
and restored), the reload's outcome and golden result, and per changed kernel and served shape its error, µs before
and after, bytes and FLOPs per call and share of the GPU's limit.

Writers append (a watch daemon, through `Writer`'s thread: never on a save → serving); `tsdev history` reads
(tsdev/history.py). WAL mode and a busy timeout let two daemons of one project write at once. No torch here:
`tsdev history` answers in a fraction of a second.
"""
from __future__ import annotations

import hashlib
import queue
import sqlite3
import statistics
import threading
import time
import tomllib
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tsdev_kernels.cache import cache_dir

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS saves(
    id INTEGER PRIMARY KEY, at REAL NOT NULL, kind TEXT NOT NULL, trigger TEXT NOT NULL, outcome TEXT NOT NULL,
    error TEXT, golden TEXT, golden_same INTEGER, decode_ms REAL, served_s REAL, modules TEXT, changed TEXT,
    note TEXT, daemon TEXT);
CREATE INDEX IF NOT EXISTS saves_at ON saves(at);
CREATE INDEX IF NOT EXISTS saves_outcome ON saves(outcome, at);
CREATE TABLE IF NOT EXISTS texts(hash TEXT PRIMARY KEY, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files(save_id INTEGER NOT NULL, path TEXT NOT NULL, hash TEXT);
CREATE INDEX IF NOT EXISTS files_save ON files(save_id);
CREATE INDEX IF NOT EXISTS files_path ON files(path, save_id);
CREATE INDEX IF NOT EXISTS files_hash ON files(hash);
CREATE TABLE IF NOT EXISTS kernels(
    save_id INTEGER NOT NULL, op TEXT NOT NULL, shape TEXT NOT NULL, dtype TEXT, ok INTEGER NOT NULL, max_abs REAL,
    us_before REAL, us_after REAL, bytes INTEGER, flops INTEGER, share REAL, bound TEXT, error TEXT);
CREATE INDEX IF NOT EXISTS kernels_save ON kernels(save_id);
CREATE INDEX IF NOT EXISTS kernels_op ON kernels(op, shape, save_id);
CREATE INDEX IF NOT EXISTS kernels_best ON kernels(op, shape, ok, us_after);
"""
BUSY_MS = 10_000  # a writer waits this long for another's transaction (two daemons, `tsdev history --prune`)
OUTCOMES = ("ok", "nothing to reload", "rolled back", "kernel check failed", "needs restart", "restarted",
            "restart failed")
KEEP_DAYS, MAX_MB = 90.0, 200.0  # pruning's defaults: [tool.tsdev] history-keep-days / history-max-mb override them


def notebook_path(project: str | Path) -> Path:
    """The project's notebook: named by its folder and a hash of its resolved path (two checkouts, two notebooks)."""
    root = Path(project).resolve()
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return cache_dir() / "notebook" / f"{root.name or 'root'}-{digest}.sqlite"


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class KernelRow:
    """One kernel at one served shape in one save."""
    op: str
    shape: str  # "256x1024"
    dtype: str | None
    ok: bool
    max_abs: float | None = None
    us_before: float | None = None
    us_after: float | None = None
    bytes: int | None = None
    flops: int | None = None
    share: float | None = None  # of the GPU's limit at us_after
    bound: str | None = None  # which limit: "bandwidth", "bf16 tensor cores", "fp8 tensor cores"
    error: str | None = None


@dataclass
class Entry:
    """A save as the notebook keeps it (pure data: built on the daemon's loop, written on the writer's thread)."""
    at: float
    kind: str  # reload | restart | weights
    trigger: str
    outcome: str  # one of OUTCOMES
    files: dict[str, str | None] = field(default_factory=dict)  # path (from the project) -> its text (None: gone)
    kernels: list[KernelRow] = field(default_factory=list)
    error: str | None = None
    golden: str | None = None  # the verdict's words ("golden: same 24 tokens")
    golden_same: bool | None = None
    decode_ms: float | None = None
    served_s: float | None = None  # save → serving
    modules: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # the kernels the reload replaced (module.name)
    note: str = ""
    daemon: str = ""  # the writing daemon's session (two daemons of one project tell apart)


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=BUSY_MS / 1000, isolation_level=None, check_same_thread=False)
    db.execute(f"PRAGMA busy_timeout={BUSY_MS}")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, a save's record is no bank transfer
    db.executescript(SCHEMA)
    return db


class Notebook:
    """A connection to one project's notebook, for writing and reading."""

    def __init__(self, path: str | Path, project: str | Path | None = None):
        self.path = Path(path)
        self.db = connect(self.path)
        if project is not None:
            self.db.execute("INSERT OR IGNORE INTO meta VALUES ('project', ?)", (str(Path(project).resolve()),))

    @classmethod
    def of(cls, project: str | Path) -> Notebook:
        return cls(notebook_path(project), project)

    @property
    def project(self) -> Path | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = 'project'").fetchone()
        return Path(row[0]) if row else None

    def close(self) -> None:
        self.db.close()

    # --- writing ---------------------------------------------------------------------------------------------------

    def add(self, entry: Entry) -> int:
        """Append one save in one transaction; its id."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            save_id = db.execute(
                "INSERT INTO saves(at, kind, trigger, outcome, error, golden, golden_same, decode_ms, served_s, "
                "modules, changed, note, daemon) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (entry.at, entry.kind, entry.trigger, entry.outcome, entry.error, entry.golden,
                 None if entry.golden_same is None else int(entry.golden_same), entry.decode_ms, entry.served_s,
                 ",".join(entry.modules), ",".join(entry.changed), entry.note, entry.daemon)).lastrowid
            for path, text in entry.files.items():
                digest = None if text is None else text_hash(text)
                if digest is not None:
                    db.execute("INSERT OR IGNORE INTO texts VALUES (?, ?)", (digest, text))
                db.execute("INSERT INTO files VALUES (?, ?, ?)", (save_id, path, digest))
            db.executemany("INSERT INTO kernels VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                           [(save_id, k.op, k.shape, k.dtype, int(k.ok), k.max_abs, k.us_before, k.us_after, k.bytes,
                             k.flops, k.share, k.bound, k.error) for k in entry.kernels])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return save_id

    # --- reading ---------------------------------------------------------------------------------------------------

    def saves(self, kernel: str | None = None, file: str | None = None, since: float | None = None,
              outcome: str | None = None, limit: int | None = None) -> list[sqlite3.Row]:
        """The saves, newest first, with their files and kernels (comma-joined), filtered."""
        where, args = [], []
        if kernel:
            where.append("s.id IN (SELECT save_id FROM kernels WHERE op = ?)")
            args.append(kernel)
        if file:
            where.append("s.id IN (SELECT save_id FROM files WHERE path = ? OR path LIKE ?)")
            args += [file, f"%{file}"]
        if since is not None:
            where.append("s.at >= ?")
            args.append(since)
        if outcome:
            where.append("s.outcome = ?")
            args.append(outcome)
        sql = ("SELECT s.*, (SELECT group_concat(path, ', ') FROM files WHERE save_id = s.id) AS paths, "
               "(SELECT group_concat(DISTINCT op) FROM kernels WHERE save_id = s.id) AS ops FROM saves s"
               + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY s.id DESC"
               + (f" LIMIT {int(limit)}" if limit else ""))
        cursor = self.db.execute(sql, args)
        cursor.row_factory = sqlite3.Row
        return cursor.fetchall()

    def kernel_rows(self, op: str, shape: str | None = None) -> list[sqlite3.Row]:
        """The kernel's rows across saves, oldest first, with their save's time and outcome."""
        cursor = self.db.execute(
            "SELECT k.*, s.at, s.outcome FROM kernels k JOIN saves s ON s.id = k.save_id WHERE k.op = ?"
            + (" AND k.shape = ?" if shape else "") + " ORDER BY k.save_id", (op, shape) if shape else (op,))
        cursor.row_factory = sqlite3.Row
        return cursor.fetchall()

    def ops(self) -> list[str]:
        return [row[0] for row in self.db.execute("SELECT DISTINCT op FROM kernels ORDER BY op")]

    def best(self, op: str, shape: str | None = None) -> sqlite3.Row | None:
        """The fastest passing row of `op` (at `shape`, else at any): its save kept the version's text. A row is
        passing when its check passed and its save was not rolled back."""
        cursor = self.db.execute(
            "SELECT k.*, s.at, s.outcome FROM kernels k JOIN saves s ON s.id = k.save_id WHERE k.op = ? AND k.ok = 1 "
            "AND k.us_after IS NOT NULL AND s.outcome = 'ok'" + (" AND k.shape = ?" if shape else "")
            + " ORDER BY k.us_after, k.save_id DESC LIMIT 1", (op, shape) if shape else (op,))
        cursor.row_factory = sqlite3.Row
        return cursor.fetchone()

    def files_of(self, save_id: int) -> list[tuple[str, str | None]]:
        """(path, text) of each file a save read (text None: the file was gone)."""
        return self.db.execute("SELECT f.path, t.text FROM files f LEFT JOIN texts t ON t.hash = f.hash "
                               "WHERE f.save_id = ? ORDER BY f.path", (save_id,)).fetchall()

    def version_of(self, path: str, save_id: int) -> str | None:
        """The text `path` had at save `save_id`: the file as that save read it, else as the last save before it that
        read it (a save records only the files it saw change)."""
        row = self.db.execute("SELECT t.text FROM files f JOIN texts t ON t.hash = f.hash WHERE f.path = ? AND "
                              "f.save_id <= ? ORDER BY f.save_id DESC LIMIT 1", (path, save_id)).fetchone()
        return row[0] if row else None

    def recent_us(self, limit: int = 500) -> dict[str, list[float]]:
        """op -> its last saves' µs (the median over its shapes timed after each edit), oldest first."""
        by_save: dict[tuple[int, str], list[float]] = {}
        for save_id, op, us in self.db.execute(
                "SELECT save_id, op, us_after FROM kernels WHERE us_after IS NOT NULL AND save_id > "
                "(SELECT coalesce(max(id), 0) - ? FROM saves) ORDER BY save_id", (limit,)):
            by_save.setdefault((save_id, op), []).append(us)
        recent: dict[str, list[float]] = {}
        for (_, op), values in by_save.items():
            recent.setdefault(op, []).append(statistics.median(values))
        return recent

    # --- pruning ---------------------------------------------------------------------------------------------------

    def kept_best(self) -> set[int]:
        """The saves holding some kernel's fastest passing version at some shape: never pruned."""
        return {row[0] for row in self.db.execute(
            "SELECT (SELECT k2.save_id FROM kernels k2 JOIN saves s ON s.id = k2.save_id WHERE k2.op = k.op AND "
            "k2.shape = k.shape AND k2.ok = 1 AND k2.us_after IS NOT NULL AND s.outcome = 'ok' "
            "ORDER BY k2.us_after, k2.save_id DESC LIMIT 1) FROM (SELECT DISTINCT op, shape FROM kernels) k")
            if row[0] is not None}

    def used_mb(self) -> float:
        pages, free, size = (self.db.execute(f"PRAGMA {name}").fetchone()[0]
                             for name in ("page_count", "freelist_count", "page_size"))
        return (pages - free) * size / 1e6

    def prune(self, keep_days: float | None = KEEP_DAYS, max_mb: float | None = MAX_MB,
              now: float | None = None) -> int:
        """Delete saves older than `keep_days`, then the oldest until the notebook uses at most `max_mb`, never the
        saves holding a kernel's best version (nor the texts they need); the number deleted."""
        keep, deleted = self.kept_best(), 0
        if keep_days is not None:
            old = [row[0] for row in self.db.execute("SELECT id FROM saves WHERE at < ?",
                                                     ((now or time.time()) - keep_days * 86400,))]
            deleted += self._delete([i for i in old if i not in keep])
        while max_mb is not None and self.used_mb() > max_mb:
            candidates = [row[0] for row in self.db.execute("SELECT id FROM saves ORDER BY id") if row[0] not in keep]
            if not candidates:
                break
            deleted += self._delete(candidates[:max(1, len(candidates) // 10)])
        return deleted

    def _delete(self, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("CREATE TEMP TABLE IF NOT EXISTS gone(id INTEGER PRIMARY KEY)")
            db.execute("DELETE FROM gone")
            db.executemany("INSERT INTO gone VALUES (?)", [(i,) for i in ids])
            for table, column in (("kernels", "save_id"), ("files", "save_id"), ("saves", "id")):
                db.execute(f"DELETE FROM {table} WHERE {column} IN (SELECT id FROM gone)")
            db.execute("DELETE FROM texts WHERE hash NOT IN (SELECT hash FROM files WHERE hash IS NOT NULL)")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return len(ids)


def prune_settings(project: str | Path) -> tuple[float | None, float | None]:
    """(keep days, max MB) from [tool.tsdev] history-keep-days / history-max-mb of the project's pyproject.toml (0:
    no limit), else the defaults."""
    config = {}
    pyproject = Path(project) / "pyproject.toml"
    if pyproject.is_file():
        with open(pyproject, "rb") as f:
            config = tomllib.load(f).get("tool", {}).get("tsdev", {})
    days, mb = config.get("history-keep-days", KEEP_DAYS), config.get("history-max-mb", MAX_MB)
    return (float(days) or None), (float(mb) or None)


def read_texts(project: Path, files: Iterable[str]) -> dict[str, str | None]:
    """Each saved file's text as it is now (None: gone or not text), read when the reload is asked for."""
    texts = {}
    for name in files:
        try:
            texts[name] = (project / name).read_text()
        except (OSError, UnicodeDecodeError):
            texts[name] = None
    return texts


class Writer:
    """The daemon's notebook: entries go into a queue and one thread writes them (a save → serving never waits on
    the disk); `recent` keeps each kernel's last saves' µs for the screen's sparklines, loaded from the notebook at
    start and extended as entries come."""
    SPARK = 16  # saves a sparkline shows

    def __init__(self, path: Path, project: Path, prune: tuple[float | None, float | None] | None = None):
        self.path, self.project = path, project
        self.queue: queue.Queue[Entry | None] = queue.Queue()
        self.recent: dict[str, deque[float]] = {}
        self.errors: list[str] = []
        self.written = 0
        self.write_seconds: list[float] = []  # each entry's write (the thread's, off the save → serving)
        self._lock = threading.Lock()
        self._loaded = threading.Event()
        self._prune = prune
        self._thread = threading.Thread(target=self._run, name="tsdev-notebook", daemon=True)
        self._thread.start()

    def put(self, entry: Entry) -> None:
        with self._lock:
            for row_op, us in _medians(entry.kernels).items():
                self.recent.setdefault(row_op, deque(maxlen=self.SPARK)).append(us)
        self.queue.put(entry)

    def sparkline_of(self, op: str) -> list[float]:
        with self._lock:
            return list(self.recent.get(op, ()))

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every entry put so far is written."""
        done = threading.Event()
        self.queue.put(done)  # type: ignore[arg-type]
        done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self.queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            notebook = Notebook(self.path, self.project)
        except sqlite3.Error as exc:
            self.errors.append(f"cannot open the notebook {self.path}: {exc}")
            self._loaded.set()
            return
        try:
            with self._lock:
                for op, values in notebook.recent_us().items():
                    self.recent[op] = deque([*values[-self.SPARK:], *self.recent.get(op, ())], maxlen=self.SPARK)
            self._loaded.set()
            if self._prune:
                notebook.prune(*self._prune)
            while (entry := self.queue.get()) is not None:
                if isinstance(entry, threading.Event):
                    entry.set()
                    continue
                start = time.perf_counter()
                try:
                    notebook.add(entry)
                    self.written += 1
                except sqlite3.Error as exc:
                    self.errors.append(f"notebook: {exc}")
                self.write_seconds.append(time.perf_counter() - start)
        finally:
            notebook.close()


def _medians(rows: Iterable[KernelRow]) -> dict[str, float]:
    by_op: dict[str, list[float]] = {}
    for row in rows:
        if row.us_after is not None:
            by_op.setdefault(row.op, []).append(row.us_after)
    return {op: statistics.median(values) for op, values in by_op.items()}


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float]) -> str:
    """'▁▃▅█': each value's height between the smallest and the largest."""
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - low) / span * (len(SPARKS) - 1) + 0.5))] for v in values)
