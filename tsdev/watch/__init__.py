"""`tsdev watch`: a daemon that keeps a server running the code on disk (see docs/watch.md).

watcher.py turns editor saves into settled batches of changed modules; daemon.py runs the child
server, reloads or restarts it, and checks each reload (checks.py); tui.py and plain.py show it.
"""
from tsdev.watch.daemon import Daemon, WatchConfig, split_server_args


def serve_flags(command) -> dict[str, bool]:
    """{flag: takes a value} of a click command (`tsdev serve`), to pass its flags through watch."""
    return {opt: not param.is_flag for param in command.params if param.param_type_name == "option"
            for opt in (*param.opts, *param.secondary_opts)}


def run(config: WatchConfig, tui: bool = True) -> int:
    if tui:
        from tsdev.watch.tui import run_tui

        return run_tui(config)
    from tsdev.watch.plain import run_plain

    return run_plain(config)


__all__ = ["Daemon", "WatchConfig", "run", "serve_flags", "split_server_args"]
