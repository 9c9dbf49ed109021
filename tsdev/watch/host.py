"""What the daemon offers the parts that run its jobs -- reloads.py, restarts.py and weights.py: the server and the
link to it, the job queue, the checks, the daemon's flags, and the calls that tell the screen. The daemon builds those
parts and hands itself to them as a `Host`; they import this module, never daemon.py, so no part and the daemon import
each other (tests/test_no_import_cycles.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tsdev.launch.child import ServerProcess
    from tsdev.notebook import Writer
    from tsdev.watch.args import WatchConfig
    from tsdev.watch.checks import Checker
    from tsdev.watch.jobs import Jobs
    from tsdev.watch.link import ServerLink
    from tsdev.watch.records import ReloadRecord, RestartRecord
    from tsdev.watch.watcher import Watcher


class Host(Protocol):
    config: WatchConfig
    link: ServerLink
    server: ServerProcess | None  # None: attached to a server tsdev watch did not start
    jobs: Jobs
    checker: Checker
    watcher: Watcher  # rescanned before a (re)start imports the sources
    notebook: Writer | None
    info: dict  # what the screen's header shows: state, url, model, device, pid, ...
    down: bool  # the server failed to start or exited, and no restart has brought it back yet

    @property
    def paused(self) -> bool: ...

    @property
    def sleeping(self) -> bool: ...

    @property
    def stopping(self) -> bool: ...

    def emit(self, kind: str, record=None, text: str = "", level: str = "info") -> None: ...

    def message(self, text: str, level: str = "info") -> None: ...

    def set_state(self, state: str, **info) -> None: ...

    async def check(self, record: ReloadRecord | RestartRecord, golden: bool = True) -> None: ...

    def new_code_served(self) -> None:
        """A reload put new code into service: restarts after the server exited by itself count from 0 again."""
