"""`tsdev watch`: a daemon that keeps a server running the code on disk (see docs/watch.md).

watcher.py turns editor saves into settled batches of changed modules; daemon.py runs the child server
(tsdev.launch.child), queues the work (jobs.py), reloads (reloads.py) or restarts, and checks each
reload (checks.py), talking to the server through link.py; it reports records (records.py) that tui.py
and plain.py show. args.py holds the settings and passes `tsdev serve` flags through.
"""
from tsdev.watch.args import WatchConfig, serve_flags, split_server_args
from tsdev.watch.daemon import Daemon


def run(config: WatchConfig, tui: bool = True) -> int:
    if tui:
        from tsdev.watch.tui import run_tui

        return run_tui(config)
    from tsdev.watch.plain import run_plain

    return run_plain(config)


__all__ = ["Daemon", "WatchConfig", "run", "serve_flags", "split_server_args"]
